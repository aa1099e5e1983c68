// Fused GEGLU: a custom autograd function over one forward and one backward kernel. The CPU kernel
// is a parallel loop; the CUDA one lives in cuda/geglu_kernels.cu. Both use geglu_math.h.
#include "models/common/geglu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <atomic>
#include <stdexcept>
#include <string>

#include "core/fused_env.h"
#include "models/common/geglu_math.h"

#ifdef DTUNE_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "models/common/cuda_launch.h"
#include "models/cuda/geglu_kernels.h"
#endif

namespace dtune::models {
namespace {

std::atomic<bool> g_fused{true};

// proj [rows, 2d] contiguous -> out [rows, d] (forward) or grad_out [rows, d] -> grad_proj [rows, 2d].
void cpu_forward(const at::Tensor& proj, at::Tensor& out, int64_t rows, int64_t d) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, proj.scalar_type(), "geglu_forward_cpu", [&] {
        using opmath = at::opmath_type<scalar_t>;
        const scalar_t* p = proj.const_data_ptr<scalar_t>();
        scalar_t* o = out.mutable_data_ptr<scalar_t>();
        at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                const scalar_t* h = p + r * 2 * d;
                const scalar_t* g = h + d;
                for (int64_t c = 0; c < d; ++c)
                    o[r * d + c] = static_cast<scalar_t>(static_cast<opmath>(h[c]) *
                                                         geglu_math::gelu(static_cast<opmath>(g[c])));
            }
        });
    });
}

void cpu_backward(const at::Tensor& grad_out, const at::Tensor& proj, at::Tensor& grad_proj, int64_t rows,
                  int64_t d) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, proj.scalar_type(), "geglu_backward_cpu", [&] {
        using opmath = at::opmath_type<scalar_t>;
        const scalar_t* p = proj.const_data_ptr<scalar_t>();
        const scalar_t* go = grad_out.const_data_ptr<scalar_t>();
        scalar_t* gp = grad_proj.mutable_data_ptr<scalar_t>();
        at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                const scalar_t* h = p + r * 2 * d;
                const scalar_t* g = h + d;
                scalar_t* gh = gp + r * 2 * d;
                scalar_t* gg = gh + d;
                for (int64_t c = 0; c < d; ++c) {
                    const opmath up = static_cast<opmath>(go[r * d + c]), gate = static_cast<opmath>(g[c]);
                    gh[c] = static_cast<scalar_t>(up * geglu_math::gelu(gate));
                    gg[c] =
                        static_cast<scalar_t>(up * static_cast<opmath>(h[c]) * geglu_math::gelu_grad(gate));
                }
            }
        });
    });
}

at::Tensor run_forward(const at::Tensor& proj) {
    const int64_t d = proj.size(-1) / 2, rows = proj.numel() / std::max<int64_t>(1, 2 * d);
    auto sizes = proj.sizes().vec();
    sizes.back() = d;
    at::Tensor out = at::empty(sizes, proj.options());
    if (proj.numel() == 0) return out;
#ifdef DTUNE_WITH_CUDA_KERNELS
    if (proj.is_cuda()) {
        const c10::cuda::CUDAGuard guard(proj.device());
        check_launch(cuda::geglu_forward(proj.const_data_ptr(), out.mutable_data_ptr(), rows, d,
                                         kernel_dtype(proj.scalar_type(), "geglu"), current_stream_of(proj)),
                     "geglu", "forward");
        return out;
    }
#endif
    cpu_forward(proj, out, rows, d);
    return out;
}

at::Tensor run_backward(const at::Tensor& grad_out, const at::Tensor& proj) {
    const int64_t d = proj.size(-1) / 2, rows = proj.numel() / std::max<int64_t>(1, 2 * d);
    at::Tensor grad_proj = at::empty_like(proj);
    if (proj.numel() == 0) return grad_proj;
#ifdef DTUNE_WITH_CUDA_KERNELS
    if (proj.is_cuda()) {
        const c10::cuda::CUDAGuard guard(proj.device());
        check_launch(cuda::geglu_backward(grad_out.const_data_ptr(), proj.const_data_ptr(),
                                          grad_proj.mutable_data_ptr(), rows, d,
                                          kernel_dtype(proj.scalar_type(), "geglu"), current_stream_of(proj)),
                     "geglu", "backward");
        return grad_proj;
    }
#endif
    cpu_backward(grad_out, proj, grad_proj, rows, d);
    return grad_proj;
}

struct GegluFunction : public torch::autograd::Function<GegluFunction> {
    static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& proj) {
        ctx->save_for_backward({proj});
        return run_forward(proj);
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const at::Tensor proj = ctx->get_saved_variables()[0];
        // grad_out in the forward's dtype: autocast regions may hand back another one.
        const at::Tensor grad_out = grads[0].to(proj.scalar_type()).contiguous();
        return {run_backward(grad_out, proj)};
    }
};

}  // namespace

void set_fused_geglu(bool enabled) {
    g_fused.store(enabled);
}

bool fused_geglu_enabled() {
    return g_fused.load() && fused_kernels_allowed();
}

bool fused_geglu_available(const at::Device& device) {
    if (device.is_cpu()) return true;
#ifdef DTUNE_WITH_CUDA_KERNELS
    return device.is_cuda();
#else
    return false;
#endif
}

at::Tensor geglu_composite(const at::Tensor& proj) {
    auto parts = proj.chunk(2, -1);
    return parts[0] * at::gelu(parts[1]);
}

at::Tensor geglu(const at::Tensor& proj) {
    const auto dtype = proj.scalar_type();
    const bool floating = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf ||
                          (dtype == at::kDouble && proj.is_cpu());
    if (!fused_geglu_enabled() || !floating || proj.dim() == 0 || proj.size(-1) % 2 != 0 ||
        !fused_geglu_available(proj.device()))
        return geglu_composite(proj);
    return GegluFunction::apply(proj.contiguous());
}

}  // namespace dtune::models
