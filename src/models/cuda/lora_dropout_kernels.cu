// LoRA's adapter branch with input dropout, without the masked copy of the input: each kernel
// reads x (or writes dx) once and applies hash_dropout's mask (common/hash_dropout_math.h) to the
// elements on their way into the product. The three products are thin (r is 4 to 64 against k of
// hundreds to thousands), so they are bound by the [n, k] pass.
// - 16-bit types (bf16, fp16) on sm_80 and later: tensor cores (WMMA). The masked input is rounded
//   to the storage type in shared memory, as the masked copy was, and multiplied there, so the
//   products differ from the copy-then-cuBLAS path by summation order only.
//   - tc_masked_down: a block owns 16 or 32 rows; its four warps take alternate 64-column chunks
//     and their sums meet in shared memory in a fixed order.
//   - tc_masked_up_add: a block owns 64 rows of dx and a run of 64-column chunks, the next chunk's
//     a tiles in flight (cp.async) while this one's gh · a goes through shared memory, where the
//     mask is applied on the way to the read-modify-write of dx. A group of adapters that read the
//     same input (fused q/k/v) adds its masked products in one read-modify-write.
//   - tc_masked_down_grad: a block owns 64 columns and a range of rows (a multiple of 64); one
//     partial per block, summed in a fixed order by a second kernel (the same bits run to run).
// - float32 (and 16-bit types before sm_80): plain FMAs on CUDA cores.
//   - masked_down, masked_up_add: one warp takes R rows at once (R · r <= 64 accumulators per lane),
//     each lane a 16-byte pack of columns at a time; a is read through L1 (r · k elements, shared by
//     every warp), gh's rows are broadcast loads.
//   - masked_down_grad: a block owns 128 columns and a range of rows; its warps split the ranks (16
//     each) and the rows, sum their rows through shared memory and write one partial per block; a
//     second kernel adds the partials in a fixed order, so the result is the same run to run.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>

#include <cuda_pipeline.h>
#include <mma.h>

#include "models/common/hash_dropout_math.h"
#include "models/cuda/hash_dropout_mask.cuh"
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
// else 0: hash_dropout's rule (hash_dropout_mask.cuh).
template <int V>
__device__ __forceinline__ void apply_mask(float (&v)[V], uint64_t key, uint64_t first,
                                           const DropoutRule& rule) {
    (void)hash_mask<V>(v, key, first, rule.threshold, rule.scale);
}

// The same for a pack of 8 at flat position `at` (row · k + c) of the tensor-core kernels, hashed;
// the decisions are written where the rule asks (rule.keep_out).
__device__ __forceinline__ void mask_pack(float (&v)[8], uint64_t key, int64_t at, const DropoutRule& rule) {
    const uint32_t kept =
        hash_mask<8>(v, key, static_cast<uint64_t>(rule.index_offset + at), rule.threshold, rule.scale);
    if (rule.keep_out != nullptr) rule.keep_out[at / 8] = static_cast<uint8_t>(kept);
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

// ---- Tensor-core variants for 16-bit types (sm_80 and later) ----

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define DTUNE_TC_LORA 1
#endif

namespace wmma = nvcuda::wmma;
constexpr int kTcWarps = 4, kTcThreads = 32 * kTcWarps;
constexpr int kChunk = 64;             // columns of x, a or dx per tile
constexpr int kPitch = kChunk + 8;     // shared row pitch of 16-bit tiles (the pad spreads the banks)
constexpr int kOutPitch = kChunk + 4;  // shared row pitch of float tiles
constexpr int kPacks = kChunk / 8;     // 16-byte packs per tile row
constexpr int kUpAddBlocks = 4;        // tc_masked_up_add's blocks an SM (its launch bounds)
using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

__device__ __forceinline__ void zero_pack(void* dst) {
    *static_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
}

// Row `row`, columns [c, c + 8) of a row-major [rows, k] matrix into `dst` (shared), zeros out of range.
template <typename T>
__device__ __forceinline__ void copy_pack(const T* src, int64_t rows, int64_t k, int64_t row, int64_t c,
                                          T* dst) {
    if (row < rows && c < k)
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src + row * k + c);
    else
        zero_pack(dst);
}

// Rows [row0, row0 + BM) (those below `rows`) of gh's columns [col0, col0 + r) into a shared
// [BM][RP + 8] tile, zeros elsewhere: 16-byte loads where `packed` (r and ldg multiples of 8, gh
// and col0 aligned to them), else one element at a time.
template <typename T, int BM, int RP>
__device__ __forceinline__ void load_gh_tile(const T* __restrict__ gh, int64_t ldg, int64_t rows,
                                             int64_t row0, int64_t col0, int r, bool packed, T* tile) {
    constexpr int kGp = RP + 8, kRowPacks = RP / 8;
    if (packed) {
        for (int e = threadIdx.x; e < BM * kRowPacks; e += kTcThreads) {
            const int i = e / kRowPacks, j = (e % kRowPacks) * 8;
            if (row0 + i < rows && j < r)
                *reinterpret_cast<uint4*>(tile + i * kGp + j) =
                    *reinterpret_cast<const uint4*>(gh + (row0 + i) * ldg + col0 + j);
            else
                zero_pack(tile + i * kGp + j);
        }
        return;
    }
    for (int e = threadIdx.x; e < BM * RP; e += kTcThreads) {
        const int i = e / RP, j = e % RP;
        tile[i * kGp + j] =
            (row0 + i < rows && j < r) ? gh[(row0 + i) * ldg + col0 + j] : from_float<T>(0.0f);
    }
}

