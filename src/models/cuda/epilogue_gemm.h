// GEMMs with work in their epilogue (cuBLASLt), callable from code built without nvcc:
// - a tanh-GELU: an MLP's input projection writes gelu_tanh(x·Wᵀ + b) (and, for the backward, the
//   pre-activation beside it) without a separate pass over the activation, and the output
//   projection's input gradient comes out already multiplied by gelu_tanh'(pre-activation).
//   cuBLASLt's GELU is the tanh approximation, computed in float32 on the accumulator before the one
//   rounding to the output;
// - a bias added onto what d holds (accumulate): a Linear whose output already holds another term
//   (fused q/k/v's LoRA up-projections) gets x·Wᵀ + b added in the GEMM's epilogue, one read of d
//   inside the GEMM instead of a separate read-modify-write pass.
//
// Operands are row-major: d [m, n] (row stride ldd) = a [m, k] (row stride lda) · b, where b is a
// Linear's weight [n, k] read transposed (b_nk) or a [k, n] matrix (row stride ldb). Strides may
// exceed the widths (a column slice of a wider matrix), in elements.
#pragma once

#include <cstddef>
#include <cstdint>

#include "models/cuda/kernel_dtype.h"

namespace dtune::models::cuda {

enum class GemmEpilogue {
    kBias,         // d = a·b + bias (+ d where GemmArgs::accumulate)
    kGeluBias,     // d = gelu_tanh(a·b + bias)
    kGeluAuxBias,  // the same, and aux = a·b + bias (the pre-activation the backward reads)
    kDGelu,        // d = (a·b) ⊙ gelu_tanh'(aux)
};

struct GemmArgs {
    const void* a = nullptr;
    int64_t lda = 0;
    const void* b = nullptr;
    int64_t ldb = 0;
    bool b_nk = true;
    void* d = nullptr;
    int64_t ldd = 0;
    const void* bias = nullptr;  // [n]: kBias, kGeluBias, kGeluAuxBias
    void* aux = nullptr;         // [m, n], row stride ldaux: kGeluAuxBias writes it, kDGelu reads it
    int64_t ldaux = 0;
    int64_t m = 0, n = 0, k = 0;
    bool accumulate = false;  // kBias: add onto d's values (beta 1)
};

// The workspace the GEMMs are planned for (bytes); pass a buffer of this size.
constexpr size_t kEpilogueGemmWorkspace = size_t{32} << 20;

// What epilogue_gemm returns, writing nothing, where cuBLASLt has no algorithm for the GEMM with
// these pointers' alignment, or for the dtype (16-bit only): CUBLAS_STATUS_NOT_SUPPORTED.
constexpr int kEpilogueGemmUnsupported = 15;

// Runs it on `stream` (`lt_handle`: a cublasLtHandle_t): 0 on success, else the cublasStatus_t. The
// algorithm cuBLASLt's heuristic picks is cached per shape, strides, alignment and epilogue.
int epilogue_gemm(const GemmArgs& g, GemmEpilogue epilogue, KernelDtype dtype, void* lt_handle,
                  void* workspace, void* stream);

}  // namespace dtune::models::cuda
