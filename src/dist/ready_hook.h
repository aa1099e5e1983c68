// A post-accumulate-grad hook that calls a function: how the gradient reducer and the ZeRO-3 engine
// learn that a parameter's gradient for this backward is final.
#pragma once

#include <torch/csrc/autograd/function_hook.h>

#include <functional>
#include <utility>

namespace dtune::dist {

struct ReadyHook final : torch::autograd::PostAccumulateGradHook {
    explicit ReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
    void operator()(const torch::autograd::Variable&) override { fn_(); }
    std::function<void()> fn_;
};

}  // namespace dtune::dist
