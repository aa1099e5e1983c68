// LoRA's adapter branch with input dropout, without the masked copy of the input: each kernel
// reads x (or writes dx) once and applies hash_dropout's mask (common/hash_dropout_math.h) to the
// elements in registers. The three products are thin (r is 4 to 64 against k of hundreds to
// thousands), so they are bound by the [n, k] pass, not by arithmetic: plain FMAs in float32, no
// tensor cores.
// - masked_down, masked_up_add: one warp takes R rows at once (R · r <= 64 accumulators per lane),
//   each lane a 16-byte pack of columns at a time; a is read through L1 (r · k elements, shared by
//   every warp), gh's rows are broadcast loads.
// - masked_down_grad: a block owns 128 columns and a range of rows; its warps split the ranks (16
//   each) and the rows, sum their rows through shared memory and write one partial per block; a
//   second kernel adds the partials in a fixed order, so the result is the same run to run.
#include <algorithm>
#include <cstdint>

#include "models/common/hash_dropout_math.h"
#include "models/cuda/kernel_utils.cuh"
#include "models/cuda/lora_dropout_kernels.h"

namespace dtune::models::cuda {
namespace {

namespace math = hash_dropout_math;

constexpr int kWarps = 8, kThreads = 32 * kWarps;

template <typename T, int V>
__device__ __forceinline__ void load_floats(const T* p, float (&v)[V]) {
    const Pack<T, V> pk = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = to_float(pk.v[i]);
}

// v[i] (element `first + i` of the flattened input) scaled by 1 / (1 - p) where the hash keeps it,
// else 0: hash_dropout's rule, one group hash per four consecutive indices.
template <int V>
__device__ __forceinline__ void apply_mask(float (&v)[V], uint64_t key, uint64_t first,
                                           const DropoutRule& rule) {
    uint64_t hash = math::group_hash(key, first / math::kLanes);
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const uint64_t index = first + i;
        if (i > 0 && index % math::kLanes == 0) hash = math::group_hash(key, index / math::kLanes);
        v[i] = math::keep_lane(hash, index, rule.threshold) ? v[i] * rule.scale : 0.0f;
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int d = 16; d > 0; d /= 2) v += __shfl_xor_sync(0xffffffffu, v, d);
    return v;
}

// h[row, j] = Σ_c mask(x)[row, c] · a[j, c] for j < r <= RM; R rows per warp.
template <typename T, int RM, int R>
__global__ void __launch_bounds__(kThreads)
    masked_down_kernel(const T* __restrict__ x, const T* __restrict__ a, T* __restrict__ h, int64_t ldh,
                       int64_t n, int64_t k, int r, DropoutRule rule) {
    constexpr int V = 16 / sizeof(T);
    const int lane = threadIdx.x % 32;
    const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * R;
    if (row0 >= n) return;  // the whole warp
    const uint64_t key = math::layer_key(static_cast<uint64_t>(*rule.seed), rule.salt);
    float acc[R][RM] = {};
    for (int64_t c = lane * V; c < k; c += 32 * V) {
        float xv[R][V];
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const int64_t row = row0 + i;
            if (row < n) {
                load_floats<T, V>(x + row * k + c, xv[i]);
                apply_mask<V>(xv[i], key, static_cast<uint64_t>(rule.index_offset + row * k + c), rule);
            } else {
#pragma unroll
                for (int e = 0; e < V; ++e) xv[i][e] = 0.0f;
            }
        }
#pragma unroll
        for (int j = 0; j < RM; ++j) {
            if (j >= r) break;
            float av[V];
            load_floats<T, V>(a + j * k + c, av);
#pragma unroll
            for (int i = 0; i < R; ++i)
#pragma unroll
                for (int e = 0; e < V; ++e) acc[i][j] = fmaf(xv[i][e], av[e], acc[i][j]);
        }
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
#pragma unroll
        for (int j = 0; j < RM; ++j) {
            if (j >= r) break;
            const float sum = warp_sum(acc[i][j]);
            if (row0 + i < n && lane == j % 32) h[(row0 + i) * ldh + j] = from_float<T>(sum);
        }
    }
}

