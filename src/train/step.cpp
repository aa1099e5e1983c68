// The micro-step (see step.h).
#include "train/step.h"

#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "core/error.h"

namespace dtune::train {
namespace {

// Enables autocast for one device type for the guard's lifetime (the UNet forward only; the loss
// is computed in float32 by diffusion::per_sample_loss).
class AutocastGuard {
  public:
    AutocastGuard(at::DeviceType device, c10::ScalarType dtype) : device_(device), on_(dtype != at::kFloat) {
        if (!on_) return;
        previous_dtype_ = at::autocast::get_autocast_dtype(device_);
        at::autocast::set_autocast_dtype(device_, dtype);
        at::autocast::set_autocast_enabled(device_, true);
    }
    ~AutocastGuard() {
        if (!on_) return;
        at::autocast::set_autocast_enabled(device_, false);
        at::autocast::set_autocast_dtype(device_, previous_dtype_);
        at::autocast::clear_cache();
    }
    AutocastGuard(const AutocastGuard&) = delete;
    AutocastGuard& operator=(const AutocastGuard&) = delete;

  private:
    at::DeviceType device_;
    bool on_;
    c10::ScalarType previous_dtype_ = at::kFloat;
};

}  // namespace

int64_t apply_caption_dropout(const family::ModelFamily& family, TrainBatch& batch,
                              const PromptEmbedding& empty, double probability, at::Generator& generator,
                              int64_t rank, int64_t world_size) {
    const int64_t n = batch.latents.size(0);
    // [world_size * B] on the CPU; this rank's rows [rank * B, (rank + 1) * B).
    const at::Tensor draws =
        at::rand({n * world_size}, generator, at::kFloat).slice(0, rank * n, (rank + 1) * n);
    if (probability <= 0) return 0;
    const auto a = draws.accessor<float, 1>();
    int64_t dropped = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (a[i] >= probability) continue;
        family.drop_caption(batch.cond, i, empty);
        ++dropped;
    }
    return dropped;
}

void refresh_rollout_probability(const StepOptions& options, int64_t global_step, const at::Device& device) {
    if (!options.scheduled_sampling.active()) return;
    const double p =
        std::clamp(diffusion::rollout_probability(options.scheduled_sampling, global_step), 0.0, 1.0);
    at::Tensor& slot = *options.rollout_probability;
    if (!slot.defined() || slot.device() != device)
        slot = at::full({}, p, at::TensorOptions(device).dtype(at::kFloat));
    else
        slot.fill_(p);  // in place: a captured step reads this address
}

namespace {

// Noise, input noise and timesteps of one micro-batch (see StepOptions::device_rng).
struct Draws {
    diffusion::TrainingNoise noise;
    at::Tensor t;      // [B] int64, where drawn
    at::Tensor t_dev;  // [B] int64 on the latents' device
};

// One formulation for the eager and the graphed step: the noise (offset noise and input perturbation
// included, diffusion::draw_training_noise) and then the timesteps (SimpleTuner's sampling: bias and
// segments, diffusion::draw_timesteps) come from `generator` on the CPU, or with options.device_rng
// from the latents' device's default generator with no host work. Either way they are drawn for the
// global batch (every rank the same) and this rank's rows are kept, so N ranks x B equal 1 rank x N*B
// draw for draw.
Draws draw(const at::Tensor& latents, const diffusion::NoiseSchedule& schedule, const StepOptions& options,
           int64_t global_step, at::Generator& generator) {
    const int64_t b = latents.size(0), n = b * options.world_size, lo = options.rank * b, hi = lo + b;
    const at::Device device = latents.device();
    const bool on_device = options.device_rng;
    DTUNE_CHECK_AS(
        UsageError,
        !on_device || options.noise.input_perturbation == 0 || options.noise.input_perturbation_steps <= 0,
        "input_perturbation_steps decays the perturbation every step, which a CUDA graph cannot "
        "follow; set input_perturbation_steps to 0, or train without CUDA graphs");
    auto global_shape = latents.sizes().vec();
    global_shape[0] = n;
    const std::optional<at::Generator> from =
        on_device ? std::nullopt : std::optional<at::Generator>(generator);
    const diffusion::TrainingNoise all =
        diffusion::draw_training_noise(global_shape, options.noise, global_step, from, device);
    Draws d;
    d.noise.noise = diffusion::to_device_async(all.noise.slice(0, lo, hi), device);  // [B, C, h, w]
    d.noise.input_noise = all.input_noise.is_same(all.noise)
                              ? d.noise.noise
                              : diffusion::to_device_async(all.input_noise.slice(0, lo, hi), device);
    // [B] int64 where drawn: on the device with device_rng, else on the CPU (moved without a wait).
    d.t = diffusion::draw_timesteps(n, schedule.num_train_timesteps(), options.timesteps, from, device,
                                    options.timestep_cdfs.get())
              .slice(0, lo, hi);
    d.t_dev = on_device ? d.t : diffusion::to_device_async(d.t, device);
    return d;
}

}  // namespace

