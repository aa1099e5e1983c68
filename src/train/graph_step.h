// The whole optimizer step (forward, backward, clipping, AdamW) captured in one CUDA graph per batch
// shape and replayed: one launch instead of ~14,000, so the step runs at the GPU's pace rather than
// the host's (on the lent H200 a launch costs ~25 µs of host time, which left the GPU idle 75% of a
// LoRA batch-1 step).
//
// Invariants and fallbacks:
// - Entries are keyed by the batch's shapes and whether it is a regularisation batch (whose LoRA
//   step adds the teacher forward with the adapters off, StepHooks::adapters): one graph each.
// - A shape is first run eagerly `warmup` times (lazy allocations, cuBLAS/cuDNN plans, optimizer
//   state), then captured; from then on each call copies the batch into the graph's static inputs
//   and replays. A shape whose capture fails runs eagerly for good (logged once), so training goes on.
// - Needs StepOptions::device_rng (noise and timesteps drawn by the device's generator, which the
//   graph advances on every replay) and a CUDA model; without CUDA (or built without it) every call
//   is eager.
// - The learning rate and max_grad_norm are baked into the capture: when either differs from the
//   captured value, that shape's graph is dropped and recaptured after `warmup` eager steps. With
//   set_lr_on_device(true) (Optimizer::use_device_lr: AdamW and AdamWBF16 read their lr from device
//   memory) LR changes keep the graph. The optimizer's own generators (adamw_bf16's rounding noise)
//   are registered with each capture, so every replay draws fresh noise.
// - The returned StepTensors are the graph's own output buffers: the next call overwrites them.
// - Every shape's graph draws from one shared memory pool (the first capture's): graphs replay one
//   at a time on one stream and keep nothing alive between replays but their inputs and outputs, so
//   a dataset with several aspect buckets pays the largest step's memory once, not once per
//   bucket. Each capture is logged with its shape and how long it took.
// - Gradient accumulation (run's `micro` of `accum` > 1): two graphs per batch shape, keyed by the
//   shape and the phase. The micro graph (accumulate_gradients_async: forward and the backward of
//   loss / accum, nothing else) serves micro-steps 0..accum-2; the final graph (optimizer_step_async:
//   the same, then the reduction, clipping, the update and the gradient clear) the last one. The
//   gradients must stay at static addresses across those graphs: with set_caller_gradients(true)
//   they are the caller's (the data-parallel reducer's buckets, zeroed in place by
//   hooks.clear_gradients); otherwise GraphedStep keeps its own persistent gradients (one flat
//   buffer per dtype and device, every trainable parameter's grad a view of it, zeroed in place at
//   the end of each step: one gradient-sized buffer that lives for the run), made the grads again at
//   every call. Nothing is zeroed before a capture then: a capture records kernels without running
//   them, so the sums of the step's earlier micro-steps stay intact, and the graph is replayed right
//   after. A failed capture keeps them too (hooks.abandon_reduction forgets the recorded
//   collectives). A micro graph's loss is returned as a copy, since the next micro replay of the
//   same shape overwrites its output before the step's losses are read. With persistent gradients
//   every trainable parameter has a gradient: one that no micro-batch reached is stepped with zeros
//   (AdamW's weight decay applies), where the eager loop would skip it.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "train/step.h"

namespace dtune::train {

class GraphedStep {
  public:
    explicit GraphedStep(int warmup = 2);
    ~GraphedStep();
    GraphedStep(const GraphedStep&) = delete;
    GraphedStep& operator=(const GraphedStep&) = delete;

    // One optimizer step, as optimizer_step_async; with `accum` > 1, micro-step `micro` (0-based) of a
    // gradient-accumulation step: accumulate_gradients_async for micro < accum - 1 (the returned
    // grad_norm is undefined), optimizer_step_async(..., accum) for the last.
    StepTensors run(family::Denoiser& model, const TrainBatch& batch,
                    const family::TrainingObjective& objective, const StepOptions& options,
                    int64_t global_step, at::Generator& generator, Optimizer& optimizer,
                    const std::vector<at::Tensor>& params, double max_grad_norm, const StepHooks& hooks = {},
                    int64_t micro = 0, int64_t accum = 1);

    // Accumulation: the caller's gradients already live at static addresses and hooks.clear_gradients
    // zeroes them in place (the data-parallel reducer's buckets); false (the default): GraphedStep
    // keeps persistent gradients of its own while accumulating.
    void set_caller_gradients(bool on) { caller_gradients_ = on; }

    // The optimizer reads its learning rate from a device tensor refreshed before each call, so an
    // LR change needs no recapture.
    void set_lr_on_device(bool on) { lr_on_device_ = on; }

    // Optimizer steps whose last (or only) micro-step was replayed from a graph / run eagerly so far.
    int64_t replays() const { return replays_; }
    int64_t eager_steps() const { return eager_; }
    // Accumulation: micro-steps before the last replayed from a graph so far.
    int64_t micro_replays() const { return micro_replays_; }

  private:
    struct Entry;
    class Gradients;
    int warmup_;
    bool lr_on_device_ = false;
    bool caller_gradients_ = false;
    int64_t replays_ = 0, eager_ = 0, micro_replays_ = 0;
    std::pair<unsigned long long, unsigned long long> pool_{0, 0};  // shared graph pool ({0, 0}: none yet)
    // key: the batch's shapes, whether it is a regularisation batch, and the phase (micro or last)
    std::map<std::vector<int64_t>, std::unique_ptr<Entry>> entries_;
    std::unique_ptr<Gradients> grads_;  // accumulation without caller gradients; made on first use
};

}  // namespace dtune::train
