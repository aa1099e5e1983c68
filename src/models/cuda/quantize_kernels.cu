// Dequantisation of int8/fp8 weights, per-row fp8 quantisation of activations and the byte
// transpose of fp8 weights for the input-gradient GEMM (see quantize_kernels.h). All are
// memory-bound single passes.
#include <cuda_fp8.h>

#include <cstdint>

#include "models/cuda/kernel_utils.cuh"
#include "models/cuda/quantize_kernels.h"

namespace dtune::models::cuda {
namespace {

constexpr float kE4M3Max = 448.0f;

__device__ __forceinline__ float stored_to_float(int8_t v) {
    return static_cast<float>(v);
}
__device__ __forceinline__ float stored_to_float(__nv_fp8_e4m3 v) {
    return static_cast<float>(v);
}

__device__ __forceinline__ float stored_to_float(uint8_t bits, int8_t*) {
    return static_cast<float>(static_cast<int8_t>(bits));
}
__device__ __forceinline__ float stored_to_float(uint8_t bits, __nv_fp8_e4m3*) {
    __nv_fp8_e4m3 v;
    v.__x = bits;
    return static_cast<float>(v);
}

// grid: (column blocks, rows). Vectorised: each thread turns 8 stored bytes (one 8-byte load) into
// 8 outputs (16 or 32 bytes of stores) where a row is a multiple of 8 elements; else one at a time.
template <typename Q, typename T, bool kVec>
__global__ void dequantize_rows_kernel(const Q* __restrict__ q, const float* __restrict__ scale, int64_t cols,
                                       T* __restrict__ out) {
    const int64_t row = blockIdx.y;
    const float s = scale[row];
    const Q* src = q + row * cols;
    T* dst = out + row * cols;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    if constexpr (kVec) {
        const int64_t packs = cols / 8;
        for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < packs;
             p += stride) {
            const uint2 raw = reinterpret_cast<const uint2*>(src)[p];
            Pack<T, 8> o;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const uint32_t word = k < 4 ? raw.x : raw.y;
                const auto bits = static_cast<uint8_t>((word >> (8 * (k % 4))) & 0xffu);
                o.v[k] = from_float<T>(stored_to_float(bits, static_cast<Q*>(nullptr)) * s);
            }
            reinterpret_cast<Pack<T, 8>*>(dst)[p] = o;
        }
    } else {
        for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < cols; c += stride)
            dst[c] = from_float<T>(stored_to_float(src[c]) * s);
    }
}

template <typename Q, typename T>
int launch_dequantize(const void* q, const float* scale, int64_t rows, int64_t cols, void* out,
                      cudaStream_t s) {
    constexpr int kThreads = 256;
    const bool vec = cols % 8 == 0 && aligned16(out) && reinterpret_cast<uintptr_t>(q) % 8 == 0;
    const int64_t work = vec ? cols / 8 : cols;
    const int64_t col_blocks = std::min<int64_t>((work + kThreads - 1) / kThreads, 1024);
    const dim3 grid(static_cast<unsigned>(std::max<int64_t>(col_blocks, 1)), static_cast<unsigned>(rows));
    if (vec) {
        dequantize_rows_kernel<Q, T, true>
            <<<grid, kThreads, 0, s>>>(static_cast<const Q*>(q), scale, cols, static_cast<T*>(out));
    } else {
        dequantize_rows_kernel<Q, T, false>
            <<<grid, kThreads, 0, s>>>(static_cast<const Q*>(q), scale, cols, static_cast<T*>(out));
    }
    return static_cast<int>(cudaGetLastError());
}

