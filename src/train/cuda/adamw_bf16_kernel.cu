// adamw_bf16 as one kernel per bucket: every element's whole update (moments, shift, compensated
// weight write, four stochastic roundings) in registers, instead of ~35 whole-bucket ATen kernels
// with float32 temporaries. Same formulas and rounding points as the ATen path in adamw_bf16.cpp:
// "bf16(...)" is round-to-nearest-even, SR(...) stochastic rounding with 16 random bits.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "train/cuda/adamw_bf16_kernel.h"

namespace dtune::train::cuda {
namespace {

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"): four 32-bit random
// numbers from a 128-bit counter and a 64-bit key. Counter = (call offset / 4, element index), key =
// the generator's seed, so every (call, element) pair has its own numbers and the offsets torch hands
// out (philox_cuda_state) keep them apart from every other consumer of the generator.
__device__ __forceinline__ uint4 philox4x32_10(uint4 ctr, uint32_t k0, uint32_t k1) {
    constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const uint32_t hi0 = __umulhi(kM0, ctr.x), lo0 = kM0 * ctr.x;
        const uint32_t hi1 = __umulhi(kM1, ctr.z), lo1 = kM1 * ctr.z;
        ctr = make_uint4(hi1 ^ ctr.y ^ k0, lo1, hi0 ^ ctr.w ^ k1, lo0);
        k0 += kW0;
        k1 += kW1;
    }
    return ctr;
}

__device__ __forceinline__ float bf(float x) {
    return __bfloat162float(__float2bfloat16(x));
}

// One of x's two bf16 neighbours, the one further from zero with probability (|x| - |lower|) / ulp
// (the random 16 bits are added below the kept mantissa; the low half is then dropped).
__device__ __forceinline__ __nv_bfloat16 round_stochastic(float x, uint32_t random) {
    const uint32_t bits = (__float_as_uint(x) + (random & 0xFFFFu)) & 0xFFFF0000u;
    return __float2bfloat16(__uint_as_float(bits));  // exact: the low 16 bits are zero
}

__global__ void adamw_bf16_kernel(const __nv_bfloat16* __restrict__ grad, __nv_bfloat16* __restrict__ weights,
                                  __nv_bfloat16* __restrict__ exp_avg, __nv_bfloat16* __restrict__ exp_avg_sq,
                                  __nv_bfloat16* __restrict__ shift, int64_t n, AdamWBF16Args a,
                                  PhiloxArgs rng) {
    const uint64_t seed = rng.captured ? static_cast<uint64_t>(*rng.seed_ptr) : rng.seed;
    const uint64_t offset =
        rng.captured ? static_cast<uint64_t>(*rng.offset_ptr) + rng.offset_intragraph : rng.offset;
    const uint64_t block = offset / 4;  // offsets come in multiples of 4 numbers
    const float scale = *a.scale;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const uint4 r = philox4x32_10(
            make_uint4(static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                       static_cast<uint32_t>(i), static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32)),
            static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));

        const float g = __bfloat162float(grad[i]);
        const float p = __bfloat162float(weights[i]);
        // m <- bf16(beta1 m); m <- SR(g + (1 - beta1) m)  (textbook: SR(m + (1 - beta1) g))
        const float m_decayed = bf(a.beta1 * __bfloat162float(exp_avg[i]));
        const float m32 =
            a.simpletuner_momentum ? g + a.one_minus_beta1 * m_decayed : m_decayed + a.one_minus_beta1 * g;
        const __nv_bfloat16 m = round_stochastic(m32, r.x);
        // v <- bf16(bf16(beta2 v) + (1 - beta2) g^2); d <- bf16(bf16(sqrt v) + eps)
        const float v = bf(bf(a.beta2 * __bfloat162float(exp_avg_sq[i])) + a.one_minus_beta2 * g * g);
        const float d = bf(bf(sqrtf(v)) + a.eps);
        // shift <- SR(shift + c m / d); p' <- SR(p + shift); shift <- SR(bf16(p - p') + shift)
        const float s1 = __bfloat162float(
            round_stochastic(__bfloat162float(m) / d * scale + __bfloat162float(shift[i]), r.y));
        const __nv_bfloat16 after = round_stochastic(s1 + p, r.z);
        const __nv_bfloat16 s2 = round_stochastic(bf(p - __bfloat162float(after)) + s1, r.w);

        exp_avg[i] = m;
        exp_avg_sq[i] = __float2bfloat16(v);  // exact: v is a bf16 value already
        shift[i] = s2;
        weights[i] = after;
    }
}

}  // namespace

int adamw_bf16_bucket_step(const void* grad, void* weights, void* exp_avg, void* exp_avg_sq, void* shift,
                           int64_t n, const AdamWBF16Args& args, const PhiloxArgs& rng, void* stream) {
    if (n <= 0) return 0;
    constexpr int kThreads = 256;
    const int64_t blocks = std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 65535 * 8);
    adamw_bf16_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const __nv_bfloat16*>(grad), static_cast<__nv_bfloat16*>(weights),
        static_cast<__nv_bfloat16*>(exp_avg), static_cast<__nv_bfloat16*>(exp_avg_sq),
        static_cast<__nv_bfloat16*>(shift), n, args, rng);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace dtune::train::cuda
