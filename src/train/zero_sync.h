// ZeRO-1/2 parameter sync overlapped with the next forward. After its optimizer step each rank has
// updated only the parameters it owns (dist::ZeroPartition); every other rank needs those values
// before it reads them. Instead of broadcasting everything after the step (the host then waits, or,
// under a CUDA graph, the GPU runs the broadcasts with nothing else to do), the broadcasts are
// issued at the start of the next forward, one grouped collective per unit of the model (the
// blocks models::find_units() finds; the parameters outside every block form a first group), in
// the units' order, each parameter from its owner straight into place (no staging copy). The
// forward waits for a unit's group only where that unit runs (models/common/unit_hooks.h), so on
// NCCL the broadcasts of later blocks run beside the compute of earlier ones.
//
// Coalesced (the default): within a unit, each run of consecutive parameters with the same owner,
// dtype and device is moved once, at construction, into one flat buffer (each parameter's data a
// view of it, at an offset aligned to 256 bytes; the TensorImpls stay, so the model, autograd and
// the optimizer keep theirs), and the run is one broadcast of that buffer. With the contiguous
// ZeRO-1/2 partition (dist::ZeroLayout::kContiguous) a unit is one or two runs, so a block costs
// one or two large broadcasts instead of one per parameter.
//
// Invariants:
// - Every forward of a training step starts with a full sync (begin_forward), whether or not the
//   previous step changed anything: a CUDA graph captured at any step then holds the broadcasts,
//   and a redundant sync only copies equal values.
// - Nothing else reads the parameters between steps without flush() first (every rank calls it at
//   the same point: it is a collective): checkpoints, validation, eval loss, exports, EMA.
// - wait_all() before the optimizer step: no broadcast of a parameter is still in flight when the
//   optimizer writes it (a unit that did not run in the forward was never waited for otherwise).
// - The hooks are registered per unit module and removed by the destructor.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "models/common/unit_hooks.h"

namespace dtune::dist {
class Group;
class Pending;
}  // namespace dtune::dist

namespace dtune::train {

class DeferredParameterSync final : public models::UnitHooks {
  public:
    // `params` with `owners[i]` the rank that updates params[i]; the parameters of `model`'s units
    // are found by identity (a parameter outside every unit goes to the first group). Every
    // parameter must be contiguous. `coalesce`: move each owner run of a unit into one flat buffer
    // (see the file comment); every rank must pass the same.
    DeferredParameterSync(dist::Group& group, torch::nn::Module& model, const std::vector<at::Tensor>& params,
                          const std::vector<int>& owners, bool coalesce = true);
    ~DeferredParameterSync() override;
    DeferredParameterSync(const DeferredParameterSync&) = delete;
    DeferredParameterSync& operator=(const DeferredParameterSync&) = delete;

    // Start of a training forward: issues every group's broadcasts and waits for the first group
    // (the parameters outside the units, used all over the forward).
    void begin_forward();
    // Waits for every group still in flight (on NCCL a stream wait, no host wait).
    void wait_all();
    // A full sync now: issued and waited for (collective: every rank calls it at the same point).
    void flush();

    std::size_t groups() const { return groups_.size(); }
    // Broadcasts per full sync (one per flat run when coalesced, else one per parameter).
    std::size_t broadcasts() const;

    void before_unit(const torch::nn::Module& unit, bool recompute) override;
    void after_unit(const torch::nn::Module&, bool, const std::vector<at::Tensor>&) override {}

  private:
    struct SyncGroup {
        std::vector<at::Tensor> tensors;  // detached parameters or flat runs, in place
        std::vector<int> roots;
        std::unique_ptr<dist::Pending> pending;
        // Coalesced parameters and where their data must stay (inside their run): checked before
        // every issue, since a parameter re-pointed elsewhere (Module::to) would silently stop
        // being synced.
        std::vector<std::pair<at::Tensor, const void*>> moved;
    };
    void issue();
    void wait(std::size_t g);
    // Replaces each run of two or more consecutive tensors of `g` with one root, dtype and device
    // by one flat buffer holding their data (`params`: the parameters themselves, re-pointed).
    static void coalesce(SyncGroup& g, const std::vector<at::Tensor>& params);

    dist::Group& group_;
    std::vector<SyncGroup> groups_;  // [0]: outside every unit (may be empty), then one per unit
    std::vector<std::shared_ptr<torch::nn::Module>> modules_;   // the units with hooks (kept alive)
    std::map<const torch::nn::Module*, std::size_t> group_of_;  // unit module -> its group
};

}  // namespace dtune::train
