// One micro-batch of the training step (SIMPLETUNER.md §1.3): caption dropout, noise and timesteps
// (or flow-matching sigmas), noisy latents, the model family's prediction (family::Denoiser), the
// target for the prediction type and the (min-SNR) loss.
// optimizer_step_async is one whole step (backward, clipping, optimizer) without host
// synchronisation, for the benchmark and CUDA graphs (graph_step.h); with gradient accumulation,
// accumulate_gradients_async is each micro-step before the last, and optimizer_step_async the last.
//
// Invariant: every random number comes from the generator passed in (drawn on the CPU), so a CPU run
// in deterministic mode is a function of the seed and the checkpointed generator state; except with
// StepOptions::device_rng, where the device's default generator draws them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>

#include "diffusion/loss.h"
#include "diffusion/noise_schedule.h"
#include "diffusion/scheduled_sampling.h"
#include "diffusion/training_sampling.h"
#include "family/model_family.h"
#include "train/batch_source.h"
#include "train/optimizer.h"

namespace dtune::family {
class Denoiser;
class ModelFamily;
}  // namespace dtune::family

namespace dtune::train {

// The random inputs of one flow-matching micro-batch.
struct FlowDraws {
    at::Tensor noise;   // [B, C, h, w] float32
    at::Tensor sigmas;  // [B] float32 in [0, 1]
};
// Tests only (StepOptions::fixed_flow_draws): the draws for the micro-batch of `global_step` with
// latents [B, C, h, w], so a reference loop outside dtune can train on the same inputs.
using FlowDrawFn = std::function<FlowDraws(int64_t global_step, const at::Tensor& latents)>;

struct StepOptions {
    diffusion::NoiseOptions noise;
    diffusion::TimestepSamplingOptions timesteps;
    diffusion::LossOptions loss;
    diffusion::PredictionType prediction = diffusion::PredictionType::kEpsilon;
    double caption_dropout_probability = 0.0;
    // Autocast dtype for the model's forward (kFloat: none).
    c10::ScalarType compute_dtype = at::kFloat;
    // Data parallelism: this rank holds rows [rank*B, (rank+1)*B) of a global micro-batch of
    // world_size*B rows. Every draw is made for the global batch (same generator state on every
    // rank) and this rank's rows are kept, so N ranks x B equal 1 rank x N*B draw for draw.
    int64_t rank = 0;
    int64_t world_size = 1;
    // Draw noise and timesteps on the latents' device with its default generator instead of the CPU
    // generator passed in: no host work or copies, so a CUDA graph can capture the step. The noise is
    // the CPU path's formulation (diffusion::draw_training_noise: offset noise and a constant input
    // perturbation included), and so are biased timesteps (diffusion::draw_timesteps: the inverse CDF,
    // its table from timestep_cdfs); without a bias the timesteps are one randint over [0, T), not
    // segmented. The loss's min-SNR weights and huber_c are computed from the device timesteps either
    // way. Flow matching: noise, sigmas (every
    // schedule, diffusion::draw_flow_sigmas) and the embedded guidance, in that order, with the CPU
    // path's distributions. On a CPU device the CPU's default generator draws (tests).
    bool device_rng = false;
    // device_rng with a timestep bias: the inverse-CDF tables on the device, filled by the first
    // (eager) step of each batch size, so that a CUDA graph capture finds them there. Copies of these
    // options share it.
    std::shared_ptr<diffusion::TimestepCdfCache> timestep_cdfs =
        std::make_shared<diffusion::TimestepCdfCache>();
    // grad_clip_method value: max_grad_norm clamps each gradient element instead of scaling by
    // the global norm (the norm is still measured and reported).
    bool clip_by_value = false;
    // diff2flow_enabled + diff2flow_loss (SimpleTuner's Diff2Flow): the prediction is converted to a
    // flow-matching vector field (diffusion::diff2flow_prediction) and trained with a plain MSE
    // toward noise - latents; loss_type, min-SNR and snr_weight do not apply, as in SimpleTuner.
    bool diff2flow_loss = false;
    // scheduled_sampling_*: rolled-out inputs for some samples (diffusion/scheduled_sampling.h);
    // epsilon and v-prediction only. With device_rng a fixed-length rollout masked per sample
    // (step.cpp, roll_out_on_device).
    diffusion::ScheduledSamplingOptions scheduled_sampling;
    // device_rng with scheduled sampling: the step's rollout probability, a [] float32 on the device
    // that refresh_rollout_probability refills in place before each step, outside any capture, so a
    // captured step follows a ramp. Empty (tests calling the step directly): the probability of the
    // step's global_step, which a capture would freeze. Copies of these options share it.
    std::shared_ptr<at::Tensor> rollout_probability = std::make_shared<at::Tensor>();
    // Tests only (the Flux training parity test): replaces the flow-matching noise and sigmas after
    // they are drawn, so the generator's stream is the same with or without it. Unset in every run;
    // not with device_rng.
    FlowDrawFn fixed_flow_draws;
};

// CUDA graphs with scheduled sampling: sets *options.rollout_probability to the rollout probability
// of `global_step` (clamped to [0, 1]) on `device`, made on the first call and refilled in place
// after it (one small kernel, no wait). Call before every step, outside any capture; a no-op when
// scheduled sampling is off.
void refresh_rollout_probability(const StepOptions& options, int64_t global_step, const at::Device& device);

// SimpleTuner's caption dropout: each sample with probability p trains on the empty caption's
// conditioning as `family` defines it (SDXL: the empty embedding with zeroed pooled embedding and
// time ids). Returns how many were dropped. One uniform draw per sample from `generator`, always
// (so the stream does not depend on p). With world_size > 1 the draws are made for the global
// batch and rows of `rank` are used.
int64_t apply_caption_dropout(const family::ModelFamily& family, TrainBatch& batch,
                              const PromptEmbedding& empty, double probability, at::Generator& generator,
                              int64_t rank = 0, int64_t world_size = 1);

struct MicroStep {
    at::Tensor loss;       // scalar float32 with the graph attached
    at::Tensor timesteps;  // [B] int64 (CPU; on the latents' device with device_rng); flow matching:
                           // sigma · 1000 [B] float32 (likewise). Tests read it; the trainer does not.
    at::Tensor target;     // [B, C, h, w] float32, what the prediction was compared with (no graph)
    // Flow matching only, on the latents' device: the draws the step trained on (noise [B, C, h, w],
    // sigmas [B] float32) and the embedded guidance [B] it drew (undefined when the batch carried
    // its own or the network takes none).
    at::Tensor noise, sigmas, guidance;
};

// Switches a LoRA run's adapters off (false) and back on (true); empty for a full fine-tune.
using AdapterSwitch = std::function<void(bool enabled)>;

// What the trainer plugs into a step; every member is optional. The eager step and the CUDA-graph
// step call the same hooks at the same points, so a graph captures them with the rest.
struct StepHooks {
    AdapterSwitch adapters;                 // regularisation batches: the teacher forward, adapters off
    std::function<void()> before_forward;   // LoRA dropout: this forward's seed (LoRATraining::begin_forward)
    std::function<void()> before_backward;  // data parallel: arm the reducer (buckets launch during backward)
    std::function<void()> after_backward;   // data parallel: the gradient average (fp16: then the unscale)
    // fp16 loss scaling: what backward runs on, from the (accumulation-divided) loss; unset: itself.
    std::function<at::Tensor(const at::Tensor& loss)> scale_loss;
    // After every optimizer.zero_grad() of the step (and of GraphedStep before a capture without
    // accumulation): the graphed data-parallel step zeroes the reducer's gradient buckets in place
    // and makes the grads views of them again, so the next backward accumulates into them.
    std::function<void()> clear_gradients;
    // After a CUDA graph capture of an accumulation micro-step failed (GraphedStep): forget the
    // collectives the capture recorded and the reducer's round state, but keep the gradients summed
    // so far (the step goes on eagerly from there).
    std::function<void()> abandon_reduction;
    // Clipping by norm (and measuring it) after the reduction; unset: clip_grad_norm_async over
    // `params`. Data parallel: DataParallel::clip_grad_norm_async (ZeRO-2: over every rank's shard).
    std::function<at::Tensor(const std::vector<at::Tensor>& params, double max_norm)> clip_norm;
};

// Forward of one micro-batch: loss = per-sample loss averaged over the batch. A regularisation
// batch (TrainBatch::regularisation) with `adapters` set trains toward the base model's prediction
// (SimpleTuner's parent-teacher target): the same noisy latents, timesteps and conditioning through
// the model with the adapters off and no graph, in place of the noise/v target; the loss (min-SNR
// weighting included) is then computed as for any batch. Without `adapters` (a full fine-tune) a
// regularisation batch trains like any other, as in SimpleTuner.
// hooks.before_forward runs first, before any draw.
// A flow-matching objective draws sigmas (options.flow's schedule) instead of timesteps and trains
// toward noise - latents with a plain MSE (SimpleTuner's flow-matching loss).
MicroStep micro_step(family::Denoiser& model, const TrainBatch& batch,
                     const family::TrainingObjective& objective, const StepOptions& options,
                     int64_t global_step, at::Generator& generator, const StepHooks& hooks = {});

// What one optimizer step leaves on the device. Nothing is read back: call .item() only when
// logging, since each read waits for the GPU to drain its queue.
struct StepTensors {
    at::Tensor loss;       // scalar float32, detached
    at::Tensor grad_norm;  // scalar float32 before clipping (undefined when no gradient)
};

// The gradient norm of `params` (float32 scalar on their device, undefined without gradients), then
// the clip: by that norm, or with `by_value` each element clamped to ±max_grad_norm; max_grad_norm
// <= 0 measures only. No host synchronisation. `norm_fn` replaces the plain norm-and-clip (ZeRO-2:
// the norm over every rank's shard); it receives the max norm to clip to (0 with by_value).
// `optimizer`: the one that steps next; where it clamps in its own update
// (Optimizer::clamp_gradients_in_step, adamw_bf16), the value clamp is left to it.
using NormClipFn = std::function<at::Tensor(const std::vector<at::Tensor>& params, double max_norm)>;
at::Tensor clip_gradients(const std::vector<at::Tensor>& params, double max_grad_norm, bool by_value,
                          const NormClipFn& norm_fn = {}, Optimizer* optimizer = nullptr);

// One whole optimizer step on one micro-batch with no host synchronisation: micro_step,
// hooks.before_backward, backward, hooks.after_backward, clip_gradients (options.clip_by_value), the
// optimizer's update and zero_grad, hooks.clear_gradients. `params` are the optimizer's parameters
// (what is clipped). With `accum` > 1 it is the last micro-step of a gradient-accumulation step:
// the backward runs on loss / accum, adding to what accumulate_gradients_async left in the grads.
StepTensors optimizer_step_async(family::Denoiser& model, const TrainBatch& batch,
                                 const family::TrainingObjective& objective, const StepOptions& options,
                                 int64_t global_step, at::Generator& generator, Optimizer& optimizer,
                                 const std::vector<at::Tensor>& params, double max_grad_norm,
                                 const StepHooks& hooks = {}, int64_t accum = 1);

// A micro-step before the last of a gradient-accumulation step of `accum` micro-batches, with no
// host synchronisation: micro_step, then the backward of loss / accum (as the eager trainer divides
// it), the gradients adding up in the parameters' .grad. Nothing else: no before_backward (the
// data-parallel reducer is armed on the last micro-step only), no reduction, clipping or update;
// those come with the last micro-step, optimizer_step_async with the same `accum`. Returns the
// micro-batch's loss, unscaled and detached. Under a CUDA graph the grads must already be defined
// and stay at their addresses until the last micro-step (GraphedStep's persistent gradients or the
// reducer's buckets), so that backward accumulates into them in place.
at::Tensor accumulate_gradients_async(family::Denoiser& model, const TrainBatch& batch,
                                      const family::TrainingObjective& objective, const StepOptions& options,
                                      int64_t global_step, at::Generator& generator, int64_t accum,
                                      const StepHooks& hooks = {});

}  // namespace dtune::train