namespace {

// Turns the adapters off for its lifetime (back on even when the forward throws).
class AdaptersOff {
  public:
    explicit AdaptersOff(const AdapterSwitch& adapters) : adapters_(adapters) { adapters_(false); }
    ~AdaptersOff() { adapters_(true); }
    AdaptersOff(const AdaptersOff&) = delete;
    AdaptersOff& operator=(const AdaptersOff&) = delete;

  private:
    const AdapterSwitch& adapters_;
};

at::Tensor predict(family::Denoiser& model, const family::Conditioning& cond, const at::Tensor& noisy,
                   const at::Tensor& t, const StepOptions& options) {
    AutocastGuard autocast(noisy.device().type(), options.compute_dtype);
    return model.forward(noisy, t, cond);  // [B, C, h, w]
}

// Scheduled sampling with options.device_rng: the rollout of roll_out below as fixed-length device
// work, for a CUDA graph. The offsets are drawn on the device (the same formulation,
// diffusion::draw_rollout_offsets); every iteration k < max_step_offset runs the whole batch at
// timestep source - k, and a sample takes that step only while its own rollout runs (source - k > t
// and > 0; at::where), so no drawn length is read back. Each sample thus gets roll_out's update from
// the same draws, within float rounding (its model calls see the whole batch, not one sample), at
// max_step_offset batch forwards a step whoever is rolled out.
at::Tensor roll_out_on_device(family::Denoiser& model, const TrainBatch& batch,
                              const diffusion::NoiseSchedule& schedule, const StepOptions& options,
                              const at::Tensor& latents, const Draws& d, const at::Tensor& noisy, double p) {
    const auto& ss = options.scheduled_sampling;
    const int64_t b = latents.size(0), T = schedule.num_train_timesteps();
    const at::Device device = latents.device();
    const at::Tensor& slot = *options.rollout_probability;
    const at::Tensor prob =
        slot.defined() && slot.device() == device
            ? slot
            : at::full({}, std::clamp(p, 0.0, 1.0), at::TensorOptions(device).dtype(at::kFloat));
    // The mask is always drawn: a ramp may reach 1 after the capture.
    const at::Tensor offsets =
        diffusion::draw_rollout_offsets(b * options.world_size, ss, prob, true, std::nullopt, device)
            .slice(0, options.rank * b, (options.rank + 1) * b);  // [B] int64
    const at::Tensor& t = d.t_dev;                                // [B] int64
    const at::Tensor source = (t + offsets).clamp_max(T - 1);     // [B]
    // A probability of 0 for the whole run: nobody rolls out, at no cost.
    if (p <= 0 && !diffusion::rollout_probability_varies(ss)) return noisy;
    std::vector<int64_t> shape(static_cast<size_t>(latents.dim()), 1);
    shape[0] = b;  // [B, 1, ..., 1]
    c10::NoGradGuard no_grad;
    at::Tensor x = schedule.add_noise(latents, d.noise.input_noise, source);  // [B, C, h, w]
    for (int64_t k = 0; k < ss.max_step_offset; ++k) {
        const at::Tensor step = source - k;                           // [B]
        const at::Tensor active = (step > t).logical_and_(step > 0);  // [B] bool
        const at::Tensor at_step = step.clamp_min(1);                 // a valid timestep when idle
        const at::Tensor pred = predict(model, batch.cond, x, at_step, options);
        const at::Tensor next =
            diffusion::rollout_step(schedule, options.prediction, x, pred, at_step, at_step - 1);
        x = at::where(active.view(shape), next, x);
    }
    return at::where((source > t).view(shape), x, noisy);
}

// Scheduled sampling (diffusion/scheduled_sampling.h): the rolled-out noisy latents. The plan is
// drawn for the global batch, so every rank makes the same draws and keeps its own rows.
at::Tensor roll_out(family::Denoiser& model, const TrainBatch& batch,
                    const diffusion::NoiseSchedule& schedule, const StepOptions& options,
                    const at::Tensor& latents, const Draws& d, const at::Tensor& noisy, int64_t global_step,
                    at::Generator& generator) {
    const auto& ss = options.scheduled_sampling;
    const int64_t b = latents.size(0), T = schedule.num_train_timesteps();
    const double p = diffusion::rollout_probability(ss, global_step);
    if (options.device_rng) return roll_out_on_device(model, batch, schedule, options, latents, d, noisy, p);
    const diffusion::RolloutPlan plan =
        diffusion::plan_rollout(at::zeros({b * options.world_size}, at::kLong), T, ss, p, generator);
    const at::Tensor offsets = plan.offsets.slice(0, options.rank * b, (options.rank + 1) * b);
    const at::Tensor t = d.t.to(at::kCPU);
    at::Tensor out = noisy;
    c10::NoGradGuard no_grad;
    for (int64_t i = 0; i < b; ++i) {
        const int64_t target = t[i].item<int64_t>();
        const int64_t source = std::min(target + offsets[i].item<int64_t>(), T - 1);
        if (source <= target) continue;
        if (out.is_same(noisy)) out = noisy.clone();
        family::Conditioning one;
        for (const auto& [name, c] : batch.cond) one[name] = c.narrow(0, i, 1);
        const auto at_t = [&](int64_t v) {
            return at::full({1}, v, at::TensorOptions(latents.device()).dtype(at::kLong));
        };
        at::Tensor x =
            schedule.add_noise(latents.narrow(0, i, 1), d.noise.input_noise.narrow(0, i, 1), at_t(source));
        for (int64_t step = source; step > target && step > 0; --step) {
            const at::Tensor pred = predict(model, one, x, at_t(step), options);
            x = diffusion::rollout_step(schedule, options.prediction, x, pred, step, step - 1);
        }
        out[i].copy_(x[0]);
    }
    return out;
}

}  // namespace

