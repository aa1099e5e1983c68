// Launchers of the concatenate-with-GELU kernels (cuda/concat_gelu_kernels.cu), callable from code built
// without nvcc. Rows of two contiguous inputs a [rows, da] and h [rows, dh] become one contiguous
// out [rows, da + dh] = [a, gelu_tanh(h)] (a Flux single block's attention output beside its MLP
// activation, the input of its output projection). The backward splits grad_out [rows, da + dh]
// (contiguous) into a dense grad_a [rows, da] (a copy) and grad_h = grad_out[:, da:] · gelu_tanh'(h).
// Float math with PyTorch's tanh-GELU formulas, one rounding per element.
#pragma once

#include <cstdint>

#include "models/cuda/kernel_dtype.h"

namespace dtune::models::cuda {

// Whether da and dh are whole 16-byte packs and the pointers are aligned to them.
bool concat_gelu_supported(const void* const* pointers, int count, int64_t da, int64_t dh, KernelDtype dtype);

// Return the launch's cudaError_t as an int (0 = success).
int concat_gelu_forward(const void* a, const void* h, void* out, int64_t rows, int64_t da, int64_t dh,
                        KernelDtype dtype, void* stream);
int concat_gelu_backward(const void* grad_out, const void* h, void* grad_a, void* grad_h, int64_t rows,
                         int64_t da, int64_t dh, KernelDtype dtype, void* stream);

}  // namespace dtune::models::cuda
