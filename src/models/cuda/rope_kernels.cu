// Fused rotary embedding on the GPU: one pass over [B, S, H, D] in each direction instead of the
// composite's casts to float, negation, stack and two products (about ten kernels and their float
// temporaries per call). Arithmetic in float, one rounding per output element. Each thread moves a
// 16-byte pack when D and the pointers allow it (D = 128 in Flux.1), else one pair.
#include <cstdint>

#include "models/cuda/kernel_utils.cuh"
#include "models/cuda/rope_kernels.h"

namespace dtune::models::cuda {
namespace {

// sign = +1: forward rotation; sign = -1: its transpose (the backward), which swaps the sign of the
// sine terms: g[2i] c + g[2i+1] s, g[2i+1] c - g[2i] s.
template <typename T, int V>
__global__ void rope_kernel(const T* __restrict__ x, const float* __restrict__ cos,
                            const float* __restrict__ sin, T* __restrict__ out, int64_t total_packs,
                            int64_t seq, int64_t heads, int64_t dim, float sign) {
    const int64_t packs_per_row = dim / V;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total_packs;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t d0 = (i % packs_per_row) * V;
        const int64_t s = (i / (packs_per_row * heads)) % seq;
        const Pack<T, V> in = reinterpret_cast<const Pack<T, V>*>(x)[i];
        const float* c = cos + s * dim + d0;
        const float* n = sin + s * dim + d0;
        Pack<T, V> o;
#pragma unroll
        for (int k = 0; k < V; k += 2) {
            const float a = to_float(in.v[k]), b = to_float(in.v[k + 1]);
            if (sign > 0) {
                o.v[k] = from_float<T>(a * c[k] - b * n[k]);
                o.v[k + 1] = from_float<T>(b * c[k + 1] + a * n[k + 1]);
            } else {
                o.v[k] = from_float<T>(a * c[k] + b * n[k + 1]);
                o.v[k + 1] = from_float<T>(b * c[k + 1] - a * n[k]);
            }
        }
        reinterpret_cast<Pack<T, V>*>(out)[i] = o;
    }
}

template <typename T>
int launch(const void* x, const float* cos, const float* sin, void* out, int64_t batch, int64_t seq,
           int64_t heads, int64_t dim, float sign, cudaStream_t s) {
    constexpr int kVec = 16 / sizeof(T) >= 2 ? 16 / sizeof(T) : 2, kThreads = 256;
    const int64_t total = batch * seq * heads * dim;
    auto* xi = static_cast<const T*>(x);
    auto* o = static_cast<T*>(out);
    if (dim % kVec == 0 && aligned16(x) && aligned16(out))
        rope_kernel<T, kVec><<<blocks_for(total / kVec, kThreads), kThreads, 0, s>>>(
            xi, cos, sin, o, total / kVec, seq, heads, dim, sign);
    else
        rope_kernel<T, 2><<<blocks_for(total / 2, kThreads), kThreads, 0, s>>>(xi, cos, sin, o, total / 2,
                                                                               seq, heads, dim, sign);
    return static_cast<int>(cudaGetLastError());
}

int dispatch(const void* x, const float* cos, const float* sin, void* out, int64_t batch, int64_t seq,
             int64_t heads, int64_t dim, KernelDtype dtype, float sign, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    switch (dtype) {
        case KernelDtype::kFloat: return launch<float>(x, cos, sin, out, batch, seq, heads, dim, sign, s);
        case KernelDtype::kBFloat16:
            return launch<__nv_bfloat16>(x, cos, sin, out, batch, seq, heads, dim, sign, s);
        case KernelDtype::kHalf: return launch<__half>(x, cos, sin, out, batch, seq, heads, dim, sign, s);
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace

int rope_forward(const void* x, const float* cos, const float* sin, void* out, int64_t batch, int64_t seq,
                 int64_t heads, int64_t dim, KernelDtype dtype, void* stream) {
    return dispatch(x, cos, sin, out, batch, seq, heads, dim, dtype, 1.0f, stream);
}

int rope_backward(const void* grad_out, const float* cos, const float* sin, void* grad_x, int64_t batch,
                  int64_t seq, int64_t heads, int64_t dim, KernelDtype dtype, void* stream) {
    return dispatch(grad_out, cos, sin, grad_x, batch, seq, heads, dim, dtype, -1.0f, stream);
}

}  // namespace dtune::models::cuda
