// Gradient checkpointing for libtorch modules (libtorch has no torch.utils.checkpoint).
//
// checkpointed(fn, inputs, params) runs fn(inputs) without recording a graph and records one
// autograd node instead; in backward it re-runs fn with grad enabled on detached copies of the
// inputs and back-propagates through that recomputation into the inputs and `params`. Gradients
// are identical to the plain call because the same ops run on the same values. The blocks we
// checkpoint have no randomness in training (dropout 0 in every diffusers SDXL/SD config), so no
// RNG state is replayed. The forward's autocast state (CPU and CUDA) is re-entered for the
// recomputation, which runs on the autograd thread after the caller's autocast scope has closed.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace dtune::models {

using CheckpointFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

// `inputs` may hold undefined tensors (passed through as undefined). `params` are the tensors fn
// reads besides its inputs whose gradients are wanted (the module's parameters).
// Which of a model's checkpointable units (ResNet blocks and transformer blocks, counted in forward
// order) are checkpointed: every `interval`-th one starting with the first, none when disabled.
// SimpleTuner's gradient_checkpointing_interval (1 = all, 2 = every other, ...).
struct CheckpointSelector {
    bool enabled = false;
    int64_t interval = 1;
    int64_t next = 0;  // units seen so far
    bool take() {
        const bool mine = next++ % interval == 0;
        return enabled && mine;
    }
};

at::Tensor checkpointed(CheckpointFn fn, const std::vector<at::Tensor>& inputs,
                        const std::vector<at::Tensor>& params);

}  // namespace dtune::models
