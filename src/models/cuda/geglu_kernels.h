// Launchers of the fused GEGLU CUDA kernels (cuda/geglu_kernels.cu), callable from code built without
// nvcc: plain pointers, the dtype as a code, the stream as an opaque cudaStream_t. `proj` is the
// contiguous [rows, 2 * d] output of GEGLU's projection (hidden | gate); `out` and `grad_out` are
// [rows, d]; `grad_proj` is [rows, 2 * d]. Built only when CMake found nvcc (DTUNE_WITH_CUDA_KERNELS).
#pragma once

#include <cstdint>

#include "models/cuda/kernel_dtype.h"

namespace dtune::models::cuda {

// Both return the launch's cudaError_t as an int (0 = success).
int geglu_forward(const void* proj, void* out, int64_t rows, int64_t d, KernelDtype dtype, void* stream);
int geglu_backward(const void* grad_out, const void* proj, void* grad_proj, int64_t rows, int64_t d,
                   KernelDtype dtype, void* stream);

}  // namespace dtune::models::cuda