// dx[row, c] += mask(Σ_j gh[row, j] · a[j, c]) for j < r <= RM; R rows per warp.
template <typename T, int RM, int R>
__global__ void __launch_bounds__(kThreads)
    masked_up_add_kernel(T* __restrict__ dx, const T* __restrict__ gh, int64_t ldg, const T* __restrict__ a,
                         int64_t n, int64_t k, int r, DropoutRule rule) {
    constexpr int V = 16 / sizeof(T);
    const int lane = threadIdx.x % 32;
    const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * R;
    if (row0 >= n) return;
    const uint64_t key = math::layer_key(static_cast<uint64_t>(*rule.seed), rule.salt);
    float g[R][RM];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < RM; ++j)
            g[i][j] = (row0 + i < n && j < r) ? to_float(gh[(row0 + i) * ldg + j]) : 0.0f;
    for (int64_t c = lane * V; c < k; c += 32 * V) {
        float out[R][V] = {};
#pragma unroll
        for (int j = 0; j < RM; ++j) {
            if (j >= r) break;
            float av[V];
            load_floats<T, V>(a + j * k + c, av);
#pragma unroll
            for (int i = 0; i < R; ++i)
#pragma unroll
                for (int e = 0; e < V; ++e) out[i][e] = fmaf(g[i][j], av[e], out[i][e]);
        }
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const int64_t row = row0 + i;
            if (row >= n) break;
            apply_mask<V>(out[i], key, static_cast<uint64_t>(rule.index_offset + row * k + c), rule);
            Pack<T, V>* p = reinterpret_cast<Pack<T, V>*>(dx + row * k + c);
            Pack<T, V> d = *p;
#pragma unroll
            for (int e = 0; e < V; ++e) d.v[e] = from_float<T>(to_float(d.v[e]) + out[i][e]);
            *p = d;
        }
    }
}

constexpr int kGradCols = 4;                // columns per lane
constexpr int kGradTile = 32 * kGradCols;   // columns per block
constexpr int kGradRanks = 16;              // ranks per warp
constexpr int64_t kGradRowsPerSplit = 128;  // rows per block, before capping the splits
constexpr int64_t kGradMaxSplits = 128;

// Rank groups of 16 per block: 1, 2 or 4 (so that they divide the 8 warps).
__host__ __device__ __forceinline__ int grad_groups(int r) {
    return r <= 16 ? 1 : (r <= 32 ? 2 : 4);
}

// partials[split, j, c] = Σ over the split's rows of gh[row, j] · mask(x)[row, c].
template <typename T>
__global__ void __launch_bounds__(kThreads)
    masked_down_grad_kernel(const T* __restrict__ gh, int64_t ldg, const T* __restrict__ x,
                            float* __restrict__ partials, int64_t n, int64_t k, int r, int64_t rows_per_split,
                            DropoutRule rule) {
    __shared__ float red[kWarps][kGradTile];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int groups = grad_groups(r), phases = kWarps / groups;
    const int group = warp % groups, phase = warp / groups, j0 = group * kGradRanks;
    const int64_t c = static_cast<int64_t>(blockIdx.x) * kGradTile + lane * kGradCols;
    const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_split;
    const int64_t end = begin + rows_per_split < n ? begin + rows_per_split : n;
    const uint64_t key = math::layer_key(static_cast<uint64_t>(*rule.seed), rule.salt);
    float acc[kGradRanks][kGradCols] = {};
    if (c < k) {  // k is a multiple of 8: a lane's four columns are all in range or all out
        for (int64_t row = begin + phase; row < end; row += phases) {
            float xv[kGradCols];
            load_floats<T, kGradCols>(x + row * k + c, xv);
            apply_mask<kGradCols>(xv, key, static_cast<uint64_t>(rule.index_offset + row * k + c), rule);
            const T* grow = gh + row * ldg + j0;
#pragma unroll
            for (int j = 0; j < kGradRanks; ++j) {
                if (j0 + j >= r) break;
                const float gv = to_float(grow[j]);
#pragma unroll
                for (int e = 0; e < kGradCols; ++e) acc[j][e] = fmaf(gv, xv[e], acc[j][e]);
            }
        }
    }
    // The phases' sums, one rank at a time through shared memory (a fixed order).
    float* out = partials + static_cast<int64_t>(blockIdx.y) * r * k;
#pragma unroll
    for (int j = 0; j < kGradRanks; ++j) {
#pragma unroll
        for (int e = 0; e < kGradCols; ++e) red[warp][lane * kGradCols + e] = acc[j][e];
        __syncthreads();
        for (int t = threadIdx.x; t < groups * kGradTile; t += kThreads) {
            const int gg = t / kGradTile, col = t % kGradTile, jj = gg * kGradRanks + j;
            const int64_t cc = static_cast<int64_t>(blockIdx.x) * kGradTile + col;
            if (jj < r && cc < k) {
                float s = 0.0f;
                for (int q = 0; q < phases; ++q) s += red[q * groups + gg][col];
                out[jj * k + cc] = s;
            }
        }
        __syncthreads();
    }
}

__global__ void sum_splits_kernel(const float* __restrict__ partials, float* __restrict__ out, int64_t count,
                                  int64_t splits) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        float s = 0.0f;
        for (int64_t q = 0; q < splits; ++q) s += partials[q * count + i];
        out[i] = s;
    }
}

int64_t rows_per_split(int64_t n) {
    const int64_t splits =
        std::clamp<int64_t>((n + kGradRowsPerSplit - 1) / kGradRowsPerSplit, 1, kGradMaxSplits);
    return std::max<int64_t>(1, (n + splits - 1) / splits);
}

