// hash_dropout's keep rule (common/hash_dropout_math.h) applied to V consecutive values in
// registers, for the kernels that read the mask on the fly (hash_dropout_kernels.cu,
// lora_dropout_kernels.cu). Where the first index is a multiple of kLanes (every whole pack of a
// tensor whose offset is: the usual case) each group's hash is computed once and its four 16-bit
// lanes are read at fixed shifts; otherwise the general rule, element by element. The fast path
// exists because the general one made the mask, not memory, the bound: its group hash sits behind
// a per-element runtime test and its lane shift is a 64-bit variable shift.
#pragma once

#include <stdint.h>

#include "models/common/hash_dropout_math.h"

namespace dtune::models::cuda {

// v[i] (element `first + i`) scaled by `scale` where kept, else 0. Returns the decisions: bit i set
// where element `first + i` is kept.
template <int V>
__device__ __forceinline__ uint32_t hash_mask(float (&v)[V], uint64_t key, uint64_t first, uint32_t threshold,
                                              float scale) {
    namespace math = hash_dropout_math;
    static_assert(math::kLanes == 4 && math::kBits == 16, "the fast path reads four 16-bit lanes");
    uint32_t kept = 0;
    if (V % 4 == 0 && first % math::kLanes == 0) {
#pragma unroll
        for (int g = 0; g < V / 4; ++g) {
            const uint64_t h = math::group_hash(key, first / math::kLanes + g);
            const uint32_t lo = static_cast<uint32_t>(h), hi = static_cast<uint32_t>(h >> 32);
            const uint32_t lanes[4] = {lo & 0xffffu, lo >> 16, hi & 0xffffu, hi >> 16};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const bool keep = lanes[e] >= threshold;
                v[4 * g + e] = keep ? v[4 * g + e] * scale : 0.0f;
                kept |= static_cast<uint32_t>(keep) << (4 * g + e);
            }
        }
        return kept;
    }
    uint64_t hash = math::group_hash(key, first / math::kLanes);
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const uint64_t index = first + i;
        if (i > 0 && index % math::kLanes == 0) hash = math::group_hash(key, index / math::kLanes);
        const bool keep = math::keep_lane(hash, index, threshold);
        v[i] = keep ? v[i] * scale : 0.0f;
        kept |= static_cast<uint32_t>(keep) << i;
    }
    return kept;
}

// v[i] scaled by `scale` where bit i of `kept` is set, else 0 (decisions hash_mask returned earlier).
template <int V>
__device__ __forceinline__ void bits_mask(float (&v)[V], uint32_t kept, float scale) {
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = (kept >> i) & 1u ? v[i] * scale : 0.0f;
}

}  // namespace dtune::models::cuda
