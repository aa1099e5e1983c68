// Rotary embedding: the composite ATen form, and the fused CUDA kernels (cuda/rope_kernels.cu) behind
// a custom autograd function that saves only the cos/sin tables.
#include "models/common/rope.h"

#include <torch/autograd.h>

#include "core/error.h"
#include "core/fused_env.h"

#ifdef DTUNE_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>

#include "models/common/cuda_launch.h"
#include "models/cuda/rope_kernels.h"
#endif

namespace dtune::models {
namespace {

#ifdef DTUNE_WITH_CUDA_KERNELS
at::Tensor run(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
    at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
    if (x.numel() == 0) return out;
    const c10::cuda::CUDAGuard guard(x.device());
    const auto launch = backward ? cuda::rope_backward : cuda::rope_forward;
    check_launch(launch(x.const_data_ptr(), cos.const_data_ptr<float>(), sin.const_data_ptr<float>(),
                        out.mutable_data_ptr(), x.size(0), x.size(1), x.size(2), x.size(3),
                        kernel_dtype(x.scalar_type(), "rotary embedding"), current_stream_of(x)),
                 "rotary embedding", backward ? "backward" : "forward");
    return out;
}

struct RopeFunction : public torch::autograd::Function<RopeFunction> {
    static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                              const at::Tensor& cos, const at::Tensor& sin) {
        ctx->save_for_backward({cos, sin});
        ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
        return run(x, cos, sin, /*backward=*/false);
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
        const at::Tensor grad_out = grads[0].to(dtype).contiguous();
        return {run(grad_out, saved[0], saved[1], /*backward=*/true), at::Tensor(), at::Tensor()};
    }
};
#endif

}  // namespace

at::Tensor rotary_embedding_composite(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    const at::Tensor c = cos.unsqueeze(0).unsqueeze(2), s = sin.unsqueeze(0).unsqueeze(2);  // [1, S, 1, D]
    auto sizes = x.sizes().vec();
    sizes.back() /= 2;
    sizes.push_back(2);
    const auto pair = x.reshape(sizes).unbind(-1);  // real, imaginary
    const at::Tensor rotated = at::stack({-pair[1], pair[0]}, -1).flatten(3);
    return (x.to(at::kFloat) * c + rotated.to(at::kFloat) * s).to(x.scalar_type());
}

at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    DTUNE_CHECK_AS(UsageError,
                   x.dim() == 4 && x.size(-1) % 2 == 0 && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                       cos.size(0) == x.size(1) && cos.size(1) == x.size(3),
                   "rotary embedding: x ", x.sizes(), " must be [B, S, H, D] with D even and cos/sin ",
                   cos.sizes(), " [S, D]");
#ifdef DTUNE_WITH_CUDA_KERNELS
    const auto dtype = x.scalar_type();
    if (x.is_cuda() && (dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat) &&
        fused_kernels_allowed())
        return RopeFunction::apply(x.contiguous(), cos.to(x.device(), at::kFloat).contiguous(),
                                   sin.to(x.device(), at::kFloat).contiguous());
#endif
    return rotary_embedding_composite(x, cos, sin);
}

}  // namespace dtune::models
