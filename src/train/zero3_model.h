// Binds a model to the ZeRO-3 engine (dist/zero3.h): its units are the model's hookable blocks
// (models::find_units: ResNet and transformer blocks), each with the trainable parameters under
// it, plus one root unit for every other trainable parameter; the engine is called from the
// model's unit hook points (models/common/unit_hooks.h), so model code knows nothing of ZeRO.
//
// Invariants: every trainable parameter is in exactly one unit; units are listed in the model's
// registration order (the same on every rank); the hooks are unregistered by the destructor.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dist/zero3.h"
#include "models/common/unit_hooks.h"

namespace dtune::train {

class ShardedModel final : public models::UnitHooks {
  public:
    // `names`/`params`: the trainable parameters (named as in model.named_parameters()).
    ShardedModel(dist::Group& group, torch::nn::Module& model, const std::vector<std::string>& names,
                 const std::vector<at::Tensor>& params, dist::Zero3Options options);
    ~ShardedModel() override;
    ShardedModel(const ShardedModel&) = delete;
    ShardedModel& operator=(const ShardedModel&) = delete;

    dist::Zero3Engine& engine() { return *engine_; }
    const dist::Zero3Engine& engine() const { return *engine_; }

    void before_unit(const torch::nn::Module& unit, bool recompute) override;
    void after_unit(const torch::nn::Module& unit, bool recompute,
                    const std::vector<at::Tensor>& outputs) override;

  private:
    std::vector<std::shared_ptr<torch::nn::Module>> modules_;  // registered units (kept alive)
    std::map<const torch::nn::Module*, std::size_t> index_;    // unit module -> engine unit
    std::unique_ptr<dist::Zero3Engine> engine_;
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
