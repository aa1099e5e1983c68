// Concatenation with a tanh-GELU (see concat_gelu.h): the composite ops, and the CUDA kernels behind
// one autograd function that saves h.
#include "models/common/concat_gelu.h"

#include <torch/autograd.h>

#include "core/error.h"
#include "core/fused_env.h"

#ifdef DTUNE_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>

#include "models/common/cuda_launch.h"
#include "models/cuda/concat_gelu_kernels.h"
#endif

namespace dtune::models {
namespace {

FusedPathSwitch concat_gelu_switch{"DTUNE_FUSED_CONCAT_GELU",
                                   "attention output and MLP GELU concatenated by one kernel",
                                   "at::cat and at::gelu"};

#ifdef DTUNE_WITH_CUDA_KERNELS
struct ConcatGeluFunction : public torch::autograd::Function<ConcatGeluFunction> {
    // a, h contiguous
    static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a,
                              const at::Tensor& h) {
        const int64_t da = a.size(-1), dh = h.size(-1), rows = h.numel() / dh;
        auto sizes = h.sizes().vec();
        sizes.back() = da + dh;
        at::Tensor out = at::empty(sizes, h.options());
        const c10::cuda::CUDAGuard guard(h.device());
        check_launch(cuda::concat_gelu_forward(a.const_data_ptr(), h.const_data_ptr(), out.mutable_data_ptr(),
                                               rows, da, dh, kernel_dtype(h.scalar_type(), "concat_gelu"),
                                               current_stream_of(h)),
                     "concat_gelu", "forward");
        ctx->save_for_backward({h});
        ctx->saved_data["da"] = da;
        return out;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const at::Tensor h = ctx->get_saved_variables()[0];
        const int64_t da = ctx->saved_data["da"].toInt(), dh = h.size(-1), rows = h.numel() / dh;
        const at::Tensor g = grads[0].to(h.scalar_type()).contiguous();
        auto sizes = h.sizes().vec();
        sizes.back() = da;
        at::Tensor grad_a = at::empty(sizes, h.options()), grad_h = at::empty_like(h);
        const c10::cuda::CUDAGuard guard(h.device());
        check_launch(
            cuda::concat_gelu_backward(g.const_data_ptr(), h.const_data_ptr(), grad_a.mutable_data_ptr(),
                                       grad_h.mutable_data_ptr(), rows, da, dh,
                                       kernel_dtype(h.scalar_type(), "concat_gelu"), current_stream_of(h)),
            "concat_gelu", "backward");
        return {grad_a, grad_h};
    }
};

bool fused_takes(const at::Tensor& a, const at::Tensor& h) {
    const auto t = h.scalar_type();
    if (!fused_concat_gelu_enabled() || !h.is_cuda() || a.device() != h.device() || a.scalar_type() != t ||
        (t != at::kBFloat16 && t != at::kHalf && t != at::kFloat) || a.dim() != h.dim() || h.dim() < 1 ||
        a.sizes().slice(0, a.dim() - 1) != h.sizes().slice(0, h.dim() - 1) || !a.is_contiguous() ||
        !h.is_contiguous())
        return false;
    const void* pointers[2] = {a.const_data_ptr(), h.const_data_ptr()};
    return cuda::concat_gelu_supported(pointers, 2, a.size(-1), h.size(-1), kernel_dtype(t, "concat_gelu"));
}
#endif

}  // namespace

void set_fused_concat_gelu(bool enabled) {
    concat_gelu_switch.set(enabled);
}

bool fused_concat_gelu_enabled() {
    return concat_gelu_switch.enabled();
}

at::Tensor concat_gelu_tanh(const at::Tensor& a, const at::Tensor& h) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    // The attention output is a view of contiguous memory in Flux; anything else is made so (one copy,
    // as at::cat would read it anyway).
    const at::Tensor ac = a.is_cuda() ? a.contiguous() : a;
    if (fused_takes(ac, h.is_cuda() ? h.contiguous() : h))
        return ConcatGeluFunction::apply(ac, h.contiguous());
#endif
    return at::cat({a, at::gelu(h, "tanh")}, -1);
}

}  // namespace dtune::models