namespace {

// The random inputs of one flow-matching micro-batch (draw_flow).
struct FlowStepDraws {
    at::Tensor noise;     // [B, C, h, w] float32
    at::Tensor sigmas;    // [B] float32 (on the CPU without device_rng: MicroStep::timesteps stays there)
    at::Tensor guidance;  // [B] float32; undefined unless `draw_guidance`
};

// Draw order: noise, sigmas, guidance (when `draw_guidance`), each for the global batch (every rank
// the same), this rank's rows kept. From `generator` on the CPU, or with options.device_rng from the
// latents' device's default generator, with the same formulas (diffusion::draw_flow_sigmas for every
// sigma schedule, sample_embedded_guidance_on) and no host work, so a CUDA graph captures the draws
// with the step.
FlowStepDraws draw_flow(const at::Tensor& latents, const diffusion::FlowMatchingOptions& flow,
                        const StepOptions& options, int64_t global_step, bool draw_guidance,
                        at::Generator& generator) {
    const int64_t b = latents.size(0), n = b * options.world_size, lo = options.rank * b, hi = lo + b;
    auto global_shape = latents.sizes().vec();
    global_shape[0] = n;
    FlowStepDraws d;
    if (options.device_rng) {
        DTUNE_CHECK(
            !options.fixed_flow_draws,
            "fixed_flow_draws (a test hook) replaces the CPU draws; it does not combine with device_rng");
        const at::Device device = latents.device();
        d.noise = at::randn(global_shape, latents.options()).slice(0, lo, hi);  // [B, C, h, w]
        d.sigmas =
            diffusion::sample_flow_sigmas_on(device, n, flow, latents.sizes()).slice(0, lo, hi);  // [B]
        if (draw_guidance)
            d.guidance = diffusion::sample_embedded_guidance_on(device, n, *flow.guidance).slice(0, lo, hi);
        return d;
    }
    d.noise = at::randn(global_shape, generator, at::kFloat).slice(0, lo, hi).to(latents.device());
    d.sigmas = diffusion::sample_flow_sigmas(n, flow, latents.sizes(), generator).slice(0, lo, hi);  // [B]
    if (options.fixed_flow_draws) {  // tests (step.h); the generator has drawn as always
        const FlowDraws fixed = options.fixed_flow_draws(global_step, latents);
        d.noise = fixed.noise.to(latents.device(), at::kFloat);  // [B, C, h, w]
        d.sigmas = fixed.sigmas.to(at::kCPU, at::kFloat);        // [B]
    }
    if (draw_guidance)
        d.guidance = diffusion::sample_embedded_guidance(n, *flow.guidance, generator)
                         .slice(0, lo, hi)
                         .to(latents.device());  // [B]
    return d;
}

// Flow matching (SD3 / Flux): sigmas from objective.flow (draw_flow), noisy = (1 - sigma) x0 +
// sigma noise, the network sees sigma · 1000 and is trained toward noise - x0 with a plain MSE, as
// SimpleTuner's flow-matching models are. A guidance-distilled network (Flux [dev]) also gets one
// embedded guidance scale per sample as cond["guidance"] (objective.flow.guidance), unless the batch
// carries its own. A regularisation batch of a LoRA run trains toward the base model's prediction,
// as for DDPM.
MicroStep flow_micro_step(family::Denoiser& model, const TrainBatch& batch,
                          const family::TrainingObjective& objective, const StepOptions& options,
                          int64_t global_step, at::Generator& generator, const StepHooks& hooks) {
    const at::Tensor latents = batch.latents.to(at::kFloat);  // [B, C, h, w]
    DTUNE_CHECK_AS(UsageError, latents.size(2) % 2 == 0 && latents.size(3) % 2 == 0, "latents of ",
                   latents.sizes(), " cannot be packed 2x2; image sizes must be multiples of 16");
    const bool draw_guidance =
        objective.flow.guidance && batch.cond.count("guidance") == 0;  // a batch's own wins
    const FlowStepDraws d =
        draw_flow(latents, objective.flow, options, global_step, draw_guidance, generator);
    const at::Tensor sigmas = d.sigmas.to(latents.device());                           // [B]
    const at::Tensor noisy = diffusion::flow_noisy_latents(latents, d.noise, sigmas);  // [B, C, h, w]
    const at::Tensor t = diffusion::flow_timesteps(sigmas);                            // [B]
    family::Conditioning cond = batch.cond;  // shares the tensors; only "guidance" is added
    if (draw_guidance) cond["guidance"] = d.guidance;
    at::Tensor target;
    if (batch.regularisation && hooks.adapters) {
        c10::NoGradGuard no_grad;
        AdaptersOff off(hooks.adapters);
        target = predict(model, cond, noisy, t, options).to(at::kFloat).detach();
    } else {
        target = d.noise - latents;  // [B, C, h, w]
    }
    const at::Tensor pred = predict(model, cond, noisy, t, options).to(at::kFloat);
    MicroStep out;
    out.loss = (pred - target).pow(2).mean(std::vector<int64_t>{1, 2, 3}).mean();
    out.timesteps = diffusion::flow_timesteps(d.sigmas);  // where drawn (step.h)
    out.target = target;
    out.noise = d.noise;
    out.sigmas = sigmas;
    out.guidance = d.guidance;
    return out;
}

}  // namespace

