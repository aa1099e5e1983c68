// Fused GEGLU forward and backward on the GPU: one pass each over the projection's [rows, 2d] output
// instead of chunk + gelu + mul (forward) and mul/gelu backward + cat (backward). Arithmetic in
// float, one rounding per output element. Loads and stores are 16-byte vectors when d and the
// pointers allow it (d = 2560 / 5120 in SDXL), else one element per thread.
#include <cstdint>

#include "models/common/geglu_math.h"
#include "models/cuda/geglu_kernels.h"
#include "models/cuda/kernel_utils.cuh"

namespace dtune::models::cuda {
namespace {

template <typename T, int V>
__global__ void geglu_forward_kernel(const T* __restrict__ proj, T* __restrict__ out, int64_t rows,
                                     int64_t d) {
    const int64_t packs_per_row = d / V, total = rows * packs_per_row;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = i / packs_per_row, c = (i - r * packs_per_row) * V;
        const T* row = proj + r * 2 * d;
        const Pack<T, V> h = *reinterpret_cast<const Pack<T, V>*>(row + c);
        const Pack<T, V> g = *reinterpret_cast<const Pack<T, V>*>(row + d + c);
        Pack<T, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k)
            o.v[k] = from_float<T>(to_float(h.v[k]) * geglu_math::gelu(to_float(g.v[k])));
        *reinterpret_cast<Pack<T, V>*>(out + r * d + c) = o;
    }
}

template <typename T, int V>
__global__ void geglu_backward_kernel(const T* __restrict__ grad_out, const T* __restrict__ proj,
                                      T* __restrict__ grad_proj, int64_t rows, int64_t d) {
    const int64_t packs_per_row = d / V, total = rows * packs_per_row;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = i / packs_per_row, c = (i - r * packs_per_row) * V;
        const T* row = proj + r * 2 * d;
        const Pack<T, V> h = *reinterpret_cast<const Pack<T, V>*>(row + c);
        const Pack<T, V> g = *reinterpret_cast<const Pack<T, V>*>(row + d + c);
        const Pack<T, V> go = *reinterpret_cast<const Pack<T, V>*>(grad_out + r * d + c);
        Pack<T, V> gh, gg;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const float gate = to_float(g.v[k]), up = to_float(go.v[k]);
            gh.v[k] = from_float<T>(up * geglu_math::gelu(gate));
            gg.v[k] = from_float<T>(up * to_float(h.v[k]) * geglu_math::gelu_grad(gate));
        }
        T* grow = grad_proj + r * 2 * d;
        *reinterpret_cast<Pack<T, V>*>(grow + c) = gh;
        *reinterpret_cast<Pack<T, V>*>(grow + d + c) = gg;
    }
}

template <typename T>
int launch_forward(const void* proj, void* out, int64_t rows, int64_t d, cudaStream_t s) {
    constexpr int kVec = 16 / sizeof(T), kThreads = 256;
    auto* p = static_cast<const T*>(proj);
    auto* o = static_cast<T*>(out);
    if (d % kVec == 0 && aligned16(proj) && aligned16(out))
        geglu_forward_kernel<T, kVec>
            <<<blocks_for(rows * d / kVec, kThreads), kThreads, 0, s>>>(p, o, rows, d);
    else
        geglu_forward_kernel<T, 1><<<blocks_for(rows * d, kThreads), kThreads, 0, s>>>(p, o, rows, d);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_backward(const void* grad_out, const void* proj, void* grad_proj, int64_t rows, int64_t d,
                    cudaStream_t s) {
    constexpr int kVec = 16 / sizeof(T), kThreads = 256;
    auto* go = static_cast<const T*>(grad_out);
    auto* p = static_cast<const T*>(proj);
    auto* gp = static_cast<T*>(grad_proj);
    if (d % kVec == 0 && aligned16(grad_out) && aligned16(proj) && aligned16(grad_proj))
        geglu_backward_kernel<T, kVec>
            <<<blocks_for(rows * d / kVec, kThreads), kThreads, 0, s>>>(go, p, gp, rows, d);
    else
        geglu_backward_kernel<T, 1><<<blocks_for(rows * d, kThreads), kThreads, 0, s>>>(go, p, gp, rows, d);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

int geglu_forward(const void* proj, void* out, int64_t rows, int64_t d, KernelDtype dtype, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    switch (dtype) {
        case KernelDtype::kFloat: return launch_forward<float>(proj, out, rows, d, s);
        case KernelDtype::kBFloat16: return launch_forward<__nv_bfloat16>(proj, out, rows, d, s);
        case KernelDtype::kHalf: return launch_forward<__half>(proj, out, rows, d, s);
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

int geglu_backward(const void* grad_out, const void* proj, void* grad_proj, int64_t rows, int64_t d,
                   KernelDtype dtype, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    switch (dtype) {
        case KernelDtype::kFloat: return launch_backward<float>(grad_out, proj, grad_proj, rows, d, s);
        case KernelDtype::kBFloat16:
            return launch_backward<__nv_bfloat16>(grad_out, proj, grad_proj, rows, d, s);
        case KernelDtype::kHalf: return launch_backward<__half>(grad_out, proj, grad_proj, rows, d, s);
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace dtune::models::cuda
