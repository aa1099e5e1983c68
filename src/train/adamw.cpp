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

// base^t for t [n] float64: one multi-tensor kernel on CUDA; on the CPU each element through
// std::pow, as the host computed it (the vectorised pow kernel may differ in the last bit).
at::Tensor power(double base, const at::Tensor& t) {
    return at::stack(at::_foreach_pow(base, t.unbind()));
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
    for (size_t i = 0; i < loop_lr_.size() && i < groups_.size(); ++i)
        if (loop_lr_[i].defined()) loop_lr_[i].fill_(groups_[i].lr);
}

// The per-tensor loop (deterministic runs: one parameter at a time, a fixed op order), eager or
// captured alike. What changes per step is a tensor on the parameters' device: the step counts are
// the state's float32 counters, incremented there; the lr a float64 [] tensor (filled here, or by
// upload_lr() under use_device_lr()). The bias corrections are computed from them in float64, as
// the host once computed them from the counters it read back, and rounded once to the weights'
// math type, the value a host scalar is rounded to inside a kernel; so on the CPU a float32 step
// gives the bits of the host-scalar loop (tests/train/test_adamw_loop.cpp). On CUDA the old loop's
// addcdiv_ and scalar division rounded in another order (one float rounding apart). No host read:
// an fp16 overflow (found_inf_) restores the parameter and moments on the device.
void AdamW::step_loop(ParamGroup& g) {
    const auto index = static_cast<size_t>(&g - groups_.data());
    std::vector<size_t> active;
    for (size_t i = 0; i < g.params.size(); ++i)
        if (g.params[i].grad().defined()) active.push_back(i);
    if (active.empty()) return;
    const at::Device device = g.params[active.front()].device();
    if (loop_lr_.size() != groups_.size()) loop_lr_.resize(groups_.size());
    at::Tensor& lr = loop_lr_[index];  // [] float64
    if (!lr.defined() || lr.device() != device)
        lr = at::full({}, g.lr, at::TensorOptions().dtype(at::kDouble).device(device));
    else if (!device_lr_)
        lr.fill_(g.lr);
    std::vector<at::Tensor> steps;
    for (size_t i : active) steps.push_back(adam_state(state_of(g.names[i]), g.params[i])["step"]);
    // The counters move to `device` only when a group spans devices (then nothing here is captured).
    std::vector<at::Tensor> on_device;
    for (const auto& s : steps) on_device.push_back(s.device() == device ? s : s.to(device));
    at::Tensor skip;  // [] bool: this step overflowed (fp16)
    if (found_inf_.defined()) skip = found_inf_.to(device).gt(0);
    // t after this step's increment (not incremented when skipped), [n] float64.
    at::Tensor t = at::stack(on_device).to(at::kDouble).add_(1);
    if (skip.defined()) t.sub_(skip.to(at::kDouble));
    const double b1 = options_.beta1, b2 = options_.beta2;
    const at::Tensor step_size = lr / power(b1, t).neg_().add_(1);    // lr / (1 - b1^t)
    const at::Tensor bc2_sqrt = power(b2, t).neg_().add_(1).sqrt_();  // sqrt(1 - b2^t)
    const at::Tensor decay = (lr * g.weight_decay).neg_().add_(1);    // [] 1 - lr wd
    const at::Tensor neg_f = step_size.neg().to(at::kFloat), bc2_f = bc2_sqrt.to(at::kFloat);
    const at::Tensor decay_f = decay.to(at::kFloat), neg_d = step_size.neg();
    for (size_t k = 0; k < active.size(); ++k) {
        at::Tensor& p = g.params[active[k]];
        const at::Tensor grad = p.grad();
        TensorMap& st = state_of(g.names[active[k]]);
        at::Tensor& m = st["exp_avg"];
        at::Tensor& v = st["exp_avg_sq"];
        if (skip.defined()) {
            steps[k].add_(at::logical_not(skip).to(steps[k].device(), at::kFloat));
        } else {
            steps[k].add_(1);
        }
        std::vector<at::Tensor> kept;  // fp16: the values an overflowed step leaves
        if (skip.defined()) kept = {p.clone(), m.clone(), v.clone()};
        const bool wide = p.scalar_type() == at::kDouble;
        const at::ScalarType math = wide ? at::kDouble : at::kFloat;
        const bool same = p.scalar_type() == math;  // else bf16 / fp16: float32 temporaries
        const at::Tensor dec = (wide ? decay : decay_f).to(p.device());
        const at::Tensor neg = (wide ? neg_d : neg_f)[static_cast<int64_t>(k)].to(p.device());
        const at::Tensor bc2 = (wide ? bc2_sqrt : bc2_f)[static_cast<int64_t>(k)].to(p.device());
        if (same)
            p.mul_(dec);
        else
            p.copy_(p.to(math).mul_(dec));
        m.lerp_(grad, 1 - b1);
        v.mul_(b2).addcmul_(grad, grad, 1 - b2);
        at::Tensor denom = v.sqrt().to(math).div_(bc2);  // sqrt(v) / sqrt(1 - b2^t) + eps
        if (!same) denom = denom.to(p.scalar_type());
        denom.add_(options_.eps);
        const at::Tensor update = m.to(math).mul(neg).div_(denom.to(math));  // -step_size m / denom
        if (same)
            p.add_(update);
        else
            p.copy_(p.to(math).add_(update));
        if (skip.defined()) {
            p.copy_(at::where(skip, kept[0], p));
            m.copy_(at::where(skip, kept[1], m));
            v.copy_(at::where(skip, kept[2], v));
        }
    }
}

}  // namespace dtune::train
