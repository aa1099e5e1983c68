// Fused residual add + LayerNorm over contiguous rows (transformer blocks: h = attention(...) + x,
// then the next norm). One warp per row, the row held in registers in its storage type (P packs of
// 16 bytes per lane), the weight and bias read as 16-byte loads in their own dtype:
//   forward:  h = a + b rounded to the storage type (the value the unfused add would store), mean
//             and variance of h in float by two passes over the registers, y = (h - mean) * rstd
//             * weight + bias rounded once; writes h, y and (mean, rstd);
//   backward: g = dy * weight, x_hat = (h - mean) * rstd, dh = dh_in + rstd * (g - mean(g) -
//             x_hat * mean(g * x_hat)); the affine gradients' sums of dy * x_hat and dy, per block
//             (its warps added in a fixed order in shared memory: the same bits every run).
// Against ATen's add then layer_norm: the add's output is not read back, and the backward's
// gradient sum (the residual's and the norm's) is not a separate pass.
#include <cstdint>

#include "models/cuda/kernel_utils.cuh"
#include "models/cuda/layer_norm_kernels.h"

namespace dtune::models::cuda {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32, kMaxPacksPerLane = 8;
// Blocks per SM the register budget must allow (128 registers a thread at 2): a row's loads are
// one round trip, so it is the warps in flight that hide memory latency.
constexpr int kMinBlocks = 2;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Elements [ch, ch + V) of a weight or bias: float32, or T (the data's dtype), as 16-byte loads;
// p null: `none`.
template <typename T, int V>
__device__ __forceinline__ void load_param(const void* p, bool is_float, int64_t ch, float none,
                                           float (&out)[V]) {
    if (p == nullptr) {
#pragma unroll
        for (int k = 0; k < V; ++k) out[k] = none;
    } else if (is_float) {
        const float* f = static_cast<const float*>(p) + ch;
#pragma unroll
        for (int k = 0; k < V; k += 4) {
            const float4 q = *reinterpret_cast<const float4*>(f + k);
            out[k] = q.x;
            out[k + 1] = q.y;
            out[k + 2] = q.z;
            out[k + 3] = q.w;
        }
    } else {
        const Pack<T, V> q = *reinterpret_cast<const Pack<T, V>*>(static_cast<const T*>(p) + ch);
#pragma unroll
        for (int k = 0; k < V; ++k) out[k] = to_float(q.v[k]);
    }
}

// One warp per row: the row's packs (h = a + b rounded, or a) stay in registers in the storage
// type; mean, then the variance about it, from them; then y. All of a row's loads are issued
// before any arithmetic.
template <typename T, int V, int P>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    add_ln_forward_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ h,
                          T* __restrict__ y, const void* __restrict__ weight, const void* __restrict__ bias,
                          bool params_float, float2* __restrict__ mean_rstd, int64_t rows, int c, float eps) {
    const int lane = threadIdx.x & 31, packs = c / V;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
    for (int64_t r = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; r < rows; r += warps) {
        const int64_t base = r * c;
        Pack<T, V> v[P], w[P];
#pragma unroll
        for (int j = 0; j < P; ++j) {
            const int p = lane + 32 * j;
            if (p >= packs) continue;
            v[j] = *reinterpret_cast<const Pack<T, V>*>(a + base + p * V);
            if (b) w[j] = *reinterpret_cast<const Pack<T, V>*>(b + base + p * V);
        }
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < P; ++j) {
            const int p = lane + 32 * j;
            if (p >= packs) continue;
            if (b) {
#pragma unroll
                for (int k = 0; k < V; ++k)
                    v[j].v[k] = from_float<T>(to_float(v[j].v[k]) + to_float(w[j].v[k]));
                *reinterpret_cast<Pack<T, V>*>(h + base + p * V) = v[j];
            }
#pragma unroll
            for (int k = 0; k < V; ++k) sum += to_float(v[j].v[k]);
        }
        const float mean = warp_sum(sum) / static_cast<float>(c);
        float sq = 0.f;
#pragma unroll
        for (int j = 0; j < P; ++j) {
            if (lane + 32 * j >= packs) continue;
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const float d = to_float(v[j].v[k]) - mean;
                sq += d * d;
            }
        }
        const float rstd = rsqrtf(warp_sum(sq) / static_cast<float>(c) + eps);
        if (lane == 0) mean_rstd[r] = make_float2(mean, rstd);
#pragma unroll
        for (int j = 0; j < P; ++j) {
            const int p = lane + 32 * j;
            if (p >= packs) continue;
            float wt[V], bs[V];
            load_param<T, V>(weight, params_float, static_cast<int64_t>(p) * V, 1.f, wt);
            load_param<T, V>(bias, params_float, static_cast<int64_t>(p) * V, 0.f, bs);
            Pack<T, V> o;
#pragma unroll
            for (int k = 0; k < V; ++k)
                o.v[k] = from_float<T>((to_float(v[j].v[k]) - mean) * rstd * wt[k] + bs[k]);
            *reinterpret_cast<Pack<T, V>*>(y + base + p * V) = o;
        }
    }
}