// Whether gh (row stride ldg, adapters of rank r side by side) takes load_gh_tile's 16-byte loads.
__device__ __forceinline__ bool gh_packed(const void* gh, int64_t ldg, int r) {
    return r % 8 == 0 && ldg % 8 == 0 && reinterpret_cast<uintptr_t>(gh) % 16 == 0;
}

// Q packs of x (row-major [n, k]) through the mask into shared tiles: all loads first, then the
// mask and the stores, so a lane has Q loads in flight. Pack q is tile row p / kPacks, pack
// p % kPacks, p = first + q · stride. kKept: the decisions come from rule.keep_in (set), else they
// are hashed (a separate instance: the forward kernel's loop stays free of the bytes' registers).
template <typename T, int Q, bool kKept>
__device__ __forceinline__ void masked_tile(const T* __restrict__ x, int64_t n, int64_t k, int64_t row0,
                                            int64_t c0, int first, int stride, T* tile, uint64_t key,
                                            const DropoutRule& rule) {
    Pack<T, 8> v[Q];
    uint8_t kept[Q];
#pragma unroll
    for (int q = 0; q < Q; ++q) {
        const int p = first + q * stride;
        const int64_t row = row0 + p / kPacks, c = c0 + (p % kPacks) * 8;
        kept[q] = 0;
        if (row < n && c < k) {
            v[q] = *reinterpret_cast<const Pack<T, 8>*>(x + row * k + c);
            if constexpr (kKept) kept[q] = rule.keep_in[(row * k + c) / 8];
        } else {
            *reinterpret_cast<uint4*>(&v[q]) = make_uint4(0, 0, 0, 0);
        }
    }
#pragma unroll
    for (int q = 0; q < Q; ++q) {
        const int p = first + q * stride;
        const int64_t row = row0 + p / kPacks, c = c0 + (p % kPacks) * 8;
        T* dst = tile + (p / kPacks) * kPitch + (p % kPacks) * 8;
        if (row < n && c < k) {
            float f[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) f[e] = to_float(v[q].v[e]);
            if constexpr (kKept)
                bits_mask<8>(f, kept[q], rule.scale);
            else
                mask_pack(f, key, row * k + c, rule);
#pragma unroll
            for (int e = 0; e < 8; ++e) v[q].v[e] = from_float<T>(f[e]);
        }
        *reinterpret_cast<Pack<T, 8>*>(dst) = v[q];
    }
}

// h[row, j] = Σ_c round(mask(x))[row, c] · a[j, c]: RT fragments of 16 ranks, MF of 16 rows per warp,
// W warps per block taking alternate column chunks.
template <typename T, int RT, int MF, int W>
__global__ void __launch_bounds__(32 * W, 16 / W)  // 16 warps per SM: at most 128 registers
    tc_masked_down_kernel(const T* __restrict__ x, const T* __restrict__ a, T* __restrict__ h, int64_t ldh,
                          int64_t n, int64_t k, int r, DropoutRule rule) {
#ifdef DTUNE_TC_LORA
    constexpr int RP = 16 * RT, BM = 16 * MF, kXs = BM * kPitch, kAs = RP * kPitch;
    __shared__ __align__(128) unsigned char smem[W * (kXs + kAs) * sizeof(T)];
    static_assert(W * BM * RP * sizeof(float) <= sizeof(smem), "the sums fit the tiles' space");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    T* xs = reinterpret_cast<T*>(smem) + warp * (kXs + kAs);
    T* as = xs + kXs;
    const int64_t row0 = static_cast<int64_t>(blockIdx.x) * BM;
    const uint64_t key = math::layer_key(static_cast<uint64_t>(*rule.seed), rule.salt);
    Acc acc[MF][RT];
#pragma unroll
    for (int m = 0; m < MF; ++m)
#pragma unroll
        for (int t = 0; t < RT; ++t) wmma::fill_fragment(acc[m][t], 0.0f);
    for (int64_t c0 = static_cast<int64_t>(warp) * kChunk; c0 < k; c0 += W * kChunk) {
        masked_tile<T, BM * kPacks / 32, false>(x, n, k, row0, c0, lane, 32, xs, key, rule);
#pragma unroll
        for (int q = 0; q < RP * kPacks / 32; ++q) {
            const int p = lane + 32 * q;
            copy_pack(a, r, k, p / kPacks, c0 + (p % kPacks) * 8,
                      as + (p / kPacks) * kPitch + (p % kPacks) * 8);
        }
        __syncwarp();
#pragma unroll
        for (int kk = 0; kk < kChunk / 16; ++kk) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> xf[MF];
#pragma unroll
            for (int m = 0; m < MF; ++m)
                wmma::load_matrix_sync(xf[m], xs + m * 16 * kPitch + kk * 16, kPitch);
#pragma unroll
            for (int t = 0; t < RT; ++t) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> af;  // aᵀ
                wmma::load_matrix_sync(af, as + t * 16 * kPitch + kk * 16, kPitch);
#pragma unroll
                for (int m = 0; m < MF; ++m) wmma::mma_sync(acc[m][t], xf[m], af, acc[m][t]);
            }
        }
        __syncwarp();
    }
    __syncthreads();
    float* sums = reinterpret_cast<float*>(smem);  // [warp][BM][RP]
