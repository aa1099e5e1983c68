// Optimizer base (state map, zero_grad), Lion, SGD, Adafactor and gradient clipping (see optimizer.h);
// the device-lr steps of Lion, SGD and Adafactor are in optimizer_graph.cpp.
#include "train/optimizer.h"

#include <ATen/core/grad_mode.h>

#include <cmath>
#include <limits>
#include <set>

#include "core/error.h"

namespace dtune::train {

Optimizer::Optimizer(std::vector<ParamGroup> groups) : groups_(std::move(groups)) {
    std::set<std::string> seen;
    for (const auto& g : groups_) {
        DTUNE_CHECK(g.names.size() == g.params.size(), "a parameter group has ", g.params.size(),
                    " parameters but ", g.names.size(), " names; give every parameter its name");
        for (size_t i = 0; i < g.names.size(); ++i) {
            DTUNE_CHECK(seen.insert(g.names[i]).second, "parameter \"", g.names[i],
                        "\" appears twice in the optimizer's groups; each parameter must be in exactly one");
            DTUNE_CHECK(g.params[i].defined(), "parameter \"", g.names[i], "\" is an undefined tensor");
        }
    }
}

void Optimizer::zero_grad() {
    for (auto& g : groups_) {
        for (auto& p : g.params) p.mutable_grad().reset();
    }
}

void Optimizer::set_lr(double lr) {
    for (auto& g : groups_) g.lr = lr;
}

TensorMap Optimizer::state_dict() const {
    TensorMap out;
    for (const auto& [name, entries] : state_) {
        for (const auto& [key, value] : entries) out[name + "." + key] = value.clone();
    }
    return out;
}

void Optimizer::load_state_dict(const TensorMap& state) {
    std::map<std::string, const at::Tensor*> params;
    for (const auto& g : groups_) {
        for (size_t i = 0; i < g.names.size(); ++i) params[g.names[i]] = &g.params[i];
    }
    std::map<std::string, TensorMap> loaded;
    for (const auto& [full, value] : state) {
        const auto dot = full.rfind('.');
        DTUNE_CHECK_AS(DataError, dot != std::string::npos, "optimizer state key \"", full,
                       "\" is not <parameter>.<state>; the checkpoint was not written by this optimizer");
        const std::string name = full.substr(0, dot);
        const auto it = params.find(name);
        DTUNE_CHECK_AS(DataError, it != params.end(), "optimizer state \"", full,
                       "\" names no parameter of this ", this->name(),
                       " optimizer; resume with the same model, adapter and targets as the checkpoint");
        const at::Tensor& p = *it->second;
        // State is a scalar, shaped like the parameter, or (Adafactor) reduced to 1 along some dims.
        const bool scalar = value.dim() == 0;
        bool fits = scalar || value.dim() == p.dim();
        for (int64_t d = 0; fits && !scalar && d < p.dim(); ++d)
            fits = value.size(d) == p.size(d) || value.size(d) == 1;
        DTUNE_CHECK_AS(DataError, fits, "optimizer state \"", full, "\" has shape ", value.sizes(),
                       " but the parameter has ", p.sizes(),
                       "; the checkpoint belongs to a different model configuration");
        loaded[name][full.substr(dot + 1)] = scalar ? value.clone() : value.to(p.device()).clone();
    }
    state_ = std::move(loaded);
}

bool OverflowSkip::overflowed_on_host() const {
    return found_inf.defined() && found_inf.item<float>() != 0.0f;
}

// ---- Lion ---------------------------------------------------------------------------------------

Lion::Lion(std::vector<ParamGroup> groups, LionOptions options)
    : Optimizer(std::move(groups)), options_(options) {}

void Lion::step() {
    at::NoGradGuard no_grad;
    if (device_lr_) return step_device();    // captured steps: optimizer_graph.cpp
    if (skip_.overflowed_on_host()) return;  // fp16 overflow: nothing of the step happens
    for (auto& g : groups_) {
        for (size_t i = 0; i < g.params.size(); ++i) {
            at::Tensor& p = g.params[i];
            if (!p.grad().defined()) continue;
            const at::Tensor grad = p.grad();
            TensorMap& st = state_of(g.names[i]);
            if (!st.count("exp_avg")) st["exp_avg"] = at::zeros_like(p);
            at::Tensor& m = st["exp_avg"];
            if (g.weight_decay != 0) p.mul_(1 - g.lr * g.weight_decay);
            p.add_(m.lerp(grad, 1 - options_.beta1).sign_(), -g.lr);
            m.lerp_(grad, 1 - options_.beta2);
        }
    }
}

// ---- SGD ----------------------------------------------------------------------------------------

SGD::SGD(std::vector<ParamGroup> groups, SGDOptions options)
    : Optimizer(std::move(groups)), options_(options) {
    DTUNE_CHECK_AS(UsageError, !options.nesterov || (options.momentum > 0 && options.dampening == 0),
                   "SGD with nesterov needs momentum > 0 and dampening 0");
}

void SGD::step() {
    at::NoGradGuard no_grad;
    if (device_lr_) return step_device();    // captured steps: optimizer_graph.cpp
    if (skip_.overflowed_on_host()) return;  // fp16 overflow: nothing of the step happens
    for (auto& g : groups_) {
        for (size_t i = 0; i < g.params.size(); ++i) {
            at::Tensor& p = g.params[i];
            if (!p.grad().defined()) continue;
            at::Tensor d = p.grad();
            if (g.weight_decay != 0) d = d.add(p, g.weight_decay);
            if (options_.momentum != 0) {
                TensorMap& st = state_of(g.names[i]);
                auto it = st.find("momentum_buffer");
                if (it == st.end()) {
                    it = st.emplace("momentum_buffer", d.clone()).first;
                } else {
                    it->second.mul_(options_.momentum).add_(d, 1 - options_.dampening);
                }
                d = options_.nesterov ? d.add(it->second, options_.momentum) : it->second;
            }
            p.add_(d, -g.lr);
        }
    }
}

// ---- Adafactor ----------------------------------------------------------------------------------

namespace {

// torch.finfo(dtype).eps
double machine_epsilon(at::ScalarType t) {
    switch (t) {
        case at::kDouble: return std::numeric_limits<double>::epsilon();
        case at::kBFloat16: return 0.0078125;  // 2^-7
        case at::kHalf: return 0.0009765625;   // 2^-10
        default: return std::numeric_limits<float>::epsilon();
    }
}

}  // namespace

Adafactor::Adafactor(std::vector<ParamGroup> groups, AdafactorOptions options)
    : Optimizer(std::move(groups)), options_(options) {}

double Adafactor::eps1_for(at::ScalarType type) const {
    return options_.eps1.value_or(machine_epsilon(type));
}

void Adafactor::step() {
    at::NoGradGuard no_grad;
    if (device_lr_) return step_device();    // captured steps: optimizer_graph.cpp
    if (skip_.overflowed_on_host()) return;  // fp16 overflow: nothing of the step happens
    for (auto& g : groups_) {
        for (size_t i = 0; i < g.params.size(); ++i) {
            at::Tensor& p = g.params[i];
            if (!p.grad().defined()) continue;
            const at::Tensor grad = p.grad();
            const bool factored = grad.dim() > 1;
            TensorMap& st = state_of(g.names[i]);
            if (!st.count("step")) {
                st["step"] = at::zeros({}, at::kFloat);
                if (factored) {
                    auto row = grad.sizes().vec();
                    row.back() = 1;
                    auto col = grad.sizes().vec();
                    col[col.size() - 2] = 1;
                    st["row_var"] = at::zeros(row, grad.options());  // [..., R, 1]
                    st["col_var"] = at::zeros(col, grad.options());  // [..., 1, C]
                } else {
                    st["variance"] = at::zeros_like(grad);
                }
            }
            const double t = st["step"].add_(1).item<double>();
            const double eps1 = eps1_for(p.scalar_type());
            const double one_minus_beta2 = std::pow(t, options_.beta2_decay);
            const double rho = std::min(g.lr, 1.0 / std::sqrt(t));
            const double rms = p.norm().item<double>() / std::sqrt(static_cast<double>(p.numel()));
            const double alpha = std::max(options_.eps2, rms) * rho;
            if (g.weight_decay != 0) p.mul_(1 - g.lr * g.weight_decay);
            at::Tensor estimate;
            if (factored) {
                at::Tensor& row = st["row_var"];
                at::Tensor& col = st["col_var"];
                row.lerp_(at::linalg_vector_norm(grad, 2, {-1}, true).square_().div_(grad.size(-1)),
                          one_minus_beta2);
                col.lerp_(at::linalg_vector_norm(grad, 2, {-2}, true).square_().div_(grad.size(-2)),
                          one_minus_beta2);
                estimate = at::matmul(row, col).div_(row.mean({-2}, true).clamp_(eps1));  // [..., R, C]
            } else {
                st["variance"].lerp_(grad * grad, one_minus_beta2);
                estimate = st["variance"].clone();
            }
            at::Tensor update = estimate.clamp_(eps1 * eps1).rsqrt_().mul_(grad);
            const double denom =
                std::max(1.0, update.norm().item<double>() /
                                  (std::sqrt(static_cast<double>(update.numel())) * options_.d));
            p.add_(update, -alpha / denom);
        }
    }
}

// ---- clipping -----------------------------------------------------------------------------------

at::Tensor clip_grad_norm_async(const std::vector<at::Tensor>& params, double max_norm, double norm_type) {
    std::vector<at::Tensor> grads;
    for (const auto& p : params) {
        if (p.grad().defined()) grads.push_back(p.grad());
    }
    if (grads.empty()) return {};
    at::NoGradGuard no_grad;
    const at::Device device = grads.front().device();
    bool uniform = true;  // one device and dtype: the multi-tensor kernels take the whole list
    for (const auto& g : grads)
        uniform = uniform && g.device() == device && g.scalar_type() == grads.front().scalar_type();
    // Each norm in float32 straight from the multi-tensor kernel: 16-bit gradients' norms are not
    // rounded to their dtype, and need no cast each (a 0-d copy kernel per parameter otherwise).
    const std::vector<at::Tensor> norms = at::_foreach_norm(grads, norm_type, at::kFloat);
    std::vector<at::Tensor> on_device;
    on_device.reserve(norms.size());
    for (const auto& n : norms) on_device.push_back(n.to(device, at::kFloat));
    const at::Tensor stacked = at::stack(on_device);  // [num_grads]
    const at::Tensor total =
        std::isinf(norm_type) ? stacked.max() : at::linalg_vector_norm(stacked, norm_type);
    if (max_norm <= 0) return total;
    const at::Tensor coef = at::clamp_max(max_norm / (total + 1e-6), 1.0);  // scalar, on device
    if (uniform) {
        at::_foreach_mul_(grads, coef.to(grads.front().scalar_type()));
    } else {
        for (auto& grad : grads) grad.mul_(coef.to(grad.device(), grad.scalar_type()));
    }
    return total;
}

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm, double norm_type) {
    const at::Tensor total = clip_grad_norm_async(params, max_norm, norm_type);
    return total.defined() ? total.item<double>() : 0.0;
}

void clip_grad_value(const std::vector<at::Tensor>& params, double clip) {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> grads;
    for (const auto& p : params)
        if (p.grad().defined()) grads.push_back(p.grad());
    if (grads.empty()) return;
    // Two multi-tensor launches, no host synchronisation: a CUDA graph captures them.
    at::_foreach_clamp_max_(grads, at::Scalar(clip));
    at::_foreach_clamp_min_(grads, at::Scalar(-clip));
}

}  // namespace dtune::train
