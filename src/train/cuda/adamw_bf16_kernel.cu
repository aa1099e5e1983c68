// adamw_bf16 as one kernel per bucket: every element's whole update (moments, shift, compensated
// weight write, four stochastic roundings) in registers, instead of ~35 whole-bucket ATen kernels
// with float32 temporaries. Same formulas and rounding points as the ATen path in adamw_bf16.cpp:
// "bf16(...)" is round-to-nearest-even, SR(...) stochastic rounding with 16 random bits.
//
// The kernel reads each parameter's gradient and weight where they live (chunks passed in the
// launch's arguments, a column of blocks each) and the optimizer state from the bucket's flat arrays, 16
// bytes at a time where the pointers allow: no gathered copy of the gradients or weights and no copy back.
// The random bits come from one splitmix64 hash per element (four 16-bit numbers), keyed by the generator's
// Philox seed and offset: a ten-round Philox per element made the kernel bound by integer multiplies (25 ms
// of an SDXL full fine-tune step on an H200, 2.6 G parameters).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "train/cuda/adamw_bf16_kernel.h"

namespace dtune::train::cuda {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
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

struct Element {
    __nv_bfloat16 m, v, shift, weight;
};

// One element's step: g, p, m, v, s as stored; `random` holds its four 16-bit numbers.
__device__ __forceinline__ Element update(float g, float p, float m_in, float v_in, float s_in,
                                          uint64_t random, const AdamWBF16Args& a, float scale) {
    // grad_clip_method value, as clamping the bf16 gradient in place did: the bound rounded to bf16,
    // and a NaN stays NaN.
    if (a.grad_clamp > 0) {
        const float c = bf(a.grad_clamp);
        g = g > c ? c : (g < -c ? -c : g);
    }
    // m <- bf16(beta1 m); m <- SR(g + (1 - beta1) m)  (textbook: SR(m + (1 - beta1) g))
    const float m_decayed = bf(a.beta1 * m_in);
    const float m32 =
        a.simpletuner_momentum ? g + a.one_minus_beta1 * m_decayed : m_decayed + a.one_minus_beta1 * g;
    const __nv_bfloat16 m = round_stochastic(m32, static_cast<uint32_t>(random));
    // v <- bf16(bf16(beta2 v) + (1 - beta2) g^2); d <- bf16(bf16(sqrt v) + eps)
    const float v = bf(bf(a.beta2 * v_in) + a.one_minus_beta2 * g * g);
    const float d = bf(bf(sqrtf(v)) + a.eps);
    // shift <- SR(shift + c m / d); p' <- SR(p + shift); shift <- SR(bf16(p - p') + shift)
    const float s1 = __bfloat162float(
        round_stochastic(__bfloat162float(m) / d * scale + s_in, static_cast<uint32_t>(random >> 16)));
    const __nv_bfloat16 after = round_stochastic(s1 + p, static_cast<uint32_t>(random >> 32));
    const __nv_bfloat16 s2 =
        round_stochastic(bf(p - __bfloat162float(after)) + s1, static_cast<uint32_t>(random >> 48));
    return {m, __float2bfloat16(v) /* exact: v is a bf16 value */, s2, after};
}

struct alignas(16) Pack8 {
    __nv_bfloat16 v[8];
};

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// blockIdx.y picks the chunk; the x blocks stride over its elements.
__global__ void adamw_bf16_kernel(const AdamWBF16Chunks batch, __nv_bfloat16* __restrict__ exp_avg,
                                  __nv_bfloat16* __restrict__ exp_avg_sq, __nv_bfloat16* __restrict__ shift,
                                  AdamWBF16Args a, PhiloxArgs rng) {
    // fp16: an overflowed step writes nothing (its random numbers are spent all the same).
    if (a.found_inf != nullptr && *a.found_inf != 0.0f) return;
    const AdamWBF16Chunk& c = batch.chunk[blockIdx.y];
    const uint64_t seed = rng.captured ? static_cast<uint64_t>(*rng.seed_ptr) : rng.seed;
    const uint64_t offset =
        rng.captured ? static_cast<uint64_t>(*rng.offset_ptr) + rng.offset_intragraph : rng.offset;
    const uint64_t key = mix64(seed ^ mix64(offset + kGolden));
    const float scale = *a.scale;
    const auto* grad = static_cast<const __nv_bfloat16*>(c.grad);
    auto* weight = static_cast<__nv_bfloat16*>(c.weight);
    __nv_bfloat16 *m = exp_avg + c.offset, *v = exp_avg_sq + c.offset, *s = shift + c.offset;
    const int64_t n = c.numel;
    const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    // Element i of the chunk hashes as its bucket index, whatever path it takes.
    auto random = [&](int64_t i) { return mix64(key + kGolden * static_cast<uint64_t>(c.offset + i + 1)); };
    const bool packed =
        n % 8 == 0 && aligned16(grad) && aligned16(weight) && aligned16(m) && aligned16(v) && aligned16(s);
    if (packed) {
        for (int64_t j = first; j < n / 8; j += stride) {
            const Pack8 g8 = reinterpret_cast<const Pack8*>(grad)[j];
            Pack8 p8 = reinterpret_cast<Pack8*>(weight)[j], m8 = reinterpret_cast<Pack8*>(m)[j],
                  v8 = reinterpret_cast<Pack8*>(v)[j], s8 = reinterpret_cast<Pack8*>(s)[j];
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const Element e =
                    update(__bfloat162float(g8.v[k]), __bfloat162float(p8.v[k]), __bfloat162float(m8.v[k]),
                           __bfloat162float(v8.v[k]), __bfloat162float(s8.v[k]), random(8 * j + k), a, scale);
                m8.v[k] = e.m;
                v8.v[k] = e.v;
                s8.v[k] = e.shift;
                p8.v[k] = e.weight;
            }
            reinterpret_cast<Pack8*>(weight)[j] = p8;
            reinterpret_cast<Pack8*>(m)[j] = m8;
            reinterpret_cast<Pack8*>(v)[j] = v8;
            reinterpret_cast<Pack8*>(s)[j] = s8;
        }
        return;
    }
    for (int64_t i = first; i < n; i += stride) {
        const Element e =
            update(__bfloat162float(grad[i]), __bfloat162float(weight[i]), __bfloat162float(m[i]),
                   __bfloat162float(v[i]), __bfloat162float(s[i]), random(i), a, scale);
        m[i] = e.m;
        v[i] = e.v;
        s[i] = e.shift;
        weight[i] = e.weight;
    }
}

}  // namespace

int adamw_bf16_chunks_step(const AdamWBF16Chunks& batch, void* exp_avg, void* exp_avg_sq, void* shift,
                           const AdamWBF16Args& args, const PhiloxArgs& rng, void* stream) {
    if (batch.count <= 0) return 0;
    if (batch.count > kAdamWBF16MaxChunks) return static_cast<int>(cudaErrorInvalidValue);
    constexpr int kThreads = 256;
    // Enough blocks per chunk that a full batch fills the GPU (a chunk holds up to 2^20 elements:
    // 32 blocks of 256 threads cover it in 16 strides of 8-element packs).
    const dim3 grid(32, static_cast<unsigned>(batch.count));
    adamw_bf16_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        batch, static_cast<__nv_bfloat16*>(exp_avg), static_cast<__nv_bfloat16*>(exp_avg_sq),
        static_cast<__nv_bfloat16*>(shift), args, rng);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace dtune::train::cuda
