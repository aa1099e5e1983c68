// Gated residual (see gated_residual.h): at::addcmul, or the CUDA kernels behind one autograd
// function that saves the gate (and y only when the gate takes a gradient).
#include "models/common/gated_residual.h"

#include <torch/autograd.h>

#include "core/fused_env.h"

#ifdef DTUNE_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>

#include "models/common/cuda_launch.h"
#include "models/cuda/gated_residual_kernels.h"
#endif

namespace dtune::models {
namespace {

FusedPathSwitch gated_residual_switch{"DTUNE_FUSED_GATED_RESIDUAL",
                                      "x + gate · y by dtune's vectorised kernels", "at::addcmul"};

#ifdef DTUNE_WITH_CUDA_KERNELS
// gate [B, 1, D] with gate.stride(2) == 1: its rows are gate.stride(0) apart.
struct GatedResidualFunction : public torch::autograd::Function<GatedResidualFunction> {
    static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                              const at::Tensor& gate, const at::Tensor& y) {
        const int64_t b = x.size(0), s = x.size(1), d = x.size(2);
        at::Tensor out = at::empty_like(x);
        const c10::cuda::CUDAGuard guard(x.device());
        check_launch(cuda::gated_residual_forward(x.const_data_ptr(), gate.const_data_ptr(), gate.stride(0),
                                                  y.const_data_ptr(), out.mutable_data_ptr(), b, s, d,
                                                  kernel_dtype(x.scalar_type(), "gated_residual"),
                                                  current_stream_of(x)),
                     "gated_residual", "forward");
        const bool gate_grad = gate.requires_grad();
        ctx->save_for_backward({gate, gate_grad ? y : at::Tensor()});
        return out;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        const at::Tensor &gate = saved[0], &y = saved[1];
        const at::Tensor g = grads[0].to(gate.scalar_type()).contiguous();
        const int64_t b = g.size(0), s = g.size(1), d = g.size(2);
        at::Tensor grad_y;
        if (ctx->needs_input_grad(2)) {
            grad_y = at::empty_like(g);
            const c10::cuda::CUDAGuard guard(g.device());
            check_launch(cuda::gated_residual_backward(g.const_data_ptr(), gate.const_data_ptr(),
                                                       gate.stride(0), grad_y.mutable_data_ptr(), b, s, d,
                                                       kernel_dtype(g.scalar_type(), "gated_residual"),
                                                       current_stream_of(g)),
                         "gated_residual", "backward");
        }
        at::Tensor grad_gate;
        if (ctx->needs_input_grad(1) && y.defined()) grad_gate = (g * y).sum(1, /*keepdim=*/true);
        return {ctx->needs_input_grad(0) ? g : at::Tensor(), grad_gate, grad_y};
    }
};

bool fused_takes(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& y) {
    const auto t = x.scalar_type();
    if (!fused_gated_residual_enabled() || !x.is_cuda() || x.dim() != 3 || y.sizes() != x.sizes() ||
        gate.dim() != 3 || gate.size(0) != x.size(0) || gate.size(1) != 1 || gate.size(2) != x.size(2) ||
        y.scalar_type() != t || gate.scalar_type() != t || y.device() != x.device() ||
        gate.device() != x.device() || (t != at::kBFloat16 && t != at::kHalf && t != at::kFloat) ||
        !x.is_contiguous() || !y.is_contiguous() || gate.stride(2) != 1)
        return false;
    const void* pointers[3] = {x.const_data_ptr(), y.const_data_ptr(), gate.const_data_ptr()};
    return cuda::gated_residual_supported(pointers, 3, x.size(2), gate.stride(0),
                                          kernel_dtype(t, "gated_residual"));
}
#endif

}  // namespace

void set_fused_gated_residual(bool enabled) {
    gated_residual_switch.set(enabled);
}

bool fused_gated_residual_enabled() {
    return gated_residual_switch.enabled();
}

at::Tensor gated_residual(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& y) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    if (fused_takes(x, gate, y)) return GatedResidualFunction::apply(x, gate, y);
#endif
    return at::addcmul(x, gate, y);
}

}  // namespace dtune::models
