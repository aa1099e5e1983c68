// The trainer's CUDA-graph step (see trainer_graph.h): conditions, set-up, and one optimizer step
// through GraphedStep; its loss and gradient norm are read back a step later like the eager step's
// (train/readback.h), with no wait for the GPU.
//
// With gradient accumulation each micro-batch is one GraphedStep call (a micro graph, then the final
// graph for the last), and each micro-batch's loss is logged as on the eager path.
//
// What stays outside the graph: the batch (data loader, caption dropout from the CPU generator),
// the LR (every optimizer reads it from device tensors refreshed before each replay, so
// schedules do not recapture), adamw_bf16's rare weight-decay kernels, the EMA update, fp16's
// loss-scale update (one device op after the replay; the scaling, unscaling and overflow skip are
// captured), metrics and checkpoints. Noise, timesteps (flow matching: sigmas and the embedded
// guidance) and the LoRA dropout seed come from the CUDA default generator (StepOptions::device_rng), whose
// state every checkpoint already saves (capture_rng_states), so a resumed run continues the same random
// streams at the exact step; it is not bit-identical to an uninterrupted run because the GPU kernels are not
// deterministic.
#include "train/trainer_graph.h"

#include <ATen/Context.h>

#include <cstdlib>
#include <mutex>

#include "core/error.h"
#include "core/log.h"
#include "family/model_family.h"
#include "train/adapters.h"
#include "train/data_parallel.h"
#include "train/graph_step.h"
#include "train/loss_scaler.h"
#include "train/trainer.h"

