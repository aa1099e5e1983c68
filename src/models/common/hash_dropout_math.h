// The element rule of the counter-based dropout (common/hash_dropout.h), shared by the CPU loop and
// the CUDA kernel (cuda/hash_dropout_kernels.cu) so both keep exactly the same elements.
//
// Element `index` of a layer with salt `salt` in a step with seed `seed` is kept when its 16-bit
// lane of a splitmix64 hash is at or above `threshold` = round(p · 2^16). One hash serves four
// consecutive elements: element i reads lane i mod 4 of the hash of (seed, salt, i / 4). (One hash
// per element made the CUDA kernel bound by 64-bit integer multiplies: 13.5 ms of an SDXL LoRA
// step at batch 4 with SimpleTuner's lora_dropout 0.1, on an H200.) Nothing is stored: the mask is a
// pure function of its inputs, so backward (and a gradient-checkpointed recompute) finds the same
// mask again from the same seed.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define DTUNE_HD_INLINE __host__ __device__ __forceinline__
#else
#define DTUNE_HD_INLINE inline
#endif

namespace dtune::models::hash_dropout_math {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;
constexpr int kBits = 16;  // resolution of the keep decision: p is rounded to a multiple of 2^-16
constexpr int kLanes = 4;  // elements per hash (64 / kBits)

DTUNE_HD_INLINE uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

// The per-layer, per-step key (computed once per thread block or loop).
DTUNE_HD_INLINE uint64_t layer_key(uint64_t seed, uint64_t salt) {
    return mix64(seed ^ mix64(salt + kGolden));
}

// The hash shared by elements [kLanes · group, kLanes · group + kLanes).
DTUNE_HD_INLINE uint64_t group_hash(uint64_t key, uint64_t group) {
    return mix64(key + kGolden * (group + 1));
}

// Element `index`'s decision from its group's hash.
DTUNE_HD_INLINE bool keep_lane(uint64_t hash, uint64_t index, uint32_t threshold) {
    return static_cast<uint32_t>((hash >> (kBits * (index % kLanes))) & ((1u << kBits) - 1)) >= threshold;
}

DTUNE_HD_INLINE bool keep(uint64_t key, uint64_t index, uint32_t threshold) {
    return keep_lane(group_hash(key, index / kLanes), index, threshold);
}

// round(p · 2^16), for p in [0, 1).
inline uint32_t threshold_for(double p) {
    return static_cast<uint32_t>(p * static_cast<double>(1u << kBits) + 0.5);
}

}  // namespace dtune::models::hash_dropout_math
