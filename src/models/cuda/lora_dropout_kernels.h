// Launchers of the LoRA kernels that read the adapter's input through its hash-dropout mask
// (cuda/lora_dropout_kernels.cu) instead of a masked copy; callable from code built without nvcc.
// x and dx are [n, k] contiguous, a is [r, k] contiguous, all of `dtype`; h and gh are [n, r] with
// row stride ldh / ldg (a column slice of a wider matrix is fine). The mask of element (row, col)
// is hash_dropout's for index `index_offset + row · k + col` (common/hash_dropout_math.h).
// Requirements (the host wrapper checks them): 1 <= r <= kLoRADropoutMaxRank, k a multiple of 8,
// n >= kLoRADropoutMinRows,
// x, dx and a 16-byte aligned. Built only with DTUNE_WITH_CUDA_KERNELS.
#pragma once

#include <cstdint>

#include "models/cuda/kernel_dtype.h"

namespace dtune::models::cuda {

constexpr int64_t kLoRADropoutMaxRank = 64;
// Fewer rows than this (a text encoder's keys and values) take the masked copy: too few blocks to
// fill the card (308 rows of 2048: 38 µs in the kernel against 7 µs for copy + cuBLAS on an H200).
constexpr int64_t kLoRADropoutMinRows = 1024;

// The hash-dropout rule as the kernels take it: `seed` points at one int64 on the device.
// The tensor-core kernels (lora_dropout_tensor_cores) can keep the decisions instead of hashing
// them again: [n, k / 8] bytes, bit e of byte (row, j) set where element (row, 8j + e) is kept.
// lora_masked_down writes them to `keep_out` when it is set; the two backward kernels read
// `keep_in` when it is set, else hash.
struct DropoutRule {
    const int64_t* seed;
    uint64_t salt;
    int64_t index_offset;
    uint32_t threshold;
    float scale;
    uint8_t* keep_out = nullptr;
    const uint8_t* keep_in = nullptr;
};

// The rules of a group of adapters that read the same input (fused q/k/v), for
// lora_masked_up_add_group: rule[0 .. count).
constexpr int kLoRAMaxGroup = 3;
struct DropoutRules {
    DropoutRule rule[kLoRAMaxGroup] = {};
    int count = 0;
};

// Whether `dtype` on CUDA device `device` takes the tensor-core kernels (16-bit types on sm_80 and
// later), the only ones that write and read the kept decisions.
bool lora_dropout_tensor_cores(KernelDtype dtype, int device);

// Each launcher returns the launch's cudaError_t as an int (0 = success).

// h = (mask ⊙ x) · aᵀ, accumulated in float32, stored in `dtype`.
int lora_masked_down(const void* x, const void* a, void* h, int64_t ldh, int64_t n, int64_t k, int64_t r,
                     const DropoutRule& rule, KernelDtype dtype, void* stream);

// The number of row splits lora_masked_down_grad uses for [n, k] inputs of `dtype` on the current
// device: `partials` holds splits · r · k floats.
int64_t lora_masked_down_grad_splits(int64_t n, int64_t k, KernelDtype dtype);

// da [r, k] (float32) = ghᵀ · (mask ⊙ x): per-split partial sums into `partials`, then their sum in
// a fixed order (deterministic run to run).
int lora_masked_down_grad(const void* gh, int64_t ldg, const void* x, float* partials, float* da, int64_t n,
                          int64_t k, int64_t r, const DropoutRule& rule, KernelDtype dtype, void* stream);

// dx += mask ⊙ (gh · a), rounded once to `dtype`; gh · a is never stored.
int lora_masked_up_add(void* dx, const void* gh, int64_t ldg, const void* a, int64_t n, int64_t k, int64_t r,
                       const DropoutRule& rule, KernelDtype dtype, void* stream);

// The factor gradients of a group: da [count·r, k] (float32), rows [g·r, (g+1)·r) = gh_gᵀ · (mask_g ⊙ x)
// with gh_g as for lora_masked_up_add_group. `partials` holds lora_masked_down_grad_splits(n, k,
// dtype) · count · r · k floats. One pass over x where the group's tiles fit (count · ⌈r / 16⌉ <= 6),
// else adapter by adapter; the same bits run to run either way. Tensor cores only, as below.
int lora_masked_down_grad_group(const void* gh, int64_t ldg, const void* x, float* partials, float* da,
                                int64_t n, int64_t k, int64_t r, const DropoutRules& rules, KernelDtype dtype,
                                void* stream);

// dx += Σ_g mask_g ⊙ (gh_g · a_g) for the group's adapters g < rules.count, summed in float32 and
// rounded once: one pass over dx. gh_g is columns [g·r, (g+1)·r) of gh (row stride ldg), a_g rows
// [g·r, (g+1)·r) of a ([count·r, k] contiguous). One pass where the group's tiles fit (count ·
// ⌈r / 16⌉ <= 6: q/k/v up to rank 32), else adapter by adapter (each rounded). Tensor cores only
// (16-bit dtype on sm_80+): cudaErrorInvalidValue otherwise, and for a count outside 1..kLoRAMaxGroup.
int lora_masked_up_add_group(void* dx, const void* gh, int64_t ldg, const void* a, int64_t n, int64_t k,
                             int64_t r, const DropoutRules& rules, KernelDtype dtype, void* stream);

}  // namespace dtune::models::cuda
