// Concatenation with a tanh-GELU on the second part (see concat_gelu_kernels.h). Composite, the
// activation is a kernel of its own, the concatenation another pass over both parts, and the
// backward's GELU gradient reads the concatenated gradient's strided columns by the scalar path (in a
// Flux single block: 200 µs against about 50 µs vectorised). Here one pass each way, 16-byte packs.
#include <cstdint>

#include "models/cuda/concat_gelu_kernels.h"
#include "models/cuda/kernel_utils.cuh"

namespace dtune::models::cuda {
namespace {

constexpr int kThreads = 256;
constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kKappa = 0.044715f;

// PyTorch's tanh approximation, forward and derivative, in the same order of operations.
__device__ __forceinline__ float gelu_tanh(float x) {
    const float x_cube = x * x * x;
    const float inner = kBeta * (x + kKappa * x_cube);
    return 0.5f * x * (1.0f + tanhf(inner));
}

__device__ __forceinline__ float gelu_tanh_grad(float dy, float x) {
    const float x_sq = x * x;
    const float x_cube = x_sq * x;
    const float inner = kBeta * (x + kKappa * x_cube);
    const float t = tanhf(inner);
    const float left = 0.5f * x, right = 1.0f + t;
    const float left_derivative = 0.5f * right;
    const float inner_derivative = kBeta * (1.0f + 3.0f * kKappa * x_sq);
    const float right_derivative = left * (1.0f - t * t) * inner_derivative;
    return dy * (left_derivative + right_derivative);
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    concat_gelu_forward_kernel(const T* __restrict__ a, const T* __restrict__ h, T* __restrict__ out,
                               int64_t rows, int64_t da, int64_t dh) {
    const int64_t width = (da + dh) / V, pa = da / V, ph = dh / V, total = rows * width;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t row = i / width, col = i % width;
        auto* dst = reinterpret_cast<Pack<T, V>*>(out) + i;
        if (col < pa) {
            *dst = reinterpret_cast<const Pack<T, V>*>(a)[row * pa + col];
            continue;
        }
        const Pack<T, V> x = reinterpret_cast<const Pack<T, V>*>(h)[row * ph + col - pa];
        Pack<T, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k) o.v[k] = from_float<T>(gelu_tanh(to_float(x.v[k])));
        *dst = o;
    }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    concat_gelu_backward_kernel(const T* __restrict__ grad_out, const T* __restrict__ h,
                                T* __restrict__ grad_a, T* __restrict__ grad_h, int64_t rows, int64_t da,
                                int64_t dh) {
    const int64_t width = (da + dh) / V, pa = da / V, ph = dh / V, total = rows * width;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t row = i / width, col = i % width;
        const Pack<T, V> g = reinterpret_cast<const Pack<T, V>*>(grad_out)[i];
        if (col < pa) {
            reinterpret_cast<Pack<T, V>*>(grad_a)[row * pa + col] = g;
            continue;
        }
        const int64_t j = row * ph + col - pa;
        const Pack<T, V> x = reinterpret_cast<const Pack<T, V>*>(h)[j];
        Pack<T, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k)
            o.v[k] = from_float<T>(gelu_tanh_grad(to_float(g.v[k]), to_float(x.v[k])));
        reinterpret_cast<Pack<T, V>*>(grad_h)[j] = o;
    }
}

template <typename T>
constexpr int pack_of() {
    return 16 / sizeof(T);
}

template <typename T>
int forward(const void* a, const void* h, void* out, int64_t rows, int64_t da, int64_t dh, cudaStream_t s) {
    constexpr int V = pack_of<T>();
    concat_gelu_forward_kernel<T, V><<<blocks_for(rows * (da + dh) / V, kThreads), kThreads, 0, s>>>(
        static_cast<const T*>(a), static_cast<const T*>(h), static_cast<T*>(out), rows, da, dh);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int backward(const void* g, const void* h, void* ga, void* gh, int64_t rows, int64_t da, int64_t dh,
             cudaStream_t s) {
    constexpr int V = pack_of<T>();
    concat_gelu_backward_kernel<T, V><<<blocks_for(rows * (da + dh) / V, kThreads), kThreads, 0, s>>>(
        static_cast<const T*>(g), static_cast<const T*>(h), static_cast<T*>(ga), static_cast<T*>(gh), rows,
        da, dh);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

bool concat_gelu_supported(const void* const* pointers, int count, int64_t da, int64_t dh,
                           KernelDtype dtype) {
    const int64_t v = dtype == KernelDtype::kFloat ? pack_of<float>() : pack_of<__nv_bfloat16>();
    if (da < 0 || dh < 1 || da % v != 0 || dh % v != 0) return false;
    for (int i = 0; i < count; ++i)
        if (!aligned16(pointers[i])) return false;
    return true;
}

int concat_gelu_forward(const void* a, const void* h, void* out, int64_t rows, int64_t da, int64_t dh,
                        KernelDtype dtype, void* stream) {
    return with_kernel_type(dtype, [&](auto tag) {
        return forward<decltype(tag)>(a, h, out, rows, da, dh, static_cast<cudaStream_t>(stream));
    });
}

int concat_gelu_backward(const void* grad_out, const void* h, void* grad_a, void* grad_h, int64_t rows,
                         int64_t da, int64_t dh, KernelDtype dtype, void* stream) {
    return with_kernel_type(dtype, [&](auto tag) {
        return backward<decltype(tag)>(grad_out, h, grad_a, grad_h, rows, da, dh,
                                       static_cast<cudaStream_t>(stream));
    });
}

}  // namespace dtune::models::cuda