#pragma unroll
    for (int m = 0; m < MF; ++m)
#pragma unroll
        for (int t = 0; t < RT; ++t)
            wmma::store_matrix_sync(sums + (warp * BM + m * 16) * RP + t * 16, acc[m][t], RP,
                                    wmma::mem_row_major);
    __syncthreads();
    for (int e = threadIdx.x; e < BM * RP; e += (32 * W)) {
        const int i = e / RP, j = e % RP;
        const int64_t row = row0 + i;
        if (j >= r || row >= n) continue;
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) s += sums[(w * BM + i) * RP + j];
        h[row * ldh + j] = from_float<T>(s);
    }
#else
    __trap();
#endif
}

// dx[row, c] += Σ_g mask_g(Σ_j gh[row, g·r + j] · a[g·r + j, c]) for the group's G adapters (one
// for a single layer), rounded once: a block owns 64 rows (16 per warp) and a run of `chunks`
// 64-column chunks (enough runs to fill the SMs once). The gh tiles are loaded once; chunk by chunk,
// the next chunk's a tiles are in flight (cp.async, double-buffered where two fit: G · RT <= 3)
// while this chunk's products are formed, and this chunk's dx packs, read back last, load meanwhile. Per
// adapter each warp forms its 16 x 64 product, which goes through the warp's shared tile, where the adapter's
// mask is applied on the way into the float sums. At most 128 registers (kUpAddBlocks blocks an SM).
template <typename T, int RT, int G>
__global__ void __launch_bounds__(kTcThreads, kUpAddBlocks)
    tc_masked_up_add_kernel(T* __restrict__ dx, const T* __restrict__ gh, int64_t ldg,
                            const T* __restrict__ a, int64_t n, int64_t k, int r, int chunks,
                            const __grid_constant__ DropoutRules rules) {
#ifdef DTUNE_TC_LORA
    constexpr int RP = 16 * RT, BM = 16 * kTcWarps, kGp = RP + 8, NB = G * RT <= 3 ? 2 : 1;
    const bool packed = gh_packed(gh, ldg, r);
    __shared__ __align__(128) T gs[G][BM * kGp];
    __shared__ __align__(128) T as[NB][G][RP * kPitch];
    __shared__ __align__(128) float os[kTcWarps * 16 * kOutPitch];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t row0 = static_cast<int64_t>(blockIdx.x) * BM,
                  first = static_cast<int64_t>(blockIdx.y) * chunks * kChunk,
                  end = first + static_cast<int64_t>(chunks) * kChunk, last = end < k ? end : k;
    constexpr int kOwn = 16 * kPacks / 32;
    // The group's a tiles of the chunk at c0 into buffer b, without registers (zeros out of range).
    auto load_a = [&](int64_t c0, int b) {
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int q = 0; q < RP * kPacks / kTcThreads + 1; ++q) {
                const int p = threadIdx.x + kTcThreads * q, row = p / kPacks;
                const int64_t c = c0 + (p % kPacks) * 8;
                if (p >= RP * kPacks) continue;
                T* dst = as[b][g] + row * kPitch + (p % kPacks) * 8;
                if (row < r && c < k)
                    __pipeline_memcpy_async(dst, a + (static_cast<int64_t>(g) * r + row) * k + c, 16);
                else
                    zero_pack(dst);
            }
        __pipeline_commit();
    };
    static_assert(kOwn <= 4, "a lane's kept bytes of one adapter fit one word");
    // This lane's packs of dx at c0 and every adapter's kept decisions for them (byte q of kept[g]).
    auto load_d = [&](int64_t c0, Pack<T, 8>(&d)[kOwn], uint32_t(&kept)[G]) {
#pragma unroll
        for (int g = 0; g < G; ++g) kept[g] = 0;
#pragma unroll
        for (int q = 0; q < kOwn; ++q) {
            const int p = lane + 32 * q;
            const int64_t row = row0 + warp * 16 + p / kPacks, c = c0 + (p % kPacks) * 8;
            if (row >= n || c >= k) continue;
            d[q] = *reinterpret_cast<const Pack<T, 8>*>(dx + row * k + c);
#pragma unroll
            for (int g = 0; g < G; ++g)
                if (rules.rule[g].keep_in != nullptr)
                    kept[g] |= static_cast<uint32_t>(rules.rule[g].keep_in[(row * k + c) / 8]) << (8 * q);
        }
    };
