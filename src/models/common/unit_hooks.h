// Hook points around a model's units: the blocks that gradient checkpointing recomputes (ResNet
// blocks, transformer blocks; Flux's double and single blocks). Engines that must act right before
// and after a unit runs (ZeRO-3 gathers a unit's sharded parameters before it and releases them
// after) register here, per unit module; the model code calls run_unit() where a unit runs, plain
// or checkpointed, and knows nothing about who listens.
//
// Invariants: with no hooks registered run_unit() is the plain call plus one relaxed atomic load;
// hooks are looked up by the unit's module object, so two models (two in-process ranks in a test)
// never see each other's hooks; the recomputation of a checkpointed unit runs inside
// RecomputeScope (set by checkpointed()'s backward, on the thread that runs it), so hooks can tell
// it from the forward.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace dtune::models {

// Marker base of the modules that are units (hookable blocks); find_units() collects them.
class HookableUnit {
  public:
    virtual ~HookableUnit() = default;
};

class UnitHooks {
  public:
    virtual ~UnitHooks() = default;
    // Before `unit` runs. recompute: the run is gradient checkpointing's recomputation in backward.
    virtual void before_unit(const torch::nn::Module& unit, bool recompute) = 0;
    // After it ran, with its outputs (a hook may register gradient hooks on them).
    virtual void after_unit(const torch::nn::Module& unit, bool recompute,
                            const std::vector<at::Tensor>& outputs) = 0;
};

// Registers `hooks` for `unit` (nullptr removes). The caller keeps both alive while registered.
void set_unit_hooks(const torch::nn::Module& unit, UnitHooks* hooks);
UnitHooks* unit_hooks_of(const torch::nn::Module& unit);

// Whether this thread is recomputing a checkpointed unit in backward.
bool in_recompute();
class RecomputeScope {
  public:
    RecomputeScope();
    ~RecomputeScope();
    RecomputeScope(const RecomputeScope&) = delete;
    RecomputeScope& operator=(const RecomputeScope&) = delete;

  private:
    bool previous_;
};

// The checkpointed() call whose body this thread runs, in its forward or its recomputation (0: none;
// each call has its own number). Code that keeps a costly intermediate from a checkpointed forward for
// the recomputation (the attention output, attention_stash.h) tags it with the call, so that a
// recomputation only takes what its own forward kept.
uint64_t checkpoint_call();
class CheckpointCallScope {
  public:
    explicit CheckpointCallScope(uint64_t call);
    ~CheckpointCallScope();
    CheckpointCallScope(const CheckpointCallScope&) = delete;
    CheckpointCallScope& operator=(const CheckpointCallScope&) = delete;

  private:
    uint64_t previous_;
};

// The units under `root` (HookableUnit modules, not nested in another unit), in registration order,
// with their qualified names ("down_blocks.0.resnets.1").
std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> find_units(torch::nn::Module& root);

// Runs `body` as `unit`: the hooks registered for it around it.
at::Tensor run_unit(const torch::nn::Module& unit, const std::function<at::Tensor()>& body);
std::pair<at::Tensor, at::Tensor> run_unit_pair(
    const torch::nn::Module& unit, const std::function<std::pair<at::Tensor, at::Tensor>()>& body);

}  // namespace dtune::models
