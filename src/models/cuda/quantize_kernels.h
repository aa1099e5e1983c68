// Launchers of the quantisation kernels (cuda/quantize_kernels.cu), callable from code built
// without nvcc (see common/quantize.h for the formats). Built only with DTUNE_WITH_CUDA_KERNELS.
// Each returns the launch's cudaError_t as an int (0 = success).
#pragma once

#include <cstdint>

#include "models/cuda/kernel_dtype.h"

namespace dtune::models::cuda {

enum class QuantStorage { kInt8, kFloat8E4M3 };

// out[r, c] = float(q[r, c]) · scale[r], rounded once to `out_dtype`. `q` and `out` hold `rows`
// blocks of `cols` consecutive elements (dim 0 outermost: contiguous or channels-last weights).
int dequantize_rows(const void* q, QuantStorage storage, const float* scale, int64_t rows, int64_t cols,
                    void* out, KernelDtype out_dtype, void* stream);

// Per-row e4m3 quantisation of a row-major [rows, cols] activation or gradient, optionally
// multiplied by a per-column factor first (v = x · col_scale[c]; col_scale may be null):
// scale[r] = max_c |v[r, c]| / 448 (1 for an all-zero row) and q[r, c] = e4m3(v[r, c] / scale[r]),
// saturating.
int quantize_rows_fp8(const void* x, KernelDtype x_dtype, const float* col_scale, int64_t rows, int64_t cols,
                      void* q, float* scale, void* stream);

// y [m, n] = Σ_k x[m, k] · q[n, k] · scale[n] (+ bias[n]) for a handful of rows (m <= 8: AdaLN's
// modulation Linears see one token per sample), reading the quantised weight as stored (one pass
// over its bytes, nothing dequantised). x, bias and y in `dtype`; x and y row-major, k a multiple of
// 16, x and q 16-byte aligned (else cudaErrorInvalidValue, nothing launched).
int quantized_gemv(const void* x, int64_t m, int64_t k, const void* q, QuantStorage storage,
                   const float* scale, const void* bias, int64_t n, void* y, KernelDtype dtype, void* stream);

// out [cols, rows] = in [rows, cols]ᵀ for one-byte elements (int8, fp8), through 64 × 64 shared
// tiles with 16-byte loads and stores (128 × 64 tiles with 32-byte stores measured 8% slower on an
// H200). Needs rows and cols multiples of 16 and both pointers 16-byte aligned (else
// cudaErrorInvalidValue, nothing launched).
int transpose_bytes(const void* in, int64_t rows, int64_t cols, void* out, void* stream);

}  // namespace dtune::models::cuda