#pragma unroll
    for (int g = 0; g < G; ++g) load_gh_tile<T, BM, RP>(gh, ldg, n, row0, g * r, r, packed, gs[g]);
    if constexpr (NB == 2) load_a(first, 0);
    float* o = os + warp * 16 * kOutPitch;
    int b = 0;
    for (int64_t c0 = first; c0 < last; c0 += kChunk) {
        const int64_t c1 = c0 + kChunk;
        const bool more = c1 < last;
        if constexpr (NB == 1) {
            __syncthreads();  // every warp is done with the previous chunk's tiles
            load_a(c0, 0);
        }
        __pipeline_wait_prior(0);  // this thread's copies of this chunk's tiles have landed
        __syncthreads();           // everyone's, and the previous chunk's buffer is free
        if constexpr (NB == 2)
            if (more) load_a(c1, b ^ 1);
        // dx is read back only after the products: its loads have the whole chunk to land.
        Pack<T, 8> d[kOwn];
        uint32_t kept[G];
        load_d(c0, d, kept);
        float sum[kOwn][8];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const DropoutRule& rule = rules.rule[g];
            Acc acc[kChunk / 16];
#pragma unroll
            for (int f = 0; f < kChunk / 16; ++f) wmma::fill_fragment(acc[f], 0.0f);
#pragma unroll
            for (int t = 0; t < RT; ++t) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> gf;
                wmma::load_matrix_sync(gf, gs[g] + warp * 16 * kGp + t * 16, kGp);
#pragma unroll
                for (int f = 0; f < kChunk / 16; ++f) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> af;
                    wmma::load_matrix_sync(af, as[b][g] + t * 16 * kPitch + f * 16, kPitch);
                    wmma::mma_sync(acc[f], gf, af, acc[f]);
                }
            }
            __syncwarp();  // the lanes have read the previous product from o
#pragma unroll
            for (int f = 0; f < kChunk / 16; ++f)
                wmma::store_matrix_sync(o + f * 16, acc[f], kOutPitch, wmma::mem_row_major);
            __syncwarp();
            const uint64_t key = math::layer_key(static_cast<uint64_t>(*rule.seed), rule.salt);
#pragma unroll
            for (int q = 0; q < kOwn; ++q) {
                const int p = lane + 32 * q, i = p / kPacks, cp = (p % kPacks) * 8;
                const int64_t row = row0 + warp * 16 + i, c = c0 + cp;
                if (row >= n || c >= k) continue;
                float v[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) v[e] = o[i * kOutPitch + cp + e];
                if (rule.keep_in != nullptr)
                    bits_mask<8>(v, (kept[g] >> (8 * q)) & 0xffu, rule.scale);
                else
                    mask_pack(v, key, row * k + c, rule);
#pragma unroll
                for (int e = 0; e < 8; ++e) sum[q][e] = g == 0 ? v[e] : sum[q][e] + v[e];
                if (g == G - 1) {  // the last adapter's pass writes: each sum leaves registers at once
#pragma unroll
                    for (int e = 0; e < 8; ++e) d[q].v[e] = from_float<T>(to_float(d[q].v[e]) + sum[q][e]);
                    *reinterpret_cast<Pack<T, 8>*>(dx + row * k + c) = d[q];
                }
            }
        }
        b = (b + 1) % NB;
    }
#else
    __trap();
#endif
}

