// Optimizer-state offload to host memory (`offload_optimizer_device: cpu`, DeepSpeed's
// offload_optimizer_device): the wrapped optimizer keeps its state and does its update on CPU copies
// of the parameters; each step moves the gradients to the host and the new weights back.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "train/optimizer.h"

namespace dtune::train {

class CpuOffloadOptimizer : public Optimizer {
  public:
    // Builds the optimizer that runs on the host from parameter groups like `groups` whose tensors
    // are the CPU copies.
    using Factory = std::function<std::unique_ptr<Optimizer>(std::vector<ParamGroup> host_groups)>;

    // `groups` hold the training parameters (any device). Their CPU copies (pinned when the
    // parameters are on a GPU, so the copies back are asynchronous) are made here; a parameter
    // already in pinned host memory (ZeRO-3's offloaded shards) is updated in place, with no copy.
    CpuOffloadOptimizer(std::vector<ParamGroup> groups, const Factory& make_host_optimizer);
    const char* name() const override { return name_.c_str(); }
    // Copies the gradients to the host (one wait for the GPU), updates there, queues the copies of
    // the new weights back on the current stream. Parameters without a gradient are skipped. The
    // first step after construction or load_state_dict() first re-reads every weight from the
    // device (a resume or an adapter initialisation may have changed them since).
    void step() override;
    // The host optimizer's state, with its parameter names: the same keys as without offload, so
    // checkpoints move between offloaded and plain runs.
    TensorMap state_dict() const override { return host_->state_dict(); }
    void load_state_dict(const TensorMap& state) override {
        host_->load_state_dict(state);
        reload_ = true;
    }
    std::vector<at::Generator> generators() const override { return host_->generators(); }

    const Optimizer& host_optimizer() const { return *host_; }
    // Bytes of host memory held for parameter copies and gradient buffers (not the state).
    int64_t host_copy_bytes() const;

  private:
    struct Slot {
        at::Tensor param;       // the training parameter
        at::Tensor host;        // its CPU copy, which the host optimizer updates
        at::Tensor host_grad;   // reusable host buffer for its gradient
        bool in_place = false;  // the parameter is in pinned host memory: host is the parameter itself
    };
    std::unique_ptr<Optimizer> host_;
    std::vector<std::vector<Slot>> slots_;  // per group, per parameter
    std::string name_;
    bool reload_ = true;  // re-read the weights from the device before the next update
};

}  // namespace dtune::train
