// Launchers of the gated-residual kernels (cuda/gated_residual_kernels.cu), callable from code built
// without nvcc: out = x + gate · y for x, y contiguous [B, S, D] and a gate of one row per sample
// (gate + b · gate_stride, D contiguous values: AdaLN-Zero's gate, broadcast over the S tokens), and
// the backward's grad_y = grad_out · gate. Float math, one rounding per element.
#pragma once

#include <cstdint>

#include "models/cuda/kernel_dtype.h"

namespace dtune::models::cuda {

// Whether D is whole 16-byte packs and the pointers and the gate stride keep them aligned.
bool gated_residual_supported(const void* const* pointers, int count, int64_t d, int64_t gate_stride,
                              KernelDtype dtype);

// Return the launch's cudaError_t as an int (0 = success).
int gated_residual_forward(const void* x, const void* gate, int64_t gate_stride, const void* y, void* out,
                           int64_t batch, int64_t seq, int64_t d, KernelDtype dtype, void* stream);
int gated_residual_backward(const void* grad_out, const void* gate, int64_t gate_stride, void* grad_y,
                            int64_t batch, int64_t seq, int64_t d, KernelDtype dtype, void* stream);

}  // namespace dtune::models::cuda
