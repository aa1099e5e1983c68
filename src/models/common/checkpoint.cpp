// A custom autograd Function that recomputes its body in backward.
#include "models/common/checkpoint.h"

#include "models/common/unit_hooks.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <ATen/autocast_mode.h>

#include <array>
#include <atomic>

namespace dtune::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Carries the body and its parameters from forward to backward through ctx->saved_data.
struct Body : torch::CustomClassHolder {
    CheckpointFn fn;
    std::vector<at::Tensor> params;
    std::vector<bool> defined;  // which of the original inputs were defined
    std::size_t n_inputs = 0;   // defined inputs; the tensor list is [inputs..., params...]
    uint64_t call = 0;          // this call's number (unit_hooks.h's checkpoint_call)
    // Autocast (CPU, CUDA) as it was in forward: backward runs on the autograd engine's thread after
    // the caller's autocast scope has closed, and the recomputation must see the same dtypes.
    std::array<bool, 2> autocast{};
    std::array<c10::ScalarType, 2> autocast_dtype{at::kBFloat16, at::kBFloat16};
};

std::vector<at::Tensor> expand(const Body& body, const std::vector<at::Tensor>& defined_inputs) {
    std::vector<at::Tensor> out;
    std::size_t k = 0;
    for (bool d : body.defined) out.push_back(d ? defined_inputs[k++] : at::Tensor());
    return out;
}

constexpr std::array<at::DeviceType, 2> kAutocastDevices{at::kCPU, at::kCUDA};

// Re-enters the forward's autocast state for the recomputation, with the cast cache off: the
// engine thread's cache would otherwise keep low-precision copies of the weights across optimizer
// steps.
class ForwardAutocast {
  public:
    explicit ForwardAutocast(const Body& body) : cache_(at::autocast::is_autocast_cache_enabled()) {
        for (size_t i = 0; i < kAutocastDevices.size(); ++i) {
            enabled_[i] = at::autocast::is_autocast_enabled(kAutocastDevices[i]);
            dtype_[i] = at::autocast::get_autocast_dtype(kAutocastDevices[i]);
            at::autocast::set_autocast_dtype(kAutocastDevices[i], body.autocast_dtype[i]);
            at::autocast::set_autocast_enabled(kAutocastDevices[i], body.autocast[i]);
        }
        at::autocast::set_autocast_cache_enabled(false);
    }
    ~ForwardAutocast() {
        at::autocast::set_autocast_cache_enabled(cache_);
        for (size_t i = 0; i < kAutocastDevices.size(); ++i) {
            at::autocast::set_autocast_enabled(kAutocastDevices[i], enabled_[i]);
            at::autocast::set_autocast_dtype(kAutocastDevices[i], dtype_[i]);
        }
    }
    ForwardAutocast(const ForwardAutocast&) = delete;
    ForwardAutocast& operator=(const ForwardAutocast&) = delete;

  private:
    std::array<bool, 2> enabled_{};
    std::array<c10::ScalarType, 2> dtype_{};
    bool cache_;
};

struct Recompute : torch::autograd::Function<Recompute> {
    static variable_list forward(AutogradContext* ctx, at::TensorList all, c10::intrusive_ptr<Body> body) {
        std::vector<at::Tensor> inputs(all.begin(),
                                       all.begin() + static_cast<std::ptrdiff_t>(body->n_inputs));
        ctx->save_for_backward(inputs);
        at::Tensor out;
        {
            const CheckpointCallScope call(body->call);  // attention_stash.h keeps its outputs
            out = body->fn(expand(*body, inputs));       // grad mode is off inside forward
        }
        ctx->saved_data["body"] = c10::IValue::make_capsule(body);
        return {out};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
        auto body = c10::static_intrusive_pointer_cast<Body>(ctx->saved_data["body"].toCapsule());
        std::vector<at::Tensor> saved = ctx->get_saved_variables();
        std::vector<at::Tensor> inputs, targets;
        std::vector<std::size_t> target_slot;  // index in [inputs..., params...] of each target
        for (std::size_t i = 0; i < saved.size(); ++i) {
            at::Tensor x = saved[i].detach();
            if (ctx->needs_input_grad(i) && x.is_floating_point()) {
                x.requires_grad_(true);
                targets.push_back(x);
                target_slot.push_back(i);
            }
            inputs.push_back(x);
        }
        for (std::size_t j = 0; j < body->params.size(); ++j) {
            if (!ctx->needs_input_grad(body->n_inputs + j)) continue;
            targets.push_back(body->params[j]);
            target_slot.push_back(body->n_inputs + j);
        }
        at::Tensor out;
        {
            at::AutoGradMode enable(true);
            const ForwardAutocast autocast(*body);
            const RecomputeScope recomputing;  // unit hooks (unit_hooks.h) see a recomputation
            const CheckpointCallScope call(body->call);
            out = body->fn(expand(*body, inputs));
        }
        variable_list result(body->n_inputs + body->params.size() + 1);  // + the non-tensor `body` arg
        if (targets.empty() || !out.requires_grad()) return result;
        variable_list grads = torch::autograd::grad({out}, targets, {grad_out[0]}, /*retain_graph=*/false,
                                                    /*create_graph=*/false, /*allow_unused=*/true);
        for (std::size_t k = 0; k < targets.size(); ++k) result[target_slot[k]] = grads[k];
        return result;
    }
};

}  // namespace

at::Tensor checkpointed(CheckpointFn fn, const std::vector<at::Tensor>& inputs,
                        const std::vector<at::Tensor>& params) {
    static std::atomic<uint64_t> calls{0};
    auto body = c10::make_intrusive<Body>();
    body->call = ++calls;
    body->fn = std::move(fn);
    body->params = params;
    for (size_t i = 0; i < kAutocastDevices.size(); ++i) {
        body->autocast[i] = at::autocast::is_autocast_enabled(kAutocastDevices[i]);
        body->autocast_dtype[i] = at::autocast::get_autocast_dtype(kAutocastDevices[i]);
    }
    std::vector<at::Tensor> all;
    for (const at::Tensor& x : inputs) {
        body->defined.push_back(x.defined());
        if (x.defined()) all.push_back(x);
    }
    body->n_inputs = all.size();
    all.insert(all.end(), params.begin(), params.end());
    return Recompute::apply(at::TensorList(all), body)[0];
}

}  // namespace dtune::models