// One warp per row (a block's warps take rows in turn with the affine sums). dy's and h's packs
// (and dh_in's) are loaded first and kept in the storage type; the products are formed from them
// in each of the two passes.
template <typename T, int V, int P, bool kAffine>
__global__ void __launch_bounds__(kThreads, kAffine ? 1 : kMinBlocks)
    add_ln_backward_kernel(const T* __restrict__ dy, const T* dh_in, const T* __restrict__ h,
                           const float2* __restrict__ mean_rstd, const void* __restrict__ weight,
                           bool params_float, T* dh, float* __restrict__ dweight_part,
                           float* __restrict__ dbias_part, int64_t rows, int c) {
    extern __shared__ float block_sums[];  // kAffine: [2, c]
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, packs = c / V;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
    float dw[kAffine ? P : 1][V], db[kAffine ? P : 1][V];
    if constexpr (kAffine) {
#pragma unroll
        for (int j = 0; j < P; ++j)
#pragma unroll
            for (int k = 0; k < V; ++k) dw[j][k] = db[j][k] = 0.f;
    }
    for (int64_t r = blockIdx.x * static_cast<int64_t>(kWarps) + warp; r < rows; r += warps) {
        const int64_t base = r * c;
        Pack<T, V> pd[P], ph[P], pin[P];
#pragma unroll
        for (int j = 0; j < P; ++j) {
            const int p = lane + 32 * j;
            if (p >= packs) continue;
            pd[j] = *reinterpret_cast<const Pack<T, V>*>(dy + base + p * V);
            ph[j] = *reinterpret_cast<const Pack<T, V>*>(h + base + p * V);
            if (dh_in) pin[j] = *reinterpret_cast<const Pack<T, V>*>(dh_in + base + p * V);
        }
        const float2 mr = mean_rstd[r];
        float s1 = 0.f, s2 = 0.f;
#pragma unroll
        for (int j = 0; j < P; ++j) {
            const int p = lane + 32 * j;
            if (p >= packs) continue;
            float wt[V];
            load_param<T, V>(weight, params_float, static_cast<int64_t>(p) * V, 1.f, wt);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const float d = to_float(pd[j].v[k]);
                const float xh = (to_float(ph[j].v[k]) - mr.x) * mr.y;
                const float g = d * wt[k];
                s1 += g;
                s2 += g * xh;
                if constexpr (kAffine) {
                    dw[j][k] += d * xh;
                    db[j][k] += d;
                }
            }
        }
        const float m1 = warp_sum(s1) / static_cast<float>(c), m2 = warp_sum(s2) / static_cast<float>(c);
#pragma unroll
        for (int j = 0; j < P; ++j) {
            const int p = lane + 32 * j;
            if (p >= packs) continue;
            float wt[V];
            load_param<T, V>(weight, params_float, static_cast<int64_t>(p) * V, 1.f, wt);
            Pack<T, V> o;
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const float xh = (to_float(ph[j].v[k]) - mr.x) * mr.y;
                float d = mr.y * (to_float(pd[j].v[k]) * wt[k] - m1 - xh * m2);
                if (dh_in) d += to_float(pin[j].v[k]);
                o.v[k] = from_float<T>(d);
            }
            *reinterpret_cast<Pack<T, V>*>(dh + base + p * V) = o;
        }
    }
    if constexpr (kAffine) {
        // The block's sums: its warps add their columns into shared memory one after another.
        for (int i = threadIdx.x; i < 2 * c; i += blockDim.x) block_sums[i] = 0.f;
        __syncthreads();
        for (int w = 0; w < kWarps; ++w) {
            if (warp == w) {
#pragma unroll
                for (int j = 0; j < P; ++j) {
                    const int p = lane + 32 * j;
                    if (p >= packs) continue;
#pragma unroll
                    for (int k = 0; k < V; ++k) {
                        block_sums[p * V + k] += dw[j][k];
                        block_sums[c + p * V + k] += db[j][k];
                    }
                }
            }
            __syncthreads();
        }
        for (int i = threadIdx.x; i < c; i += blockDim.x) {
            dweight_part[static_cast<int64_t>(blockIdx.x) * c + i] = block_sums[i];
            dbias_part[static_cast<int64_t>(blockIdx.x) * c + i] = block_sums[c + i];
        }
    }
}