// partials[split, j, c] = Σ over the split's rows of gh[row, j] · round(mask(x))[row, c]: a block
// owns 64 columns (16 per warp) and rows [begin, end), 64 at a time.
template <typename T, int RT>
__global__ void __launch_bounds__(kTcThreads)
    tc_masked_down_grad_kernel(const T* __restrict__ gh, int64_t ldg, const T* __restrict__ x,
                               float* __restrict__ partials, int64_t n, int64_t k, int r,
                               int64_t rows_per_split, DropoutRule rule) {
#ifdef DTUNE_TC_LORA
    constexpr int RP = 16 * RT, BM = 64, kGp = RP + 8;
    const bool packed = gh_packed(gh, ldg, r);
    __shared__ __align__(128) T xs[BM * kPitch];
    __shared__ __align__(128) T gs[BM * kGp];
    __shared__ __align__(128) float os[RP * kOutPitch];
    const int warp = threadIdx.x / 32;
    const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kChunk;
    const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_split;
    const int64_t end = begin + rows_per_split < n ? begin + rows_per_split : n;
    const uint64_t key = math::layer_key(static_cast<uint64_t>(*rule.seed), rule.salt);
    Acc acc[RT];
#pragma unroll
    for (int t = 0; t < RT; ++t) wmma::fill_fragment(acc[t], 0.0f);
    for (int64_t row0 = begin; row0 < end; row0 += BM) {
        if (rule.keep_in != nullptr)
            masked_tile<T, BM * kPacks / kTcThreads, true>(x, end, k, row0, c0, threadIdx.x, kTcThreads, xs,
                                                           key, rule);
        else
            masked_tile<T, BM * kPacks / kTcThreads, false>(x, end, k, row0, c0, threadIdx.x, kTcThreads, xs,
                                                            key, rule);
        load_gh_tile<T, BM, RP>(gh, ldg, end, row0, 0, r, packed, gs);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> xf;
            wmma::load_matrix_sync(xf, xs + kk * 16 * kPitch + warp * 16, kPitch);
#pragma unroll
            for (int t = 0; t < RT; ++t) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> gf;  // ghᵀ
                wmma::load_matrix_sync(gf, gs + kk * 16 * kGp + t * 16, kGp);
                wmma::mma_sync(acc[t], gf, xf, acc[t]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int t = 0; t < RT; ++t)
        wmma::store_matrix_sync(os + t * 16 * kOutPitch + warp * 16, acc[t], kOutPitch, wmma::mem_row_major);
    __syncthreads();
    float* out = partials + static_cast<int64_t>(blockIdx.y) * r * k;
    for (int e = threadIdx.x; e < r * kChunk; e += kTcThreads) {
        const int j = e / kChunk, col = e % kChunk;
        if (c0 + col < k) out[j * k + c0 + col] = os[j * kOutPitch + col];
    }
#else
    __trap();
#endif
}

// The same for a group of G adapters that read the same x (fused q/k/v), each with its own mask,
// given as the forward's kept decisions (rule.keep_in, required: no hashing here), gh as
// load_gh_tile's 16-byte loads take it (required):
// partials[split, g·r + j, c] = Σ over the split's rows of gh[row, g·r + j] · round(mask_g(x))[row, c].
// Each 64-row tile of x is read once; every adapter's masked copy of it goes to its own shared tile.
// The float tiles of the sums reuse the input tiles' space at the end.
template <typename T, int RT, int G>
__global__ void __launch_bounds__(kTcThreads, 4)  // at most 128 registers
    tc_masked_down_grad_group_kernel(const T* __restrict__ gh, int64_t ldg, const T* __restrict__ x,
                                     float* __restrict__ partials, int64_t n, int64_t k, int r,
                                     int64_t rows_per_split, DropoutRules rules) {
#ifdef DTUNE_TC_LORA
    constexpr int RP = 16 * RT, BM = 64, kGp = RP + 8, Q = BM * kPacks / kTcThreads;
    constexpr int kXs = BM * kPitch, kGs = BM * kGp;
    constexpr size_t kIn = G * (kXs + kGs) * sizeof(T), kOut = G * RP * kOutPitch * sizeof(float);
    __shared__ __align__(128) unsigned char smem[kIn > kOut ? kIn : kOut];
    T* xs = reinterpret_cast<T*>(smem);  // [G][BM][kPitch]
    T* gs = xs + G * kXs;                // [G][BM][kGp]
    const int warp = threadIdx.x / 32;
    const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kChunk;
    const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_split;
    const int64_t end = begin + rows_per_split < n ? begin + rows_per_split : n;
    Acc acc[G][RT];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int t = 0; t < RT; ++t) wmma::fill_fragment(acc[g][t], 0.0f);
    for (int64_t row0 = begin; row0 < end; row0 += BM) {
        // This thread's packs of the tile, and every adapter's kept decisions for them, all in flight.
        Pack<T, 8> v[Q];
        uint8_t kept[G][Q];
#pragma unroll
        for (int q = 0; q < Q; ++q) {
            const int p = threadIdx.x + q * kTcThreads;
            const int64_t row = row0 + p / kPacks, c = c0 + (p % kPacks) * 8;
            if (row < end && c < k) {
                v[q] = *reinterpret_cast<const Pack<T, 8>*>(x + row * k + c);
#pragma unroll
                for (int g = 0; g < G; ++g) kept[g][q] = rules.rule[g].keep_in[(row * k + c) / 8];
            } else {
                *reinterpret_cast<uint4*>(&v[q]) = make_uint4(0, 0, 0, 0);
#pragma unroll
                for (int g = 0; g < G; ++g) kept[g][q] = 0;
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            load_gh_tile<T, BM, RP>(gh, ldg, end, row0, g * r, r, /*packed=*/true, gs + g * kGs);
#pragma unroll
            for (int q = 0; q < Q; ++q) {
                const int p = threadIdx.x + q * kTcThreads;
                const int64_t row = row0 + p / kPacks, c = c0 + (p % kPacks) * 8;
                Pack<T, 8> m = v[q];
                if (row < end && c < k) {
                    float f[8];
#pragma unroll
                    for (int e = 0; e < 8; ++e) f[e] = to_float(v[q].v[e]);
                    bits_mask<8>(f, kept[g][q], rules.rule[g].scale);
#pragma unroll
                    for (int e = 0; e < 8; ++e) m.v[e] = from_float<T>(f[e]);
                }
                *reinterpret_cast<Pack<T, 8>*>(xs + g * kXs + (p / kPacks) * kPitch + (p % kPacks) * 8) = m;
            }
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
            for (int g = 0; g < G; ++g) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> xf;
                wmma::load_matrix_sync(xf, xs + g * kXs + kk * 16 * kPitch + warp * 16, kPitch);
#pragma unroll
                for (int t = 0; t < RT; ++t) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> gf;  // ghᵀ
                    wmma::load_matrix_sync(gf, gs + g * kGs + kk * 16 * kGp + t * 16, kGp);
                    wmma::mma_sync(acc[g][t], gf, xf, acc[g][t]);
                }
            }
        __syncthreads();
    }
    float* os = reinterpret_cast<float*>(smem);  // [G·RP][kOutPitch], over the input tiles
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int t = 0; t < RT; ++t)
            wmma::store_matrix_sync(os + (g * RP + t * 16) * kOutPitch + warp * 16, acc[g][t], kOutPitch,
                                    wmma::mem_row_major);
    __syncthreads();
    float* out = partials + static_cast<int64_t>(blockIdx.y) * G * r * k;
    for (int e = threadIdx.x; e < G * r * kChunk; e += kTcThreads) {
        const int gj = e / kChunk, col = e % kChunk, g = gj / r, j = gj % r;
        if (c0 + col < k) out[gj * k + c0 + col] = os[(g * RP + j) * kOutPitch + col];
    }
