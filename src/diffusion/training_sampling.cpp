// Random draws of a training step (see training_sampling.h).
#include "diffusion/training_sampling.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>
#include <vector>

#include "core/error.h"

namespace dtune::diffusion {

at::Tensor to_device_async(const at::Tensor& host, const at::Device& device) {
    if (host.device() == device) return host;
    if (!device.is_cuda() || !host.is_cpu()) return host.to(device);
    return host.pin_memory().to(device, /*non_blocking=*/true);
}

namespace {

at::TensorOptions on_generator(const at::Generator& generator, at::ScalarType dtype) {
    return at::TensorOptions().dtype(dtype).device(generator.device());
}

}  // namespace

double input_perturbation_scale(const NoiseOptions& options, int64_t global_step) {
    if (options.input_perturbation_steps <= 0) return options.input_perturbation;
    const double left =
        1.0 - static_cast<double>(global_step) / static_cast<double>(options.input_perturbation_steps);
    return options.input_perturbation * std::max(left, 0.0);
}

TrainingNoise draw_training_noise(at::IntArrayRef shape, const NoiseOptions& options, int64_t global_step,
                                  const std::optional<at::Generator>& generator, const at::Device& device,
                                  bool flow_matching) {
    DTUNE_CHECK(shape.size() >= 2, "latents must be [B, C, ...]; got shape ", shape);
    const at::TensorOptions f32 =
        at::TensorOptions().dtype(at::kFloat).device(generator ? generator->device() : device);
    // No generator: the device's default one (what at::randn takes nullopt for).
    const auto randn = [&](at::IntArrayRef size) { return at::randn(size, generator, f32); };
    TrainingNoise out;
    out.noise = randn(shape);  // [B, C, ...]
    if (!flow_matching && options.offset_noise) {
        // SimpleTuner's random.random() < noise_offset_probability, one draw per batch, from our
        // generator (reproducible) and kept on the device as a 0/1 factor.
        at::Tensor apply;  // [1] bool; undefined: always
        if (options.noise_offset_probability < 1.0)
            apply = at::rand({1}, generator, f32) < options.noise_offset_probability;
        std::vector<int64_t> per_channel(shape.size(), 1);
        per_channel[0] = shape[0];
        per_channel[1] = shape[1];
        at::Tensor offset = options.noise_offset * randn(per_channel);  // [B, C, 1, 1]
        if (apply.defined()) offset = offset * apply;
        out.noise = out.noise + offset;
    }
    if (options.input_perturbation != 0.0) {
        const double scale = input_perturbation_scale(options, global_step);
        out.input_noise = out.noise + scale * randn(shape);
    } else {
        out.input_noise = out.noise;
    }
    return out;
}

TrainingNoise sample_training_noise(const at::Tensor& latents, const NoiseOptions& options,
                                    int64_t global_step, at::Generator& generator, bool flow_matching) {
    TrainingNoise out = draw_training_noise(latents.sizes(), options, global_step, generator,
                                            latents.device(), flow_matching);
    const bool same = out.input_noise.is_same(out.noise);
    out.noise = to_device_async(out.noise, latents.device());
    out.input_noise = same ? out.noise : to_device_async(out.input_noise, latents.device());
    return out;
}

TimestepBiasStrategy parse_timestep_bias_strategy(const std::string& name) {
    if (name.empty() || name == "none") return TimestepBiasStrategy::kNone;
    if (name == "earlier") return TimestepBiasStrategy::kEarlier;
    if (name == "later") return TimestepBiasStrategy::kLater;
    if (name == "range") return TimestepBiasStrategy::kRange;
    throw UsageError(str("timestep_bias_strategy \"", name,
                         "\" is not supported; use \"earlier\", \"later\", \"range\" or \"none\""));
}

at::Tensor timestep_weights(const TimestepBiasOptions& options, int64_t num_timesteps) {
    at::Tensor weights = at::ones({num_timesteps}, at::kFloat);
    if (options.strategy == TimestepBiasStrategy::kNone) return weights;
    // Python's int() truncates toward zero; a portion of 0 biases nothing useful either way.
    const auto count = static_cast<int64_t>(options.portion * static_cast<double>(num_timesteps));
    int64_t lo = 0;
    int64_t hi = num_timesteps;
    switch (options.strategy) {
        case TimestepBiasStrategy::kLater:
            // Python's slice(-count, None) with count 0 is the whole range.
            lo = count == 0 ? 0 : std::max<int64_t>(num_timesteps - count, 0);
            break;
        case TimestepBiasStrategy::kEarlier: hi = std::min(count, num_timesteps); break;
        case TimestepBiasStrategy::kRange:
            DTUNE_CHECK_AS(UsageError, options.begin >= 0, "timestep_bias_begin is ", options.begin,
                           "; the range strategy needs a beginning timestep >= 0");
            DTUNE_CHECK_AS(UsageError, options.end <= num_timesteps, "timestep_bias_end is ", options.end,
                           "; the range strategy needs an end <= the number of timesteps (", num_timesteps,
                           ")");
            lo = options.begin;
            hi = std::max(options.begin, options.end);
            break;
        case TimestepBiasStrategy::kNone: break;
    }
    DTUNE_CHECK_AS(UsageError, options.multiplier > 0, "timestep_bias_multiplier is ", options.multiplier,
                   "; it must be > 0 (to train without a bias set timestep_bias_strategy to none)");
    weights.slice(0, lo, hi) *= options.multiplier;
    return weights / weights.sum();
}

namespace {

// Cumulative sums along the last dimension, divided by their last entry: exactly 1 from the last
// non-zero weight on (x / x is 1 in IEEE arithmetic), so a draw u < 1 never passes it.
at::Tensor normalised_cumsum(const at::Tensor& weights) {
    const at::Tensor c = weights.cumsum(-1);
    return c / c.narrow(-1, c.size(-1) - 1, 1);
}

}  // namespace

at::Tensor timestep_cdf(int64_t batch_size, int64_t num_timesteps, const TimestepSamplingOptions& options) {
    DTUNE_CHECK(batch_size >= 1, "timestep sampling needs a batch of at least 1; got ", batch_size);
    // float64 throughout: a multiplier of 1e7 leaves the rest 1e-10 of the mass, which float32 sums lose.
    at::Tensor weights = timestep_weights(options.bias, num_timesteps).to(at::kDouble);  // [T]
    if (batch_size == 1 || options.disable_segmented_timestep_sampling) return normalised_cumsum(weights);
    // SimpleTuner's segmented_timestep_selection: segments of T / B from the top, each normalised in
    // place in turn (so a shared boundary enters the next segment already divided by this one's sum).
    const int64_t first = num_timesteps - 1;
    const int64_t segment = std::max<int64_t>(num_timesteps / batch_size, 1);
    at::Tensor rows = at::zeros({batch_size, num_timesteps}, at::kDouble);  // [B, T]
    for (int64_t i = 0; i < batch_size; ++i) {
        const int64_t start = first - i * segment;
        const int64_t end = i != batch_size - 1 ? std::max<int64_t>(start - segment, 0) : 0;
        DTUNE_CHECK(start >= end, "batch of ", batch_size, " is larger than the ", num_timesteps,
                    " training timesteps; segmented sampling cannot give each sample its own segment. "
                    "Set disable_segmented_timestep_sampling");
        at::Tensor seg = weights.slice(0, end, start + 1);  // a view: normalised in place
        seg /= seg.sum();
        rows[i].slice(0, end, start + 1).copy_(seg);
    }
    return normalised_cumsum(rows);
}

at::Tensor timesteps_from_cdf(const at::Tensor& cdf, int64_t batch_size,
                              const std::optional<at::Generator>& generator) {
    DTUNE_CHECK(cdf.dim() == 1 || (cdf.dim() == 2 && cdf.size(0) == batch_size), "a timestep CDF of shape ",
                cdf.sizes(), " does not fit a batch of ", batch_size, " (expected [T] or [B, T])");
    const at::TensorOptions f64 = cdf.options().dtype(at::kDouble);
    const at::Tensor u = at::rand({batch_size, 1}, generator, f64);  // [B, 1]
    // The first k with cdf[k] > u is the count of entries <= u (the table is sorted), so a timestep
    // of weight 0 is never drawn. A comparison and a sum over [B, T] rather than at::searchsorted: the
    // same index, and it also runs on meta tensors, where the tests check that no host read is made.
    const at::Tensor table = cdf.dim() == 1 ? cdf.unsqueeze(0) : cdf;  // [1 or B, T]
    return table.le(u).sum(1);                                         // [B] int64
}

at::Tensor TimestepCdfCache::get(int64_t batch_size, int64_t num_timesteps,
                                 const TimestepSamplingOptions& options, const at::Device& device) {
    const TimestepBiasOptions& b = options.bias;
    std::ostringstream k;
    k << std::setprecision(17) << batch_size << ' ' << num_timesteps << ' ' << static_cast<int>(b.strategy)
      << ' ' << b.multiplier << ' ' << b.begin << ' ' << b.end << ' ' << b.portion << ' '
      << options.disable_segmented_timestep_sampling << ' ' << device.str();
    const std::string key = k.str();
    const std::lock_guard<std::mutex> lock(mutex_);
    auto it = tables_.find(key);
    if (it == tables_.end())
        it = tables_.emplace(key, timestep_cdf(batch_size, num_timesteps, options).to(device)).first;
    return it->second;
}

at::Tensor draw_timesteps(int64_t batch_size, int64_t num_timesteps, const TimestepSamplingOptions& options,
                          const std::optional<at::Generator>& generator, const at::Device& device,
                          TimestepCdfCache* cache) {
    if (generator) {
        // The table is built once per batch size and options (the cache), not every step.
        const at::Device where = generator->device();
        const at::Tensor cdf = cache ? cache->get(batch_size, num_timesteps, options, where)
                                     : timestep_cdf(batch_size, num_timesteps, options).to(where);
        return timesteps_from_cdf(cdf, batch_size, generator);
    }
    if (options.bias.strategy == TimestepBiasStrategy::kNone)
        return at::randint(0, num_timesteps, {batch_size},
                           at::TensorOptions().dtype(at::kLong).device(device));
    const at::Tensor cdf = cache ? cache->get(batch_size, num_timesteps, options, device)
                                 : timestep_cdf(batch_size, num_timesteps, options).to(device);
    return timesteps_from_cdf(cdf, batch_size, std::nullopt);
}

at::Tensor sample_timesteps(int64_t batch_size, int64_t num_train_timesteps,
                            const TimestepSamplingOptions& options, at::Generator& generator) {
    return draw_timesteps(batch_size, num_train_timesteps, options, generator, generator.device()).cpu();
}

EmbeddedGuidanceOptions::Mode parse_embedded_guidance_mode(const std::string& name) {
    if (name == "constant") return EmbeddedGuidanceOptions::Mode::kConstant;
    if (name == "random-range") return EmbeddedGuidanceOptions::Mode::kRandomRange;
    throw UsageError(
        str("flux_guidance_mode \"", name, "\" is not supported; choose one of: constant, random-range"));
}

namespace {

// Python's random.uniform(min, max) from a float64 U(0, 1) draw u [B].
at::Tensor guidance_from_uniform(const at::Tensor& u, const EmbeddedGuidanceOptions& o) {
    return (o.min + (o.max - o.min) * u).to(at::kFloat);  // [B]
}

}  // namespace

at::Tensor sample_embedded_guidance(int64_t batch_size, const EmbeddedGuidanceOptions& o,
                                    at::Generator& generator) {
    if (o.mode == EmbeddedGuidanceOptions::Mode::kConstant)
        return at::full({batch_size}, o.value, at::TensorOptions().dtype(at::kFloat));
    return guidance_from_uniform(
        at::rand({batch_size}, generator, on_generator(generator, at::kDouble)).cpu(), o);
}

at::Tensor sample_embedded_guidance_on(const at::Device& device, int64_t batch_size,
                                       const EmbeddedGuidanceOptions& o) {
    const auto on = at::TensorOptions().device(device);
    if (o.mode == EmbeddedGuidanceOptions::Mode::kConstant)
        return at::full({batch_size}, o.value, on.dtype(at::kFloat));
    return guidance_from_uniform(at::rand({batch_size}, on.dtype(at::kDouble)), o);
}

FlowSigmaSchedule flow_sigma_schedule(const FlowMatchingOptions& o) {
    if (!o.flux_fast_schedule && !o.beta && !o.uniform) return FlowSigmaSchedule::kLogitNormal;
    if (o.uniform) return FlowSigmaSchedule::kUniform;
    if (o.beta) return FlowSigmaSchedule::kBeta;
    return FlowSigmaSchedule::kFluxFast;
}

at::Tensor apply_flow_shift(const at::Tensor& sigmas, double shift) {
    return (sigmas * shift) / (1 + (shift - 1) * sigmas);
}

double flux_auto_shift(int64_t image_seq_len, const FlowMatchingOptions& o) {
    const double m =
        (o.max_shift - o.base_shift) / static_cast<double>(o.max_image_seq_len - o.base_image_seq_len);
    const double b = o.base_shift - m * static_cast<double>(o.base_image_seq_len);
    return std::exp(static_cast<double>(image_seq_len) * m + b);
}

std::optional<double> flow_shift_for(const FlowMatchingOptions& o, at::IntArrayRef latent_shape) {
    if (flow_sigma_schedule(o) == FlowSigmaSchedule::kFluxFast) return std::nullopt;
    if (o.auto_shift) {
        DTUNE_CHECK(latent_shape.size() >= 4, "flow auto shift needs the latent shape [B, C, H, W]; got ",
                    latent_shape);
        const int64_t h = latent_shape[latent_shape.size() - 2];
        const int64_t w = latent_shape[latent_shape.size() - 1];
        const int64_t frames = latent_shape.size() == 5 ? latent_shape[2] : 1;
        const int64_t p = o.patch_size > 0 ? o.patch_size : 2;
        return flux_auto_shift(frames * (h / p) * (w / p), o);
    }
    if (o.shift.has_value() && *o.shift > 0) return *o.shift;
    return std::nullopt;
}

namespace {

// Both draws share these: logit-normal sigmas from N(0, 1) draws, and the shift.
at::Tensor logit_normal_sigmas(const at::Tensor& normal, const FlowMatchingOptions& o) {
    return at::sigmoid(o.sigmoid_scale * normal);
}

at::Tensor shifted_flow_sigmas(const at::Tensor& sigmas, const FlowMatchingOptions& o,
                               at::IntArrayRef latent_shape) {
    const std::optional<double> shift = flow_shift_for(o, latent_shape);
    return shift ? apply_flow_shift(sigmas, *shift) : sigmas;
}

}  // namespace

at::Tensor draw_flow_sigmas(int64_t batch_size, const FlowMatchingOptions& options,
                            at::IntArrayRef latent_shape, const std::optional<at::Generator>& generator,
                            const at::Device& device) {
    const at::TensorOptions f32 =
        at::TensorOptions().dtype(at::kFloat).device(generator ? generator->device() : device);
    at::Tensor sigmas;  // [B]
    switch (flow_sigma_schedule(options)) {
        case FlowSigmaSchedule::kLogitNormal:
            sigmas = logit_normal_sigmas(at::randn({batch_size}, generator, f32), options);
            break;
        case FlowSigmaSchedule::kUniform: sigmas = at::rand({batch_size}, generator, f32); break;
        case FlowSigmaSchedule::kBeta: {
            DTUNE_CHECK_AS(UsageError, options.beta_alpha > 0 && options.beta_beta > 0,
                           "flow_beta_schedule_alpha and flow_beta_schedule_beta must be > 0; got ",
                           options.beta_alpha, " and ", options.beta_beta);
            // torch.distributions.Beta(a, b).sample((B,)): the first coordinate of a Dirichlet draw with
            // concentration [a, b] per sample (float32), from the same gamma draws. The concentration
            // is filled where it is drawn (at::full), not copied from the host.
            const at::Tensor concentration = at::stack({at::full({batch_size}, options.beta_alpha, f32),
                                                        at::full({batch_size}, options.beta_beta, f32)},
                                                       1);  // [B, 2]
            sigmas = at::_sample_dirichlet(concentration, generator).select(1, 0);
            break;
        }
        case FlowSigmaSchedule::kFluxFast: {
            // random.choices([1.0] * 7 + [0.75, 0.5, 0.25], k=B): index i in [0, 10) gives
            // min(10 - i, 4) / 4, i.e. 1 for i < 7, then 0.75, 0.5, 0.25 (exact in float32).
            const at::Tensor index = at::randint(0, 10, {batch_size}, generator, f32.dtype(at::kLong));
            return (10 - index).clamp_max(4).to(at::kFloat) * 0.25;  // never shifted
        }
    }
    return shifted_flow_sigmas(sigmas, options, latent_shape);
}

at::Tensor sample_flow_sigmas(int64_t batch_size, const FlowMatchingOptions& options,
                              at::IntArrayRef latent_shape, at::Generator& generator) {
    return draw_flow_sigmas(batch_size, options, latent_shape, generator, generator.device()).cpu();
}

at::Tensor sample_flow_sigmas_on(const at::Device& device, int64_t batch_size,
                                 const FlowMatchingOptions& options, at::IntArrayRef latent_shape) {
    return draw_flow_sigmas(batch_size, options, latent_shape, std::nullopt, device);
}

at::Tensor flow_noisy_latents(const at::Tensor& x0, const at::Tensor& noise, const at::Tensor& sigmas) {
    std::vector<int64_t> shape(static_cast<size_t>(x0.dim()), 1);
    shape[0] = x0.size(0);
    const at::Tensor s = sigmas.to(x0.device(), x0.scalar_type()).view(shape);  // [B, 1, 1, 1]
    return (1 - s) * x0 + s * noise;
}

}  // namespace dtune::diffusion
