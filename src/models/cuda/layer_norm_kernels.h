// Launchers of the fused residual add + LayerNorm kernels (cuda/layer_norm_kernels.cu), over rows
// of c channels stored contiguously: forward h = a + b (rounded to the storage type; b may be null:
// plain LayerNorm of a) and y = LayerNorm(h) with float statistics; backward dh = dh_in + the
// LayerNorm's input gradient, in one pass, plus the affine gradients' per-block sums. Plain
// pointers, the dtype as a code and the stream as an opaque cudaStream_t, so code built without
// nvcc can call them. Built only when CMake found nvcc (DTUNE_WITH_CUDA_KERNELS).
#pragma once

#include <cstdint>

#include "models/cuda/kernel_dtype.h"

namespace dtune::models::cuda {

struct AddLayerNormArgs {
    const void* a = nullptr;       // [rows, c], `dtype`
    const void* b = nullptr;       // [rows, c] or null (no add)
    void* h = nullptr;             // [rows, c] out: a + b (null when b is null)
    void* y = nullptr;             // [rows, c] out
    const void* weight = nullptr;  // [c] or null (1): float32 when params_float, else `dtype`
    const void* bias = nullptr;    // [c] or null (0): likewise
    bool params_float = true;
    float* mean_rstd = nullptr;  // [rows, 2] float32 out
    int64_t rows = 0, c = 0;
    double eps = 1e-5;
    KernelDtype dtype = KernelDtype::kFloat;
    int sm_count = 1;
};

struct AddLayerNormBackwardArgs {
    const void* dy = nullptr;          // [rows, c]
    const void* dh_in = nullptr;       // [rows, c] or null: the gradient h has from its other uses
    const void* h = nullptr;           // [rows, c]: the LayerNorm's input (the forward's h, or a)
    const float* mean_rstd = nullptr;  // [rows, 2] from the forward
    const void* weight = nullptr;      // [c] or null: float32 when params_float, else `dtype`
    bool params_float = true;
    void* dh = nullptr;             // [rows, c] out (may alias dh_in)
    float* dweight_part = nullptr;  // null, or [add_layer_norm_parts(rows, sm_count), c] out
    float* dbias_part = nullptr;    // null, or like dweight_part (both or neither)
    int64_t rows = 0, c = 0;
    KernelDtype dtype = KernelDtype::kFloat;
    int sm_count = 1;
};

// Rows of c channels the kernels handle: c a multiple of the 16-byte pack (8 for bf16/fp16, 4 for
// float) and at most 2,048 (bf16/fp16) or 1,024 (float) channels. The tensors must be 16-byte
// aligned (fresh allocations are), the weight and bias too; they are read in their own dtype
// (float32, or the data's), so a bf16 model's parameters need no cast per call.
bool add_layer_norm_supported(int64_t c, KernelDtype dtype);
// Rows of the affine gradients' partial sums the backward writes (their sum over rows is the
// gradient): one per block of its grid.
int64_t add_layer_norm_parts(int64_t rows, int sm_count);
// 0 = success, else the launch's cudaError_t.
int add_layer_norm(const AddLayerNormArgs& args, void* stream);
int add_layer_norm_backward(const AddLayerNormBackwardArgs& args, void* stream);

}  // namespace dtune::models::cuda