#else
    __trap();
#endif
}

// Rows per split of tc_masked_down_grad: a multiple of 64, about kTcGradBlocks blocks in all.
constexpr int64_t kTcGradBlocks = 512;
int64_t tc_rows_per_split(int64_t n, int64_t k) {
    const int64_t tiles = (n + 63) / 64, col_tiles = (k + kChunk - 1) / kChunk;
    const int64_t splits = std::clamp<int64_t>((kTcGradBlocks + col_tiles - 1) / col_tiles, 1, tiles);
    return 64 * ((tiles + splits - 1) / splits);
}

// A device's compute capability major and SM count, read once per device (every adapter layer's
// launch asks): {0, 1} where they cannot be read.
struct DeviceShape {
    int major = 0;
    int64_t sms = 1;
};
DeviceShape device_shape(int device) {
    constexpr int kDevices = 64;
    static std::array<std::atomic<int>, kDevices> majors{}, sms{};  // 0: not read yet
    if (device < 0 || device >= kDevices) return {};
    if (majors[device].load(std::memory_order_acquire) == 0) {
        int major = 0, count = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
            cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
            return {};
        sms[device].store(count > 0 ? count : 1, std::memory_order_relaxed);
        majors[device].store(major, std::memory_order_release);  // after sms: a reader seeing it sees both
    }
    const int major = majors[device].load(std::memory_order_acquire);
    return {major, sms[device].load(std::memory_order_relaxed)};
}

DeviceShape current_device_shape() {
    int device = 0;
    return cudaGetDevice(&device) == cudaSuccess ? device_shape(device) : DeviceShape{};
}

// Whether the current device runs the tensor-core kernels (compute capability 8.0 or later).
bool tensor_cores() {
    return current_device_shape().major >= 8;
}

// The current device's SM count (132 on an H100 SXM or H200).
int64_t sm_count() {
    return current_device_shape().sms;
}

template <typename T>
constexpr bool kSixteenBit = sizeof(T) == 2;

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
    if constexpr (kSixteenBit<T>) {
        if (tensor_cores()) {
            auto grid = [&](int mf) { return static_cast<unsigned>((n + 16 * mf - 1) / (16 * mf)); };
            // Blocks of 32 rows while they give each SM three; below that (4096 rows of an SDXL
            // 1280-channel layer at batch 4: one block per SM) blocks of 16 rows, eight warps each,
            // so that each warp walks fewer chunks (rank 16 only: more ranks overflow shared memory).
            if (r <= 16 && static_cast<int64_t>(grid(2)) < 3 * sm_count())
                tc_masked_down_kernel<T, 1, 1, 8><<<grid(1), 256, 0, s>>>(xp, ap, hp, ldh, n, k, ri, rule);
            else if (r <= 16)
                tc_masked_down_kernel<T, 1, 2, 4><<<grid(2), 128, 0, s>>>(xp, ap, hp, ldh, n, k, ri, rule);
            else if (r <= 32)
                tc_masked_down_kernel<T, 2, 2, 4><<<grid(2), 128, 0, s>>>(xp, ap, hp, ldh, n, k, ri, rule);
            else if (r <= 48)
                tc_masked_down_kernel<T, 3, 1, 4><<<grid(1), 128, 0, s>>>(xp, ap, hp, ldh, n, k, ri, rule);
            else
                tc_masked_down_kernel<T, 4, 1, 4><<<grid(1), 128, 0, s>>>(xp, ap, hp, ldh, n, k, ri, rule);
            return static_cast<int>(cudaGetLastError());
        }
    }
    if (r <= 16)
        masked_down_kernel<T, 16, 4><<<row_blocks(n, 4), kThreads, 0, s>>>(xp, ap, hp, ldh, n, k, ri, rule);
    else if (r <= 32)
        masked_down_kernel<T, 32, 2><<<row_blocks(n, 2), kThreads, 0, s>>>(xp, ap, hp, ldh, n, k, ri, rule);
    else
        masked_down_kernel<T, 64, 1><<<row_blocks(n, 1), kThreads, 0, s>>>(xp, ap, hp, ldh, n, k, ri, rule);
    return static_cast<int>(cudaGetLastError());
}

