// Device helpers shared by the model kernels (models/cuda/*.cu): conversions between the storage
// types and float, 16-byte packs for vectorised loads and stores, and launch-shape helpers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "models/cuda/kernel_dtype.h"

namespace dtune::models::cuda {

__device__ __forceinline__ float to_float(float v) {
    return v;
}
__device__ __forceinline__ float to_float(__nv_bfloat16 v) {
    return __bfloat162float(v);
}
__device__ __forceinline__ float to_float(__half v) {
    return __half2float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
    return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
    return __float2half(v);
}

// V consecutive elements moved as one load/store (V * sizeof(T) = 16 bytes when vectorised).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
    T v[V];
};

// Blocks for a grid-stride loop over `work` items (capped: the loop covers the rest).
inline unsigned blocks_for(int64_t work, int threads) {
    const int64_t blocks = (work + threads - 1) / threads;
    return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, 65535 * 8));
}

inline bool aligned16(const void* p) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Calls f(T{}) with the storage type of `dtype` (float, __nv_bfloat16 or __half) and returns its
// result, a launcher's cudaError_t as an int; cudaErrorInvalidValue for an unknown code.
template <typename F>
int with_kernel_type(KernelDtype dtype, F&& f) {
    switch (dtype) {
        case KernelDtype::kFloat: return f(float{});
        case KernelDtype::kBFloat16: return f(__nv_bfloat16{});
        case KernelDtype::kHalf: return f(__half{});
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace dtune::models::cuda
