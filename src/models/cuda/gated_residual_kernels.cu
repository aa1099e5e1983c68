// Gated residual (see gated_residual_kernels.h). ATen's addcmul and mul take their scalar path for a
// gate broadcast over the tokens (about 30 µs for one Flux block's 4608 × 3072 tokens, against about
// 20 µs of memory traffic); here 16-byte packs, the gate's pack read per element pack (it stays in
// cache).
#include <cstdint>

#include "models/cuda/gated_residual_kernels.h"
#include "models/cuda/kernel_utils.cuh"

namespace dtune::models::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    gated_residual_forward_kernel(const T* __restrict__ x, const T* __restrict__ gate, int64_t gate_stride,
                                  const T* __restrict__ y, T* __restrict__ out, int64_t seq,
                                  int64_t packs_per_row, int64_t total) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t row = i / packs_per_row, col = i % packs_per_row, b = row / seq;
        const Pack<T, V> xv = reinterpret_cast<const Pack<T, V>*>(x)[i];
        const Pack<T, V> yv = reinterpret_cast<const Pack<T, V>*>(y)[i];
        const Pack<T, V> gv = reinterpret_cast<const Pack<T, V>*>(gate + b * gate_stride)[col];
        Pack<T, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k)
            o.v[k] = from_float<T>(to_float(xv.v[k]) + to_float(gv.v[k]) * to_float(yv.v[k]));
        reinterpret_cast<Pack<T, V>*>(out)[i] = o;
    }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    gated_residual_backward_kernel(const T* __restrict__ grad_out, const T* __restrict__ gate,
                                   int64_t gate_stride, T* __restrict__ grad_y, int64_t seq,
                                   int64_t packs_per_row, int64_t total) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t row = i / packs_per_row, col = i % packs_per_row, b = row / seq;
        const Pack<T, V> g = reinterpret_cast<const Pack<T, V>*>(grad_out)[i];
        const Pack<T, V> gv = reinterpret_cast<const Pack<T, V>*>(gate + b * gate_stride)[col];
        Pack<T, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k) o.v[k] = from_float<T>(to_float(g.v[k]) * to_float(gv.v[k]));
        reinterpret_cast<Pack<T, V>*>(grad_y)[i] = o;
    }
}

template <typename T>
constexpr int pack_of() {
    return 16 / sizeof(T);
}

template <typename T>
int forward(const void* x, const void* gate, int64_t gs, const void* y, void* out, int64_t batch, int64_t seq,
            int64_t d, cudaStream_t s) {
    constexpr int V = pack_of<T>();
    const int64_t total = batch * seq * d / V;
    gated_residual_forward_kernel<T, V><<<blocks_for(total, kThreads), kThreads, 0, s>>>(
        static_cast<const T*>(x), static_cast<const T*>(gate), gs, static_cast<const T*>(y),
        static_cast<T*>(out), seq, d / V, total);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int backward(const void* g, const void* gate, int64_t gs, void* gy, int64_t batch, int64_t seq, int64_t d,
             cudaStream_t s) {
    constexpr int V = pack_of<T>();
    const int64_t total = batch * seq * d / V;
    gated_residual_backward_kernel<T, V><<<blocks_for(total, kThreads), kThreads, 0, s>>>(
        static_cast<const T*>(g), static_cast<const T*>(gate), gs, static_cast<T*>(gy), seq, d / V, total);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

bool gated_residual_supported(const void* const* pointers, int count, int64_t d, int64_t gate_stride,
                              KernelDtype dtype) {
    const int64_t v = dtype == KernelDtype::kFloat ? pack_of<float>() : pack_of<__nv_bfloat16>();
    if (d < 1 || d % v != 0 || gate_stride % v != 0) return false;
    for (int i = 0; i < count; ++i)
        if (!aligned16(pointers[i])) return false;
    return true;
}

int gated_residual_forward(const void* x, const void* gate, int64_t gate_stride, const void* y, void* out,
                           int64_t batch, int64_t seq, int64_t d, KernelDtype dtype, void* stream) {
    return with_kernel_type(dtype, [&](auto tag) {
        return forward<decltype(tag)>(x, gate, gate_stride, y, out, batch, seq, d,
                                      static_cast<cudaStream_t>(stream));
    });
}

int gated_residual_backward(const void* grad_out, const void* gate, int64_t gate_stride, void* grad_y,
                            int64_t batch, int64_t seq, int64_t d, KernelDtype dtype, void* stream) {
    return with_kernel_type(dtype, [&](auto tag) {
        return backward<decltype(tag)>(grad_out, gate, gate_stride, grad_y, batch, seq, d,
                                       static_cast<cudaStream_t>(stream));
    });
}

}  // namespace dtune::models::cuda