// The tensor-core up-add of a group of G adapters with RT rank tiles each: one launch where the
// group's tiles fit static shared memory (G · RT <= 6), else one launch per adapter.
template <typename T, int RT, int G>
void launch_tc_up_add(T* dp, const T* gp, int64_t ldg, const T* ap, int64_t n, int64_t k, int64_t r,
                      const DropoutRules& rules, cudaStream_t s) {
    const int64_t row_blocks = (n + 63) / 64, chunks = (k + kChunk - 1) / kChunk;
    const int ri = static_cast<int>(r);
    // Runs of chunks long enough that the blocks fill the SMs about once (the launch bounds' blocks
    // an SM): each block then loads its gh tiles once and keeps its next chunk's loads in flight.
    auto launch = [&](auto kernel, T* d, const T* g, const T* a, const DropoutRules& rs) {
        const int64_t slots = std::max<int64_t>(1, kUpAddBlocks * sm_count());
        const int64_t run = std::clamp<int64_t>((row_blocks * chunks + slots - 1) / slots, 1, chunks);
        const dim3 grid(static_cast<unsigned>(row_blocks), static_cast<unsigned>((chunks + run - 1) / run));
        kernel<<<grid, kTcThreads, 0, s>>>(d, g, ldg, a, n, k, ri, static_cast<int>(run), rs);
    };
    if constexpr (G == 1 || G * RT <= 6) {
        launch(tc_masked_up_add_kernel<T, RT, G>, dp, gp, ap, rules);
    } else {
        for (int g = 0; g < G; ++g) {
            DropoutRules one;
            one.rule[0] = rules.rule[g];
            one.count = 1;
            launch(tc_masked_up_add_kernel<T, RT, 1>, dp, gp + g * r, ap + g * r * k, one);
        }
    }
}

template <typename T, int G>
void launch_tc_up_add(T* dp, const T* gp, int64_t ldg, const T* ap, int64_t n, int64_t k, int64_t r,
                      const DropoutRules& rules, cudaStream_t s) {
    if (r <= 16)
        launch_tc_up_add<T, 1, G>(dp, gp, ldg, ap, n, k, r, rules, s);
    else if (r <= 32)
        launch_tc_up_add<T, 2, G>(dp, gp, ldg, ap, n, k, r, rules, s);
    else if (r <= 48)
        launch_tc_up_add<T, 3, G>(dp, gp, ldg, ap, n, k, r, rules, s);
    else
        launch_tc_up_add<T, 4, G>(dp, gp, ldg, ap, n, k, r, rules, s);
}

