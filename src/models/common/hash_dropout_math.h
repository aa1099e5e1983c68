// The element rule of the counter-based dropout (common/hash_dropout.h), shared by the CPU loop and
// the CUDA kernel (cuda/hash_dropout_kernels.cu) so both keep exactly the same elements.
//
// Element `index` of a layer with salt `salt` in a step with seed `seed` is kept when 24 bits of a
// splitmix64 hash of (seed, salt, index) are at or above `threshold` = round(p · 2^24). Nothing is
// stored: the mask is a pure function of its inputs, so backward (and a gradient-checkpointed
// recompute) finds the same mask again from the same seed.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define DTUNE_HD_INLINE __host__ __device__ __forceinline__
#else
#define DTUNE_HD_INLINE inline
#endif

namespace dtune::models::hash_dropout_math {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;
constexpr int kBits = 24;  // resolution of the keep decision: p is rounded to a multiple of 2^-24

DTUNE_HD_INLINE uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

// The per-layer, per-step key (computed once per thread block or loop).
DTUNE_HD_INLINE uint64_t layer_key(uint64_t seed, uint64_t salt) {
    return mix64(seed ^ mix64(salt + kGolden));
}

DTUNE_HD_INLINE bool keep(uint64_t key, uint64_t index, uint32_t threshold) {
    return static_cast<uint32_t>(mix64(key + kGolden * (index + 1)) >> (64 - kBits)) >= threshold;
}

// round(p · 2^24), for p in [0, 1).
inline uint32_t threshold_for(double p) {
    return static_cast<uint32_t>(p * static_cast<double>(1u << kBits) + 0.5);
}

}  // namespace dtune::models::hash_dropout_math
