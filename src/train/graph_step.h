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

    // One optimizer step, as optimizer_step_async.
    StepTensors run(family::Denoiser& model, const TrainBatch& batch,
                    const family::TrainingObjective& objective, const StepOptions& options,
                    int64_t global_step, at::Generator& generator, Optimizer& optimizer,
                    const std::vector<at::Tensor>& params, double max_grad_norm, const StepHooks& hooks = {});

    // The optimizer reads its learning rate from a device tensor refreshed before each call, so an
    // LR change needs no recapture.
    void set_lr_on_device(bool on) { lr_on_device_ = on; }

    // Steps replayed from a graph / run eagerly so far.
    int64_t replays() const { return replays_; }
    int64_t eager_steps() const { return eager_; }

  private:
    struct Entry;
    int warmup_;
    bool lr_on_device_ = false;
    int64_t replays_ = 0, eager_ = 0;
    std::pair<unsigned long long, unsigned long long> pool_{0, 0};    // shared graph pool ({0, 0}: none yet)
    std::map<std::vector<int64_t>, std::unique_ptr<Entry>> entries_;  // key: the batch's shapes
};

}  // namespace dtune::train