template <typename Q>
int dequantize_to(const void* q, const float* scale, int64_t rows, int64_t cols, void* out, KernelDtype dt,
                  cudaStream_t s) {
    switch (dt) {
        case KernelDtype::kFloat: return launch_dequantize<Q, float>(q, scale, rows, cols, out, s);
        case KernelDtype::kBFloat16: return launch_dequantize<Q, __nv_bfloat16>(q, scale, rows, cols, out, s);
        case KernelDtype::kHalf: return launch_dequantize<Q, __half>(q, scale, rows, cols, out, s);
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

// The row's values as the kernel quantises them: x · col_scale (when given), V at a time.
template <typename T, int V>
__device__ __forceinline__ void load_scaled(const T* src, const float* col_scale, int64_t c, float (&v)[V]) {
    if constexpr (V == 8) {
        const Pack<T, 8> p = *reinterpret_cast<const Pack<T, 8>*>(src + c);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = to_float(p.v[k]);
        if (col_scale) {
            const float4 a = *reinterpret_cast<const float4*>(col_scale + c);
            const float4 b = *reinterpret_cast<const float4*>(col_scale + c + 4);
            v[0] *= a.x, v[1] *= a.y, v[2] *= a.z, v[3] *= a.w, v[4] *= b.x, v[5] *= b.y, v[6] *= b.z,
                v[7] *= b.w;
        }
    } else {
        v[0] = to_float(src[c]) * (col_scale ? col_scale[c] : 1.0f);
    }
}

// One block per row: a max-reduction over |x · col_scale|, then the scaled conversion (the row is
// re-read, mostly from L1/L2). V = 8 moves 16-byte packs (rows a multiple of 8, aligned).
template <typename T, int V>
__global__ void quantize_rows_fp8_kernel(const T* __restrict__ x, const float* __restrict__ col_scale,
                                         int64_t cols, __nv_fp8_e4m3* __restrict__ q,
                                         float* __restrict__ scale) {
    __shared__ float partial[32];
    const int64_t row = blockIdx.x;
    const T* src = x + row * cols;
    float amax = 0.0f;
    for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < cols;
         c += static_cast<int64_t>(blockDim.x) * V) {
        float v[V];
        load_scaled<T, V>(src, col_scale, c, v);
#pragma unroll
        for (int k = 0; k < V; ++k) amax = fmaxf(amax, fabsf(v[k]));
    }
    for (int offset = 16; offset > 0; offset /= 2)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) partial[warp] = amax;
    __syncthreads();
    if (warp == 0) {
        amax = lane < static_cast<int>(blockDim.x / 32) ? partial[lane] : 0.0f;
        for (int offset = 16; offset > 0; offset /= 2)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        if (lane == 0) partial[0] = amax;
    }
    __syncthreads();
    amax = partial[0];
    const float s = amax > 0.0f ? amax / kE4M3Max : 1.0f;
    if (threadIdx.x == 0) scale[row] = s;
    const float inv = 1.0f / s;
    __nv_fp8_e4m3* dst = q + row * cols;
    for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < cols;
         c += static_cast<int64_t>(blockDim.x) * V) {
        float v[V];
        load_scaled<T, V>(src, col_scale, c, v);
        if constexpr (V == 8) {
            uint32_t words[2] = {0u, 0u};
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const __nv_fp8_e4m3 e(fminf(fmaxf(v[k] * inv, -kE4M3Max), kE4M3Max));
                words[k / 4] |= static_cast<uint32_t>(e.__x) << (8 * (k % 4));
            }
            *reinterpret_cast<uint2*>(dst + c) = make_uint2(words[0], words[1]);
        } else {
            dst[c] = __nv_fp8_e4m3(fminf(fmaxf(v[0] * inv, -kE4M3Max), kE4M3Max));
        }
    }
}

template <typename T>
int launch_quantize_fp8(const void* x, const float* col_scale, int64_t rows, int64_t cols, void* q,
                        float* scale, cudaStream_t s) {
    constexpr int kThreads = 256;
    const bool vec = cols % 8 == 0 && aligned16(x) && reinterpret_cast<uintptr_t>(q) % 8 == 0 &&
                     (col_scale == nullptr || aligned16(col_scale));
    const auto* in = static_cast<const T*>(x);
    auto* out = static_cast<__nv_fp8_e4m3*>(q);
    if (vec) {
        quantize_rows_fp8_kernel<T, 8>
            <<<static_cast<unsigned>(rows), kThreads, 0, s>>>(in, col_scale, cols, out, scale);
    } else {
        quantize_rows_fp8_kernel<T, 1>
            <<<static_cast<unsigned>(rows), kThreads, 0, s>>>(in, col_scale, cols, out, scale);
    }
    return static_cast<int>(cudaGetLastError());
}