namespace dtune::train {

std::string cuda_graph_blocker(
    const TrainConfig& c, c10::Device device, int world_size, int zero_stage,
    const family::TrainingObjective* /*objective: no condition of its own today*/) {
    const std::string fix = "; otherwise the run trains without CUDA graphs";
    if (!device.is_cuda()) return str("device is ", device.str(), " (CUDA graphs need a CUDA device)");
    // zero_stage 1 graphs like 0 (the same all-reduce; the optimizer updates this rank's share and
    // the parameter broadcasts open the next step's captured forward, or follow the replay with
    // DTUNE_ZERO_SYNC=step). zero_stage 2 likewise, its other ranks' buckets
    // in the reducer's staging slots (static addresses; dist::GradReducer), with one micro-step a
    // step (accumulation sums whole gradients across micro-step graphs, which would have to stay
    // allocated), no fp16 (whether any rank's shard overflowed is agreed on the host) and the
    // bucketed reduction (DTUNE_GRAPH_REDUCER=0's flat all-reduce is not sharded). 3 gathers and
    // frees every block's parameters during the step.
    if (world_size > 1 && zero_stage > 2)
        return str("zero_stage is ", zero_stage, " with ", world_size,
                   " ranks (its parameters are gathered and freed block by block during the step, which a "
                   "graph cannot hold; zero_stage 0, 1 and 2 graph the data-parallel step",
                   fix, ")");
    if (world_size > 1 && zero_stage == 2) {
        const std::string why = str("zero_stage is 2 with ", world_size, " ranks and ");
        const int64_t accumulation = c.integer("gradient_accumulation_steps");
        if (accumulation > 1)
            return str(why, "gradient_accumulation_steps ", accumulation,
                       " (its micro-steps hold whole gradients across graphs; zero_stage 1 graphs with "
                       "accumulation",
                       fix, ")");
        if (c.text("mixed_precision") == "fp16")
            return str(why,
                       "mixed_precision fp16 (whether any rank's gradient shard overflowed is agreed on "
                       "the host; use bf16, or zero_stage 1",
                       fix, ")");
        if (graph_reducer_disabled())
            return str(why, "DTUNE_GRAPH_REDUCER=0 (its flat all-reduce is not sharded", fix, ")");
    }
    if (resolve_offload_optimizer(c))
        return "offload_optimizer_device is cpu (the optimizer step runs on the host between two waits for "
               "the GPU; set it to none" +
               fix + ")";
    // Every optimizer's step is captured with its LR (and Adafactor's step terms) read from the
    // device (optimizer.h); one added later must be listed here once it is capturable. Under fp16
    // each of them skips an overflowed step on the device, step counts included
    // (Optimizer::skip_step_on_overflow), so fp16 graphs with any of them.
    const std::string opt = c.text("optimizer");
    const bool lion_sgd_adafactor = opt == "optimi-lion" || opt == "torch-sgd" || opt == "torch-adafactor";
    if (!lion_sgd_adafactor && opt != "torch-adamw" && opt != "optimi-adamw" && opt != "adamw_bf16")
        return str("optimizer is ", opt, " (its step is not capturable; set optimizer torch-adamw", fix, ")");
    // deterministic's per-tensor AdamW keeps its step counts and lr on the device (AdamW::step_loop).
    // offset_noise, input_perturbation, loss_type huber / smooth_l1, snr_gamma, timestep_bias_strategy
    // and diff2flow_loss are graphed: their draws come from the device generator (a timestep bias by
    // inverse CDF over a table kept on the device, diffusion::draw_timesteps), and huber_c, the
    // min-SNR weights and Diff2Flow's conversion are computed from the device timesteps (train/step.cpp,
    // diffusion/loss.cpp), with no host read. So is every flow-matching sigma schedule (logit-normal,
    // uniform, Beta, flux_fast_schedule: diffusion::draw_flow_sigmas).
    // Scheduled sampling rolls out on the device for max_step_offset steps, each sample masked to
    // its own drawn length, its probability (ramped or not) read from the device (train/step.cpp).
    return {};
}

// Why the step trains eagerly ("" when it is graphed): cuda_graph false, else the blocker. Flow
// matching's graphed step (device draws of noise, sigmas and guidance) is graphed under auto like
// DDPM's since CudaGraphFluxGpu (tests/train/test_trainer_graph_gpu.cpp) passed on an H200, Beta
// sigmas (gamma draws by at::_sample_dirichlet inside the capture) included since its FluxBeta cases
// passed on an H200 (2026-11-28), and fp16 with adamw_bf16 since CudaGraphFp16Gpu/AdamWBF16Full did
// (2026-11-28).
std::string cuda_graph_fallback(const TrainConfig& c, const family::TrainingObjective& objective,
                                c10::Device device, int world_size, int zero_stage) {
    if (c.text("cuda_graph") == "false") return "cuda_graph is false";
    return cuda_graph_blocker(c, device, world_size, zero_stage, &objective);
}

void Trainer::init_graph() {
    const std::string mode = config_.text("cuda_graph");  // auto | true | false
    graph_status_ = {};
    graph_status_.requested = mode;
    if (mode == "false") return;
    const std::string blocker =
        cuda_graph_fallback(config_, objective_, device_, world_size(), dp_->zero_stage());
    if (!blocker.empty()) {
        graph_status_.fallback = blocker;
        // Asked for explicitly: a warning (and a metrics.jsonl / report.html entry). Left at auto
        // on a GPU: an info line, since the user asked for nothing. auto on the CPU: silent.
        if (mode == "true")
            log::warn() << "cuda_graph: training eagerly because " << blocker;
        else if (device_.is_cuda())
            log::info() << "cuda_graph auto: training eagerly because " << blocker;
        else
            graph_status_.fallback.clear();
        return;
    }
    optimizer_->use_device_lr();  // every optimizer cuda_graph_blocker lets through has one
    // DTUNE_CUDA_GRAPH_WARMUP: eager steps per batch shape before its capture (default 2); a value
    // above max_train_steps keeps every step eager with the graph's settings (device RNG and LR),
    // the reference a graph run is checked against.
    const char* env = std::getenv("DTUNE_CUDA_GRAPH_WARMUP");
    const int warmup = env && *env ? std::max(1, std::atoi(env)) : 2;
    graph_ = std::make_unique<GraphedStep>(warmup);
    dp_->set_step_graphed(true);
    graph_->set_lr_on_device(true);
    step_options_.device_rng = true;
    // Noise and timesteps come from the device's generator: seed it from the run seed, unless a
    // resume just restored its state from the checkpoint.
    if (!resumed_from_) {
        at::Generator gen = at::globalContext().defaultGenerator(device_);  // a handle: shares the state
        const std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_current_seed(static_cast<uint64_t>(config_.integer("seed")));
    }
    log::info() << "cuda_graph: each batch shape trains as one CUDA graph after " << warmup
                << " eager warm-up steps; "
                << "every step's loss and grad_norm are read back a step later, without a wait";
}

StepHooks Trainer::step_hooks() {
    StepHooks hooks;
    if (!lora_) return hooks;
    hooks.adapters = [this](bool on) { lora_->adapters().set_enabled(on); };
    // The factors' copies in the compute dtype, refreshed as each forward starts: only where the
    // factors are whole and current then (not ZeRO-3's slices, nor ZeRO-1/2's broadcasts that
    // the forward itself waits for).
    const at::ScalarType ct = step_options_.compute_dtype;
    const bool cast =
        lora_cast_factors_ && ct != at::kFloat && !dp_->defers_parameter_sync() && !dp_->sharded_parameters();
    lora_->cast_factors_to(cast ? std::optional<at::ScalarType>(ct) : std::nullopt);
    hooks.before_forward = [this] {
        lora_->begin_forward(*generator_, step_options_.device_rng, dp_->rank(), dp_->world_size());
    };
    return hooks;
}

void Trainer::add_graph_fields(nlohmann::json& row) {
    if (!device_.is_cuda() || graph_status_.requested == "false") return;
    const int64_t trained = global_step_ - start_step_;  // this run's steps
    row["graph_replays"] = graph_ ? graph_->replays() : 0;
    row["eager_steps"] = graph_ ? graph_->eager_steps() : trained;
    if (!graph_status_.fallback.empty() && !graph_fallback_written_) {
        row["cuda_graph_fallback"] = graph_status_.fallback;
        graph_fallback_written_ = true;
    }
}

// One optimizer step of `gradient_accumulation_steps` micro-batches, each through GraphedStep (with
// accumulation: a micro graph per batch shape for all but the last, the final graph for the last;
// graph_step.h). The batches, caption dropout and what is logged per micro-batch are the eager
// loop's (Trainer::train_one_step).
StepScalars Trainer::train_graphed_step(double lr) {
    const int64_t accum = config_.integer("gradient_accumulation_steps");
    optimizer_->set_lr(lr);
    optimizer_->upload_lr();  // before the final replay, on the same stream
    refresh_rollout_probability(step_options_, global_step_, device_);  // scheduled sampling's, likewise
    std::vector<at::Tensor> params;
    for (const auto& p : trainable_) params.push_back(p.tensor);
    // Data parallel: the gradient average is part of the final graph (NCCL collectives are
    // captured), overlapping the last backward through the reducer's buckets
    // (DataParallel::graph_reduces_in_buckets), which also hold the gradients across the micro-steps.
    StepHooks hooks = step_hooks();
    if (dp_->defers_parameter_sync())  // ZeRO-1/2: the owners' broadcasts open the captured forward
        hooks.before_forward = [this, first = std::move(hooks.before_forward)] {
            dp_->before_forward();
            if (first) first();
        };
    const bool buckets = dp_->graph_reduces_in_buckets();
    if (buckets) {
        hooks.before_backward = [this] { dp_->arm_reduction(); };
        hooks.after_backward = [this] { dp_->reduce_gradients(); };
        hooks.clear_gradients = [this] { dp_->zero_gradients_in_step(); };
        hooks.abandon_reduction = [this] { dp_->abandon_reduction(); };
    } else if (world_size() > 1) {
        hooks.after_backward = [this, &params] { dp_->all_reduce_gradients_capturable(params); };
    }
    // The norm clip over the reducer's result: ZeRO-2's over every rank's shard (one all-reduce).
    hooks.clip_norm = [this](const std::vector<at::Tensor>& p, double max_norm) {
        return dp_->clip_grad_norm_async(p, max_norm);
    };
    graph_->set_caller_gradients(buckets);
    if (scaler_) {
        // fp16: backward on loss · scale, the gradients unscaled (found_inf set) after the reduction
        // and before the clip, the optimizer skipping on found_inf; all captured. update() follows in
        // the loop, outside the graph, as on the eager path.
        DTUNE_CHECK(scaler_skips_on_device_, "internal: optimizer ", optimizer_->name(),
                    " cannot skip an fp16 overflow on the device; cuda_graph_blocker should refuse it");
        hooks.scale_loss = [this](const at::Tensor& loss) { return scaler_->scale_loss(loss); };
        hooks.after_backward = [this, &params, reduce = std::move(hooks.after_backward)] {
            if (reduce) reduce();
            scaler_->unscale(params);
        };
    }
    StepScalars scalars;
    StepTensors out;
    for (int64_t micro = 0; micro < accum; ++micro) {
        TrainBatch batch = next_batch(micro);
        apply_caption_dropout(*family_, batch, empty_prompt_, step_options_.caption_dropout_probability,
                              *generator_, dp_->rank(), dp_->world_size());
        out = graph_->run(*model_, batch, objective_, step_options_, global_step_, *generator_, *optimizer_,
                          params, config_.real("max_grad_norm"), hooks, micro, accum);
        dp_->note_graph_launch();  // (or an eager warm-up step: then one needless wait at most)
        // A micro-step's loss is already a copy (graph_step.h); the final graph's outputs live at
        // static addresses that the next replay overwrites: queue_step copies them on this stream
        // before any later replay, and the host reads them a step later.
        scalars.add_micro_batch(out.loss, batch.regularisation, batch.paths);
        // A LoRA regularisation batch is its own graph (graph_step.h); a full fine-tune trains them
        // as ordinary data, and only the log tells them apart.
        step_ended_on_regularisation_ = batch.regularisation;
    }
    optimizer_->after_step();  // adamw_bf16: the weight decays that came due (host-decided)
    scalars.grad_norm = out.grad_norm.defined() ? out.grad_norm.detach() : at::Tensor();
    return scalars;
}

}  // namespace dtune::train