template <typename T>
int launch_tc_up_add(T* dp, const T* gp, int64_t ldg, const T* ap, int64_t n, int64_t k, int64_t r,
                     const DropoutRules& rules, cudaStream_t s) {
    switch (rules.count) {
        case 1: launch_tc_up_add<T, 1>(dp, gp, ldg, ap, n, k, r, rules, s); break;
        case 2: launch_tc_up_add<T, 2>(dp, gp, ldg, ap, n, k, r, rules, s); break;
        case 3: launch_tc_up_add<T, 3>(dp, gp, ldg, ap, n, k, r, rules, s); break;
        default: return static_cast<int>(cudaErrorInvalidValue);
    }
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_up_add(void* dx, const void* gh, int64_t ldg, const void* a, int64_t n, int64_t k, int64_t r,
                  const DropoutRule& rule, cudaStream_t s) {
    auto* dp = static_cast<T*>(dx);
    const auto* gp = static_cast<const T*>(gh);
    const auto* ap = static_cast<const T*>(a);
    const int ri = static_cast<int>(r);
    if constexpr (kSixteenBit<T>) {
        if (tensor_cores()) {
            DropoutRules one;
            one.rule[0] = rule;
            one.count = 1;
            return launch_tc_up_add<T>(dp, gp, ldg, ap, n, k, r, one, s);
        }
    }
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
    if constexpr (kSixteenBit<T>) {
        if (tensor_cores()) {
            const int64_t per = tc_rows_per_split(n, k), splits = (n + per - 1) / per;
            const dim3 grid(static_cast<unsigned>((k + kChunk - 1) / kChunk), static_cast<unsigned>(splits));
            const auto* gp = static_cast<const T*>(gh);
            const auto* xp = static_cast<const T*>(x);
            const int ri = static_cast<int>(r);
            if (r <= 16)
                tc_masked_down_grad_kernel<T, 1>
                    <<<grid, kTcThreads, 0, s>>>(gp, ldg, xp, partials, n, k, ri, per, rule);
            else if (r <= 32)
                tc_masked_down_grad_kernel<T, 2>
                    <<<grid, kTcThreads, 0, s>>>(gp, ldg, xp, partials, n, k, ri, per, rule);
            else if (r <= 48)
                tc_masked_down_grad_kernel<T, 3>
                    <<<grid, kTcThreads, 0, s>>>(gp, ldg, xp, partials, n, k, ri, per, rule);
            else
                tc_masked_down_grad_kernel<T, 4>
                    <<<grid, kTcThreads, 0, s>>>(gp, ldg, xp, partials, n, k, ri, per, rule);
            const int err = static_cast<int>(cudaGetLastError());
            if (err != 0) return err;
            sum_splits_kernel<<<blocks_for(r * k, 256), 256, 0, s>>>(partials, da, r * k, splits);
            return static_cast<int>(cudaGetLastError());
        }
    }
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

// The group's factor gradients: one kernel over x for G adapters (G · RT <= 6: the tiles fit static
// shared memory; every rule has its kept decisions; gh's rows in 16-byte packs), then one sum of the
// splits for all of them; else adapter by adapter.
template <typename T, int RT, int G>
int launch_tc_down_grad_group(const T* gp, int64_t ldg, const T* xp, float* partials, float* da, int64_t n,
                              int64_t k, int64_t r, const DropoutRules& rules, cudaStream_t s) {
    const int64_t per = tc_rows_per_split(n, k), splits = (n + per - 1) / per;
    const dim3 grid(static_cast<unsigned>((k + kChunk - 1) / kChunk), static_cast<unsigned>(splits));
    const int ri = static_cast<int>(r);
    bool kept = r % 8 == 0 && ldg % 8 == 0 && reinterpret_cast<uintptr_t>(gp) % 16 == 0;  // gh_packed
    for (int g = 0; g < G; ++g) kept = kept && rules.rule[g].keep_in != nullptr;
    if constexpr (G * RT <= 6) {
        if (kept) {
            tc_masked_down_grad_group_kernel<T, RT, G>
                <<<grid, kTcThreads, 0, s>>>(gp, ldg, xp, partials, n, k, ri, per, rules);
            const int err = static_cast<int>(cudaGetLastError());
            if (err != 0) return err;
            sum_splits_kernel<<<blocks_for(G * r * k, 256), 256, 0, s>>>(partials, da, G * r * k, splits);
            return static_cast<int>(cudaGetLastError());
        }
    }
    for (int g = 0; g < G; ++g) {
        const int err =
            launch_down_grad<T>(gp + g * r, ldg, xp, partials, da + g * r * k, n, k, r, rules.rule[g], s);
        if (err != 0) return err;
    }
    return 0;
}

template <typename T, int G>
int launch_tc_down_grad_group(const T* gp, int64_t ldg, const T* xp, float* partials, float* da, int64_t n,
                              int64_t k, int64_t r, const DropoutRules& rules, cudaStream_t s) {
    if (r <= 16) return launch_tc_down_grad_group<T, 1, G>(gp, ldg, xp, partials, da, n, k, r, rules, s);
    if (r <= 32) return launch_tc_down_grad_group<T, 2, G>(gp, ldg, xp, partials, da, n, k, r, rules, s);
    if (r <= 48) return launch_tc_down_grad_group<T, 3, G>(gp, ldg, xp, partials, da, n, k, r, rules, s);
    return launch_tc_down_grad_group<T, 4, G>(gp, ldg, xp, partials, da, n, k, r, rules, s);
}

template <typename T>
int launch_tc_down_grad_group(const T* gp, int64_t ldg, const T* xp, float* partials, float* da, int64_t n,
                              int64_t k, int64_t r, const DropoutRules& rules, cudaStream_t s) {
    switch (rules.count) {
        case 1: return launch_down_grad<T>(gp, ldg, xp, partials, da, n, k, r, rules.rule[0], s);
        case 2: return launch_tc_down_grad_group<T, 2>(gp, ldg, xp, partials, da, n, k, r, rules, s);
        case 3: return launch_tc_down_grad_group<T, 3>(gp, ldg, xp, partials, da, n, k, r, rules, s);
        default: return static_cast<int>(cudaErrorInvalidValue);
    }
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

bool lora_dropout_tensor_cores(KernelDtype dtype, int device) {
    return dtype != KernelDtype::kFloat && device_shape(device).major >= 8;
}

int64_t lora_masked_down_grad_splits(int64_t n, int64_t k, KernelDtype dtype) {
    const int64_t per =
        dtype != KernelDtype::kFloat && tensor_cores() ? tc_rows_per_split(n, k) : rows_per_split(n);
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

int lora_masked_down_grad_group(const void* gh, int64_t ldg, const void* x, float* partials, float* da,
                                int64_t n, int64_t k, int64_t r, const DropoutRules& rules, KernelDtype dtype,
                                void* stream) {
    if (rules.count < 1 || rules.count > kLoRAMaxGroup || !tensor_cores())
        return static_cast<int>(cudaErrorInvalidValue);
    auto s = static_cast<cudaStream_t>(stream);
    switch (dtype) {
        case KernelDtype::kBFloat16:
            return launch_tc_down_grad_group(static_cast<const __nv_bfloat16*>(gh), ldg,
                                             static_cast<const __nv_bfloat16*>(x), partials, da, n, k, r,
                                             rules, s);
        case KernelDtype::kHalf:
            return launch_tc_down_grad_group(static_cast<const __half*>(gh), ldg,
                                             static_cast<const __half*>(x), partials, da, n, k, r, rules, s);
        case KernelDtype::kFloat: break;
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

int lora_masked_up_add_group(void* dx, const void* gh, int64_t ldg, const void* a, int64_t n, int64_t k,
                             int64_t r, const DropoutRules& rules, KernelDtype dtype, void* stream) {
    if (rules.count < 1 || rules.count > kLoRAMaxGroup || !tensor_cores())
        return static_cast<int>(cudaErrorInvalidValue);
    auto s = static_cast<cudaStream_t>(stream);
    switch (dtype) {
        case KernelDtype::kBFloat16:
            return launch_tc_up_add(static_cast<__nv_bfloat16*>(dx), static_cast<const __nv_bfloat16*>(gh),
                                    ldg, static_cast<const __nv_bfloat16*>(a), n, k, r, rules, s);
        case KernelDtype::kHalf:
            return launch_tc_up_add(static_cast<__half*>(dx), static_cast<const __half*>(gh), ldg,
                                    static_cast<const __half*>(a), n, k, r, rules, s);
        case KernelDtype::kFloat: break;
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace dtune::models::cuda