int grid_for(int64_t rows, int sm_count) {
    const int64_t want = (rows + kWarps - 1) / kWarps;
    return static_cast<int>(std::clamp<int64_t>(want, 1, 2 * static_cast<int64_t>(std::max(sm_count, 1))));
}

template <typename T, int V, int P>
void launch_forward(const AddLayerNormArgs& a, cudaStream_t s) {
    add_ln_forward_kernel<T, V, P><<<grid_for(a.rows, 4 * a.sm_count), kThreads, 0, s>>>(
        static_cast<const T*>(a.a), static_cast<const T*>(a.b), static_cast<T*>(a.h), static_cast<T*>(a.y),
        a.weight, a.bias, a.params_float, reinterpret_cast<float2*>(a.mean_rstd), a.rows,
        static_cast<int>(a.c), static_cast<float>(a.eps));
}

template <typename T, int V, int P>
void launch_backward(const AddLayerNormBackwardArgs& a, cudaStream_t s) {
    // With the affine sums, one partial row per block (add_layer_norm_parts); without, more blocks.
    const int grid = grid_for(a.rows, a.dweight_part ? a.sm_count : 4 * a.sm_count);
    const auto* mr = reinterpret_cast<const float2*>(a.mean_rstd);
    const int c = static_cast<int>(a.c);
    if (a.dweight_part)
        add_ln_backward_kernel<T, V, P, true><<<grid, kThreads, 2 * a.c * sizeof(float), s>>>(
            static_cast<const T*>(a.dy), static_cast<const T*>(a.dh_in), static_cast<const T*>(a.h), mr,
            a.weight, a.params_float, static_cast<T*>(a.dh), a.dweight_part, a.dbias_part, a.rows, c);
    else
        add_ln_backward_kernel<T, V, P, false><<<grid, kThreads, 0, s>>>(
            static_cast<const T*>(a.dy), static_cast<const T*>(a.dh_in), static_cast<const T*>(a.h), mr,
            a.weight, a.params_float, static_cast<T*>(a.dh), nullptr, nullptr, a.rows, c);
}

// Calls launch<T, V, P>(args, stream) with P = the packs per lane that c needs.
template <typename T, typename Args, template <typename, int, int> class Launch>
int dispatch(const Args& args, cudaStream_t s) {
    constexpr int kVec = 16 / sizeof(T);
    const int64_t per_lane = (args.c / kVec + 31) / 32;
    switch (per_lane) {
        case 1: Launch<T, kVec, 1>::run(args, s); break;
        case 2: Launch<T, kVec, 2>::run(args, s); break;
        case 3: Launch<T, kVec, 3>::run(args, s); break;
        case 4: Launch<T, kVec, 4>::run(args, s); break;
        case 5: Launch<T, kVec, 5>::run(args, s); break;
        case 6: Launch<T, kVec, 6>::run(args, s); break;
        case 7: Launch<T, kVec, 7>::run(args, s); break;
        case 8: Launch<T, kVec, 8>::run(args, s); break;
        default: return static_cast<int>(cudaErrorInvalidValue);
    }
    return static_cast<int>(cudaGetLastError());
}

template <typename T, int V, int P>
struct Forward {
    static void run(const AddLayerNormArgs& a, cudaStream_t s) { launch_forward<T, V, P>(a, s); }
};
template <typename T, int V, int P>
struct Backward {
    static void run(const AddLayerNormBackwardArgs& a, cudaStream_t s) { launch_backward<T, V, P>(a, s); }
};

}  // namespace

bool add_layer_norm_supported(int64_t c, KernelDtype dtype) {
    const int64_t vec = dtype == KernelDtype::kFloat ? 4 : 8;
    return c > 0 && c % vec == 0 && c / vec <= 32 * kMaxPacksPerLane;
}

int64_t add_layer_norm_parts(int64_t rows, int sm_count) {
    return grid_for(rows, sm_count);
}

int add_layer_norm(const AddLayerNormArgs& args, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    switch (args.dtype) {
        case KernelDtype::kFloat: return dispatch<float, AddLayerNormArgs, Forward>(args, s);
        case KernelDtype::kBFloat16: return dispatch<__nv_bfloat16, AddLayerNormArgs, Forward>(args, s);
        case KernelDtype::kHalf: return dispatch<__half, AddLayerNormArgs, Forward>(args, s);
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

int add_layer_norm_backward(const AddLayerNormBackwardArgs& args, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    switch (args.dtype) {
        case KernelDtype::kFloat: return dispatch<float, AddLayerNormBackwardArgs, Backward>(args, s);
        case KernelDtype::kBFloat16:
            return dispatch<__nv_bfloat16, AddLayerNormBackwardArgs, Backward>(args, s);
        case KernelDtype::kHalf: return dispatch<__half, AddLayerNormBackwardArgs, Backward>(args, s);
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace dtune::models::cuda