// One warp per output column n (8 per block): each lane walks k in 16-element steps, one 16-byte
// load of q and 16 of x's values per row, float sums reduced across the warp.
constexpr int kGemvMaxRows = 8;

template <typename T>
__device__ __forceinline__ void load16(const T* p, float (&v)[16]) {
    if constexpr (sizeof(T) == 2) {
        const Pack<T, 8> a = reinterpret_cast<const Pack<T, 8>*>(p)[0],
                         b = reinterpret_cast<const Pack<T, 8>*>(p)[1];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = to_float(a.v[i]), v[8 + i] = to_float(b.v[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float4 f = reinterpret_cast<const float4*>(p)[i];
            v[4 * i] = f.x, v[4 * i + 1] = f.y, v[4 * i + 2] = f.z, v[4 * i + 3] = f.w;
        }
    }
}

template <typename Q, typename T>
__global__ void quantized_gemv_kernel(const T* __restrict__ x, int m, int64_t k, const Q* __restrict__ q,
                                      const float* __restrict__ scale, const T* __restrict__ bias, int64_t n,
                                      T* __restrict__ y) {
    const int lane = static_cast<int>(threadIdx.x % 32);
    const int64_t col = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    if (col >= n) return;
    const auto* row = reinterpret_cast<const uint8_t*>(q + col * k);
    float acc[kGemvMaxRows] = {};
#pragma unroll 2
    for (int64_t c = static_cast<int64_t>(lane) * 16; c < k; c += 32 * 16) {
        const uint4 raw = *reinterpret_cast<const uint4*>(row + c);
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
        float w[16];
#pragma unroll
        for (int i = 0; i < 16; ++i)
            w[i] = stored_to_float(static_cast<uint8_t>((words[i / 4] >> (8 * (i % 4))) & 0xffu),
                                   static_cast<Q*>(nullptr));
#pragma unroll
        for (int r = 0; r < kGemvMaxRows; ++r) {
            if (r >= m) break;
            float v[16];
            load16(x + r * k + c, v);
#pragma unroll
            for (int i = 0; i < 16; ++i) acc[r] = fmaf(v[i], w[i], acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < kGemvMaxRows; ++r) {
        if (r >= m) break;
        float a = acc[r];
        for (int offset = 16; offset > 0; offset /= 2) a += __shfl_xor_sync(0xffffffffu, a, offset);
        if (lane == 0) y[r * n + col] = from_float<T>(a * scale[col] + (bias ? to_float(bias[col]) : 0.0f));
    }
}

// One 64 × 64 byte tile per block of 256 threads. Loads: thread t reads 16 bytes of input row t / 4
// (segment t % 4) into shared rows padded to 17 words, so that the stores' column reads (16 input
// rows at one byte column) fall on distinct banks. Stores: thread t writes 16 bytes of output row
// t % 64 (segment t / 64), gathered from 16 shared rows.
constexpr int kTile = 64;
constexpr int kTileWords = kTile / 4 + 1;

__global__ void transpose_bytes_kernel(const uint8_t* __restrict__ in, int64_t rows, int64_t cols,
                                       uint8_t* __restrict__ out) {
    __shared__ uint32_t tile[kTile][kTileWords];
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile,
                  c0 = static_cast<int64_t>(blockIdx.x) * kTile;
    const int t = static_cast<int>(threadIdx.x);
    {
        const int r = t / 4, seg = t % 4;
        const int64_t row = r0 + r, col = c0 + seg * 16;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (row < rows && col < cols) v = *reinterpret_cast<const uint4*>(in + row * cols + col);
        tile[r][seg * 4 + 0] = v.x;
        tile[r][seg * 4 + 1] = v.y;
        tile[r][seg * 4 + 2] = v.z;
        tile[r][seg * 4 + 3] = v.w;
    }
    __syncthreads();
    const int oc = t % kTile, seg = t / kTile;
    const int64_t orow = c0 + oc, ocol = r0 + seg * 16;
    if (orow >= cols || ocol >= rows) return;
    uint32_t words[4] = {0u, 0u, 0u, 0u};
    const int word = oc / 4, shift = 8 * (oc % 4);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const uint32_t b = (tile[seg * 16 + i][word] >> shift) & 0xffu;
        words[i / 4] |= b << (8 * (i % 4));
    }
    *reinterpret_cast<uint4*>(out + orow * rows + ocol) = make_uint4(words[0], words[1], words[2], words[3]);
}

}  // namespace

int dequantize_rows(const void* q, QuantStorage storage, const float* scale, int64_t rows, int64_t cols,
                    void* out, KernelDtype out_dtype, void* stream) {
    if (rows == 0 || cols == 0) return 0;
    if (rows > 65535) return static_cast<int>(cudaErrorInvalidValue);
    auto s = static_cast<cudaStream_t>(stream);
    if (storage == QuantStorage::kInt8) return dequantize_to<int8_t>(q, scale, rows, cols, out, out_dtype, s);
    return dequantize_to<__nv_fp8_e4m3>(q, scale, rows, cols, out, out_dtype, s);
}

int quantize_rows_fp8(const void* x, KernelDtype x_dtype, const float* col_scale, int64_t rows, int64_t cols,
                      void* q, float* scale, void* stream) {
    if (rows == 0) return 0;
    if (rows > 2147483647LL) return static_cast<int>(cudaErrorInvalidValue);
    auto s = static_cast<cudaStream_t>(stream);
    switch (x_dtype) {
        case KernelDtype::kFloat: return launch_quantize_fp8<float>(x, col_scale, rows, cols, q, scale, s);
        case KernelDtype::kBFloat16:
            return launch_quantize_fp8<__nv_bfloat16>(x, col_scale, rows, cols, q, scale, s);
        case KernelDtype::kHalf: return launch_quantize_fp8<__half>(x, col_scale, rows, cols, q, scale, s);
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

int transpose_bytes(const void* in, int64_t rows, int64_t cols, void* out, void* stream) {
    if (rows == 0 || cols == 0) return 0;
    if (rows % 16 != 0 || cols % 16 != 0 || !aligned16(in) || !aligned16(out) ||
        (rows + kTile - 1) / kTile > 65535)
        return static_cast<int>(cudaErrorInvalidValue);
    const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile),
                    static_cast<unsigned>((rows + kTile - 1) / kTile));
    transpose_bytes_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const uint8_t*>(in), rows, cols, static_cast<uint8_t*>(out));
    return static_cast<int>(cudaGetLastError());
}

