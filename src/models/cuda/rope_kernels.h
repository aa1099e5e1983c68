// Launchers of the fused rotary-embedding CUDA kernels (cuda/rope_kernels.cu), callable from code built
// without nvcc. `x`, `out` and the gradients are contiguous [rows, S, H, D] in the kernel dtype (rows =
// the batch); `cos` and `sin` are contiguous float32 [S, D]. Pairs (2i, 2i + 1) of the last dimension
// rotate: out[2i] = x[2i] cos[2i] - x[2i+1] sin[2i], out[2i+1] = x[2i+1] cos[2i+1] + x[2i] sin[2i+1].
#pragma once

#include <cstdint>

#include "models/cuda/kernel_dtype.h"

namespace dtune::models::cuda {

// Both return the launch's cudaError_t as an int (0 = success). backward = the transposed rotation.
int rope_forward(const void* x, const float* cos, const float* sin, void* out, int64_t batch, int64_t seq,
                 int64_t heads, int64_t dim, KernelDtype dtype, void* stream);
int rope_backward(const void* grad_out, const float* cos, const float* sin, void* grad_x, int64_t batch,
                  int64_t seq, int64_t heads, int64_t dim, KernelDtype dtype, void* stream);

}  // namespace dtune::models::cuda