unsigned row_blocks(int64_t n, int rows_per_warp) {
    return static_cast<unsigned>((n + kWarps * rows_per_warp - 1) / (kWarps * rows_per_warp));
}

template <typename T>
int launch_down(const void* x, const void* a, void* h, int64_t ldh, int64_t n, int64_t k, int64_t r,
                const DropoutRule& rule, cudaStream_t s) {
    const auto* xp = static_cast<const T*>(x);
    const auto* ap = static_cast<const T*>(a);
    auto* hp = static_cast<T*>(h);
    const int ri = static_cast<int>(r);
    if (r <= 16)
        masked_down_kernel<T, 16, 4><<<row_blocks(n, 4), kThreads, 0, s>>>(xp, ap, hp, ldh, n, k, ri, rule);
    else if (r <= 32)
        masked_down_kernel<T, 32, 2><<<row_blocks(n, 2), kThreads, 0, s>>>(xp, ap, hp, ldh, n, k, ri, rule);
    else
        masked_down_kernel<T, 64, 1><<<row_blocks(n, 1), kThreads, 0, s>>>(xp, ap, hp, ldh, n, k, ri, rule);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_up_add(void* dx, const void* gh, int64_t ldg, const void* a, int64_t n, int64_t k, int64_t r,
                  const DropoutRule& rule, cudaStream_t s) {
    auto* dp = static_cast<T*>(dx);
    const auto* gp = static_cast<const T*>(gh);
    const auto* ap = static_cast<const T*>(a);
    const int ri = static_cast<int>(r);
    if (r <= 16)
        masked_up_add_kernel<T, 16, 4><<<row_blocks(n, 4), kThreads, 0, s>>>(dp, gp, ldg, ap, n, k, ri, rule);
    else if (r <= 32)
        masked_up_add_kernel<T, 32, 2><<<row_blocks(n, 2), kThreads, 0, s>>>(dp, gp, ldg, ap, n, k, ri, rule);
    else
        masked_up_add_kernel<T, 64, 1><<<row_blocks(n, 1), kThreads, 0, s>>>(dp, gp, ldg, ap, n, k, ri, rule);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_down_grad(const void* gh, int64_t ldg, const void* x, float* partials, float* da, int64_t n,
                     int64_t k, int64_t r, const DropoutRule& rule, cudaStream_t s) {
    const int64_t per = rows_per_split(n), splits = (n + per - 1) / per;
    const dim3 grid(static_cast<unsigned>((k + kGradTile - 1) / kGradTile), static_cast<unsigned>(splits));
    masked_down_grad_kernel<T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(gh), ldg,
                                                         static_cast<const T*>(x), partials, n, k,
                                                         static_cast<int>(r), per, rule);
    const int err = static_cast<int>(cudaGetLastError());
    if (err != 0) return err;
    sum_splits_kernel<<<blocks_for(r * k, 256), 256, 0, s>>>(partials, da, r * k, splits);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

int lora_masked_down(const void* x, const void* a, void* h, int64_t ldh, int64_t n, int64_t k, int64_t r,
                     const DropoutRule& rule, KernelDtype dtype, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    switch (dtype) {
        case KernelDtype::kFloat: return launch_down<float>(x, a, h, ldh, n, k, r, rule, s);
        case KernelDtype::kBFloat16: return launch_down<__nv_bfloat16>(x, a, h, ldh, n, k, r, rule, s);
        case KernelDtype::kHalf: return launch_down<__half>(x, a, h, ldh, n, k, r, rule, s);
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

int64_t lora_masked_down_grad_splits(int64_t n) {
    const int64_t per = rows_per_split(n);
    return (n + per - 1) / per;
}

int lora_masked_down_grad(const void* gh, int64_t ldg, const void* x, float* partials, float* da, int64_t n,
                          int64_t k, int64_t r, const DropoutRule& rule, KernelDtype dtype, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    switch (dtype) {
        case KernelDtype::kFloat: return launch_down_grad<float>(gh, ldg, x, partials, da, n, k, r, rule, s);
        case KernelDtype::kBFloat16:
            return launch_down_grad<__nv_bfloat16>(gh, ldg, x, partials, da, n, k, r, rule, s);
        case KernelDtype::kHalf: return launch_down_grad<__half>(gh, ldg, x, partials, da, n, k, r, rule, s);
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

int lora_masked_up_add(void* dx, const void* gh, int64_t ldg, const void* a, int64_t n, int64_t k, int64_t r,
                       const DropoutRule& rule, KernelDtype dtype, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    switch (dtype) {
        case KernelDtype::kFloat: return launch_up_add<float>(dx, gh, ldg, a, n, k, r, rule, s);
        case KernelDtype::kBFloat16: return launch_up_add<__nv_bfloat16>(dx, gh, ldg, a, n, k, r, rule, s);
        case KernelDtype::kHalf: return launch_up_add<__half>(dx, gh, ldg, a, n, k, r, rule, s);
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace dtune::models::cuda
