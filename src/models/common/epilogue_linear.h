// Linear layers through cuBLASLt's epilogues (cuda/epilogue_gemm.h) from torch code:
// add_linear_ adds a Linear's output onto a tensor that already holds another term, in the GEMM's
// epilogue; run_epilogue_gemm is the shared call of the GELU MLP (gelu_mlp.h).
#pragma once

#include <ATen/ATen.h>

#ifdef DTUNE_WITH_CUDA_KERNELS
#include "models/cuda/epilogue_gemm.h"
#endif

namespace dtune::models {

// y [N, out] += x2 [N, in]·weightᵀ + bias as one GEMM whose epilogue adds the bias and reads y
// (beta 1), where it applies: CUDA kernels built, 16-bit y, x2, weight and bias of one dtype on
// one device, y contiguous, x2 and weight with unit column strides, and cuBLASLt has an algorithm.
// Returns false, y untouched, anywhere else (and with DTUNE_FUSED_LINEAR_EPILOGUE=0 or
// DTUNE_FUSED_KERNELS=0): the caller adds at::addmm's result itself.
bool add_linear_(at::Tensor& y, const at::Tensor& x2, const at::Tensor& weight, const at::Tensor& bias);
// Whether add_linear_ takes x2, weight and bias (for a contiguous y of their dtype and device) as far
// as the tensors and the switch tell; cuBLASLt's own answer comes in the call.
bool add_linear_applies(const at::Tensor& x2, const at::Tensor& weight, const at::Tensor& bias);

// DTUNE_FUSED_LINEAR_EPILOGUE (read once, on first use: unset or 1 = add_linear_ where it applies,
// 0 = never); the setter overrides it (tests, benchmarks).
void set_fused_linear_epilogue(bool enabled);
bool fused_linear_epilogue_enabled();

#ifdef DTUNE_WITH_CUDA_KERNELS
// out [N, out] = x2 [N, in]·weightᵀ + bias as cuBLASLt's arguments (row strides taken from the
// tensors); the caller sets the epilogue's own fields (aux, accumulate).
cuda::GemmArgs linear_gemm_args(const at::Tensor& x2, const at::Tensor& weight, const at::Tensor& bias,
                                at::Tensor& out);
// The current cuBLASLt handle (cublasLtHandle_t) of the current device.
void* epilogue_lt_handle();
// Runs g on the current stream of `like`'s device with a workspace from the caching allocator:
// true when it ran, false (nothing written) where cuBLASLt has no algorithm for it, so the caller
// computes the same values with ATen ops; throws naming `who` when cuBLASLt fails otherwise.
bool run_epilogue_gemm(const cuda::GemmArgs& g, cuda::GemmEpilogue e, const at::Tensor& like,
                       const char* who);
#endif

}  // namespace dtune::models