int quantized_gemv(const void* x, int64_t m, int64_t k, const void* q, QuantStorage storage,
                   const float* scale, const void* bias, int64_t n, void* y, KernelDtype dtype,
                   void* stream) {
    if (m == 0 || n == 0) return 0;
    if (m > kGemvMaxRows || k % 16 != 0 || !aligned16(x) || !aligned16(q))
        return static_cast<int>(cudaErrorInvalidValue);
    constexpr int kWarps = 8;
    const dim3 grid(static_cast<unsigned>((n + kWarps - 1) / kWarps));
    auto s = static_cast<cudaStream_t>(stream);
    return with_kernel_type(dtype, [&](auto value) {
        using T = decltype(value);
        const auto* xt = static_cast<const T*>(x);
        const auto* bt = static_cast<const T*>(bias);
        auto* yt = static_cast<T*>(y);
        const int mi = static_cast<int>(m);
        if (storage == QuantStorage::kInt8)
            quantized_gemv_kernel<int8_t, T>
                <<<grid, 32 * kWarps, 0, s>>>(xt, mi, k, static_cast<const int8_t*>(q), scale, bt, n, yt);
        else
            quantized_gemv_kernel<__nv_fp8_e4m3, T><<<grid, 32 * kWarps, 0, s>>>(
                xt, mi, k, static_cast<const __nv_fp8_e4m3*>(q), scale, bt, n, yt);
        return static_cast<int>(cudaGetLastError());
    });
}

}  // namespace dtune::models::cuda
