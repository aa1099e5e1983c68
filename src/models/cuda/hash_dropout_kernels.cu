// Counter-based dropout on the GPU: out = in · scale where the hash keeps the element, else 0. One
// pass, no mask tensor, no generator state: the seed is read from device memory (see
// common/hash_dropout_math.h for the rule the CPU loop shares).
#include <cstdint>

#include "models/common/hash_dropout_math.h"
#include "models/cuda/hash_dropout_kernels.h"
#include "models/cuda/kernel_utils.cuh"

namespace dtune::models::cuda {
namespace {

template <typename T>
__global__ void hash_dropout_kernel(const T* __restrict__ in, T* __restrict__ out, int64_t n,
                                    const int64_t* __restrict__ seed, uint64_t salt, int64_t index_offset,
                                    uint32_t threshold, float scale) {
    const uint64_t key = hash_dropout_math::layer_key(static_cast<uint64_t>(*seed), salt);
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const bool kept = hash_dropout_math::keep(key, static_cast<uint64_t>(index_offset + i), threshold);
        out[i] = from_float<T>(kept ? to_float(in[i]) * scale : 0.0f);
    }
}

template <typename T>
int launch(const void* in, void* out, int64_t n, const int64_t* seed, uint64_t salt, int64_t offset,
           uint32_t threshold, float scale, cudaStream_t s) {
    constexpr int kThreads = 256;
    hash_dropout_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, s>>>(
        static_cast<const T*>(in), static_cast<T*>(out), n, seed, salt, offset, threshold, scale);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

int hash_dropout(const void* in, void* out, int64_t n, const int64_t* seed, uint64_t salt,
                 int64_t index_offset, uint32_t threshold, float scale, KernelDtype dtype, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    switch (dtype) {
        case KernelDtype::kFloat:
            return launch<float>(in, out, n, seed, salt, index_offset, threshold, scale, s);
        case KernelDtype::kBFloat16:
            return launch<__nv_bfloat16>(in, out, n, seed, salt, index_offset, threshold, scale, s);
        case KernelDtype::kHalf:
            return launch<__half>(in, out, n, seed, salt, index_offset, threshold, scale, s);
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace dtune::models::cuda