MicroStep micro_step(family::Denoiser& model, const TrainBatch& batch,
                     const family::TrainingObjective& objective, const StepOptions& options,
                     int64_t global_step, at::Generator& generator, const StepHooks& hooks) {
    if (hooks.before_forward) hooks.before_forward();
    if (objective.flow_matching())
        return flow_micro_step(model, batch, objective, options, global_step, generator, hooks);
    const diffusion::NoiseSchedule& schedule = objective.ddpm("the diffusion step");
    const AdapterSwitch& adapters = hooks.adapters;
    const at::Tensor latents = batch.latents.to(at::kFloat);  // [B, C, h, w]
    const Draws d = draw(latents, schedule, options, global_step, generator);
    const at::Tensor& t_dev = d.t_dev;
    at::Tensor noisy = schedule.add_noise(latents, d.noise.input_noise, t_dev);  // [B, C, h, w]
    const bool rollout_type = options.prediction == diffusion::PredictionType::kEpsilon ||
                              options.prediction == diffusion::PredictionType::kVPrediction;
    if (options.scheduled_sampling.active() && rollout_type)
        noisy = roll_out(model, batch, schedule, options, latents, d, noisy, global_step, generator);
    at::Tensor target;
    if (batch.regularisation && adapters && !options.diff2flow_loss) {
        c10::NoGradGuard no_grad;
        AdaptersOff off(adapters);
        target = predict(model, batch.cond, noisy, t_dev, options).to(at::kFloat).detach();  // [B, C, h, w]
    } else {
        target = schedule.target(options.prediction, latents, d.noise.noise, t_dev);
    }
    const at::Tensor pred = predict(model, batch.cond, noisy, t_dev, options);  // [B, C, h, w]
    MicroStep out;
    if (options.diff2flow_loss) {
        // SimpleTuner trains every batch toward the flow target here (a regularisation batch's
        // teacher prediction included: its flow_target comes from the batch's noise and latents).
        target = d.noise.noise - latents;  // [B, C, h, w]
        const at::Tensor flow =
            diffusion::diff2flow_prediction(pred, noisy, t_dev, options.prediction, schedule);
        out.loss = (flow - target).pow(2).mean(std::vector<int64_t>{1, 2, 3}).mean();
    } else {
        out.loss = diffusion::diffusion_loss(pred.to(at::kFloat), target, t_dev, options.prediction,
                                             &schedule, options.loss);
    }
    out.timesteps = d.t;
    out.target = target;
    return out;
}

