// Linear layers through cuBLASLt's epilogues (see epilogue_linear.h).
#include "models/common/epilogue_linear.h"

#include "core/fused_env.h"

#ifdef DTUNE_WITH_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "models/common/cuda_launch.h"
#endif

namespace dtune::models {
namespace {

FusedPathSwitch add_linear_switch{"DTUNE_FUSED_LINEAR_EPILOGUE",
                                  "a Linear's bias and the sum with the LoRA terms in cuBLASLt's epilogue",
                                  "at::addmm and separate adds"};

}  // namespace

void set_fused_linear_epilogue(bool enabled) {
    add_linear_switch.set(enabled);
}

bool fused_linear_epilogue_enabled() {
    return add_linear_switch.enabled();
}

#ifdef DTUNE_WITH_CUDA_KERNELS
cuda::GemmArgs linear_gemm_args(const at::Tensor& x2, const at::Tensor& weight, const at::Tensor& bias,
                                at::Tensor& out) {
    cuda::GemmArgs g;
    g.a = x2.const_data_ptr();
    g.lda = x2.stride(0);
    g.b = weight.const_data_ptr();
    g.ldb = weight.stride(0);
    g.b_nk = true;
    g.d = out.mutable_data_ptr();
    g.ldd = out.stride(0);
    g.bias = bias.const_data_ptr();
    g.m = x2.size(0);
    g.n = weight.size(0);
    g.k = weight.size(1);
    return g;
}

void* epilogue_lt_handle() {
    return static_cast<void*>(at::cuda::getCurrentCUDABlasLtHandle());
}

bool run_epilogue_gemm(const cuda::GemmArgs& g, cuda::GemmEpilogue e, const at::Tensor& like,
                       const char* who) {
    const at::Tensor workspace =
        at::empty({static_cast<int64_t>(cuda::kEpilogueGemmWorkspace)}, like.options().dtype(at::kByte));
    const int status = cuda::epilogue_gemm(g, e, kernel_dtype(like.scalar_type(), who), epilogue_lt_handle(),
                                           workspace.mutable_data_ptr(), current_stream_of(like));
    if (status == cuda::kEpilogueGemmUnsupported) return false;
    TORCH_CHECK(status == 0, who, ": cuBLASLt matmul failed (status ", status, ") for [", g.m, ", ", g.k,
                "] x [", g.k, ", ", g.n, "]");
    return true;
}
#endif

bool add_linear_applies(const at::Tensor& x2, const at::Tensor& weight, const at::Tensor& bias) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    const auto t = x2.scalar_type();
    return fused_linear_epilogue_enabled() && x2.is_cuda() && (t == at::kBFloat16 || t == at::kHalf) &&
           x2.dim() == 2 && weight.dim() == 2 && bias.defined() && bias.dim() == 1 &&
           weight.scalar_type() == t && bias.scalar_type() == t && weight.device() == x2.device() &&
           bias.device() == x2.device() && x2.stride(1) == 1 && weight.stride(1) == 1 &&
           bias.is_contiguous() && weight.size(1) == x2.size(1) && bias.size(0) == weight.size(0);
#else
    (void)x2;
    (void)weight;
    (void)bias;
    return false;
#endif
}

bool add_linear_(at::Tensor& y, const at::Tensor& x2, const at::Tensor& weight, const at::Tensor& bias) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    if (!add_linear_applies(x2, weight, bias) || y.scalar_type() != x2.scalar_type() || y.dim() != 2 ||
        !y.is_contiguous() || y.device() != x2.device() || y.size(0) != x2.size(0) ||
        y.size(1) != weight.size(0))
        return false;
    cuda::GemmArgs g = linear_gemm_args(x2, weight, bias, y);
    g.accumulate = true;
    const c10::cuda::CUDAGuard guard(y.device());
    return run_epilogue_gemm(g, cuda::GemmEpilogue::kBias, y, "add_linear_");
#else
    (void)y;
    (void)x2;
    (void)weight;
    (void)bias;
    return false;
#endif
}

}  // namespace dtune::models
