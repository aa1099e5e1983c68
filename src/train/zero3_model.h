// Binds a model to the ZeRO-3 engine (dist/zero3.h): its units are the model's hookable blocks
// (models::find_units: ResNet and transformer blocks), each with the given parameters under it,
// plus one root unit for every other given parameter; the engine is called from the model's unit
// hook points (models/common/unit_hooks.h), so model code knows nothing of ZeRO.
//
// Two uses: a full fine-tune shards the trainable parameters; a LoRA shards its frozen base
// (`frozen`), while the adapters, registered on the base layers inside the units, are left out of
// the flat buffers (they are not among the given parameters) and stay replicated. A LoRA layer
// reads its base weight through the layer's own tensor, whose data the engine points into the
// unit's flat buffer, so the adapter always wraps the gathered weight.
//
// A frozen unit's backward produces no parameter gradient to tell when it is over, so its end is
// read from the autograd graph: the nodes its forward recorded (sequence numbers between the
// unit's start and end on the recording thread, reachable from its outputs) each get a post hook,
// and when the last has run the unit is released (Zero3Engine::backward_done). With gradient
// checkpointing the same is done for the recomputation's graph, inside the checkpoint's backward.
//
// Invariants: every given parameter is in exactly one unit; units are listed in the model's
// registration order (the same on every rank); the hooks are unregistered by the destructor.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dist/zero3.h"
#include "models/common/unit_hooks.h"

namespace dtune::train {

class ShardedModel final : public models::UnitHooks {
  public:
    // `names`/`params`: the parameters to shard (named as in model.named_parameters()): the
    // trainable ones, or with `frozen` a LoRA's frozen base (no gradients, see the file comment).
    ShardedModel(dist::Group& group, torch::nn::Module& model, const std::vector<std::string>& names,
                 const std::vector<at::Tensor>& params, dist::Zero3Options options, bool frozen = false);
    ~ShardedModel() override;
    ShardedModel(const ShardedModel&) = delete;
    ShardedModel& operator=(const ShardedModel&) = delete;

    dist::Zero3Engine& engine() { return *engine_; }
    const dist::Zero3Engine& engine() const { return *engine_; }

    void before_unit(const torch::nn::Module& unit, bool recompute) override;
    void after_unit(const torch::nn::Module& unit, bool recompute,
                    const std::vector<at::Tensor>& outputs) override;

  private:
    // Frozen units: post hooks on the nodes unit `u`'s run recorded since `start`; the last one
    // to run calls backward_done(u).
    void watch_backward(std::size_t u, uint64_t start, const std::vector<at::Tensor>& outputs);

    std::vector<std::shared_ptr<torch::nn::Module>> modules_;  // registered units (kept alive)
    std::map<const torch::nn::Module*, std::size_t> index_;    // unit module -> engine unit
    std::unique_ptr<dist::Zero3Engine> engine_;
    bool frozen_ = false;
    std::vector<uint64_t> start_;  // frozen: each unit's first sequence number of its current run
};

}  // namespace dtune::train

// ZeRO-3 optimizer state in checkpoints. Each rank writes the state of its own slices, keyed
// "<parameter>@<first element>.<state>" (a 1-D slice of the flattened state; scalars such as step
// counts as they are), so that any world size can rebuild any parameter's whole state by name.
namespace dtune::train {

using StateMap = std::map<std::string, at::Tensor>;

// This rank's optimizer state ("<parameter>.<state>" of its slices) keyed for a shard file.
StateMap sliced_state_for_save(const StateMap& state, const std::vector<dist::Zero3Slice>& slices);
// Whole per-parameter state from sliced entries ("<parameter>@<begin>.<state>", from any number of
// shard files); other entries pass through. `shapes`: each parameter's shape. DataError naming the
// parameter when its slices do not cover it exactly.
StateMap merge_sliced_state(const StateMap& state, const std::map<std::string, std::vector<int64_t>>& shapes);
// From whole per-parameter state: the state of this rank's slices, keyed "<parameter>.<state>".
StateMap state_for_slices(const StateMap& whole, const std::vector<dist::Zero3Slice>& slices);

}  // namespace dtune::train