at::Tensor clip_gradients(const std::vector<at::Tensor>& params, double max_grad_norm, bool by_value,
                          const NormClipFn& norm_fn, Optimizer* optimizer) {
    const double norm_clip = by_value ? 0.0 : max_grad_norm;
    const at::Tensor norm = norm_fn ? norm_fn(params, norm_clip) : clip_grad_norm_async(params, norm_clip);
    if (by_value && max_grad_norm > 0 && !(optimizer && optimizer->clamp_gradients_in_step(max_grad_norm)))
        clip_grad_value(params, max_grad_norm);
    return norm;
}

namespace {

// micro_step and the backward of loss / accum (the division the eager trainer does, so the two paths
// give the same gradients); before_backward (arming the reducer) on the last micro-step only.
at::Tensor forward_backward(family::Denoiser& model, const TrainBatch& batch,
                            const family::TrainingObjective& objective, const StepOptions& options,
                            int64_t global_step, at::Generator& generator, int64_t accum, bool last,
                            const StepHooks& hooks) {
    DTUNE_CHECK(accum >= 1, "gradient accumulation over ", accum, " micro-steps; use 1 or more");
    MicroStep m = micro_step(model, batch, objective, options, global_step, generator, hooks);
    if (last && hooks.before_backward) hooks.before_backward();
    const at::Tensor loss = accum > 1 ? m.loss / static_cast<double>(accum) : m.loss;
    (hooks.scale_loss ? hooks.scale_loss(loss) : loss).backward();
    return m.loss.detach();
}

}  // namespace

at::Tensor accumulate_gradients_async(family::Denoiser& model, const TrainBatch& batch,
                                      const family::TrainingObjective& objective, const StepOptions& options,
                                      int64_t global_step, at::Generator& generator, int64_t accum,
                                      const StepHooks& hooks) {
    return forward_backward(model, batch, objective, options, global_step, generator, accum, false, hooks);
}

StepTensors optimizer_step_async(family::Denoiser& model, const TrainBatch& batch,
                                 const family::TrainingObjective& objective, const StepOptions& options,
                                 int64_t global_step, at::Generator& generator, Optimizer& optimizer,
                                 const std::vector<at::Tensor>& params, double max_grad_norm,
                                 const StepHooks& hooks, int64_t accum) {
    const at::Tensor loss =
        forward_backward(model, batch, objective, options, global_step, generator, accum, true, hooks);
    if (hooks.after_backward) hooks.after_backward();
    StepTensors out;
    out.loss = loss;
    out.grad_norm = clip_gradients(params, max_grad_norm, options.clip_by_value, hooks.clip_norm, &optimizer);
    optimizer.step();
    optimizer.zero_grad();
    if (hooks.clear_gradients) hooks.clear_gradients();
    return out;
}

}  // namespace dtune::train
