// AdamW, fused or per-tensor (see optimizer.h; adamw_bf16 is in adamw_bf16.cpp).
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <optional>

#include "core/error.h"
#include "train/optimizer.h"

namespace dtune::train {

AdamW::AdamW(std::vector<ParamGroup> groups, AdamWOptions options)
    : Optimizer(std::move(groups)), options_(options) {}

void AdamW::step() {
    at::NoGradGuard no_grad;
    for (auto& g : groups_) {
        if (!(options_.fused && step_fused(g))) step_loop(g);
    }
}

namespace {

// Lazily creates AdamW's state: moments like the parameter, and a float32 step counter on its device
// (the layout _fused_adamw_ takes).
TensorMap& adam_state(TensorMap& st, const at::Tensor& p) {
    if (!st.count("exp_avg")) {
        st["exp_avg"] = at::zeros_like(p, at::MemoryFormat::Preserve);
        st["exp_avg_sq"] = at::zeros_like(p, at::MemoryFormat::Preserve);
        st["step"] = at::zeros({}, p.options().dtype(at::kFloat));
    }
    return st;
}

}  // namespace

bool AdamW::step_fused(ParamGroup& g) {
    std::vector<at::Tensor> params, grads, avgs, sqs, steps;
    for (size_t i = 0; i < g.params.size(); ++i) {
        at::Tensor& p = g.params[i];
        if (!p.grad().defined()) continue;
        params.push_back(p);
        grads.push_back(p.grad());
    }
    if (params.empty()) return true;
    const auto device = params.front().device();
    const auto dtype = params.front().scalar_type();
    for (size_t i = 0; i < params.size(); ++i) {
        const bool ok =
            params[i].device() == device && params[i].scalar_type() == dtype &&
            grads[i].scalar_type() == dtype && !grads[i].is_sparse() &&
            (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble);
        if (!ok) return false;
    }
    for (size_t i = 0, k = 0; i < g.params.size(); ++i) {
        if (!g.params[i].grad().defined()) continue;
        TensorMap& st = adam_state(state_of(g.names[i]), params[k++]);
        avgs.push_back(st["exp_avg"]);
        sqs.push_back(st["exp_avg_sq"]);
        steps.push_back(st["step"]);
    }
    // fp16: the kernel returns without writing when found_inf is 1 (the gradients are already
    // unscaled, so no grad_scale). A flag on another device cannot be read by the kernel.
    std::optional<at::Tensor> found_inf;
    if (found_inf_.defined()) {
        if (found_inf_.device() != device) return false;
        found_inf = found_inf_;
    }
    // torch increments the counters itself before the fused kernel, which only reads them.
    at::_foreach_add_(steps, 1);
    if (device_lr_ && device.is_cuda()) {
        const auto index = static_cast<size_t>(&g - groups_.data());
        if (lr_tensors_.size() != groups_.size()) lr_tensors_.resize(groups_.size());
        if (!lr_tensors_[index].defined())  // first use is eager (GraphedStep warms up before capture)
            lr_tensors_[index] = at::full({}, g.lr, at::TensorOptions().dtype(at::kFloat).device(device));
        at::_fused_adamw_(params, grads, avgs, sqs, /*max_exp_avg_sqs=*/{}, steps, lr_tensors_[index],
                          options_.beta1, options_.beta2, g.weight_decay, options_.eps, /*amsgrad=*/false,
                          /*maximize=*/false, /*grad_scale=*/std::nullopt, found_inf);
    } else {
        at::_fused_adamw_(params, grads, avgs, sqs, /*max_exp_avg_sqs=*/{}, steps, g.lr, options_.beta1,
                          options_.beta2, g.weight_decay, options_.eps, /*amsgrad=*/false, /*maximize=*/false,
                          /*grad_scale=*/std::nullopt, found_inf);
    }
    // A skipped step does not count: steps -= found_inf, on the device (torch does the same).
    if (found_inf) at::_foreach_add_(steps, *found_inf, -1);
    return true;
}

void AdamW::upload_lr() {
    for (size_t i = 0; i < lr_tensors_.size() && i < groups_.size(); ++i)
        if (lr_tensors_[i].defined()) lr_tensors_[i].fill_(groups_[i].lr);  // a tiny kernel, not captured
}

void AdamW::step_loop(ParamGroup& g) {
    // fp16 overflow: nothing of the step happens (this path reads the step counts on the host anyway).
    if (found_inf_.defined() && found_inf_.item<float>() != 0.0f) return;
    const double b1 = options_.beta1;
    const double b2 = options_.beta2;
    for (size_t i = 0; i < g.params.size(); ++i) {
        at::Tensor& p = g.params[i];
        if (!p.grad().defined()) continue;
        const at::Tensor grad = p.grad();
        TensorMap& st = adam_state(state_of(g.names[i]), p);
        st["step"].add_(1);
        const double t = st["step"].item<double>();
        p.mul_(1 - g.lr * g.weight_decay);
        st["exp_avg"].lerp_(grad, 1 - b1);
        st["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, 1 - b2);
        const double step_size = g.lr / (1 - std::pow(b1, t));
        const double bc2_sqrt = std::sqrt(1 - std::pow(b2, t));
        const at::Tensor denom = (st["exp_avg_sq"].sqrt() / bc2_sqrt).add_(options_.eps);
        p.addcdiv_(st["exp_avg"], denom, -step_size);
    }
}

}  // namespace dtune::train
