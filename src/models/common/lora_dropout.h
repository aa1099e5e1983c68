// The products of LoRA's adapter branch that read its input through the hash-dropout mask
// (hash_dropout.h), for the fused LoRA functions' forward and backward (adapters/lora.cpp,
// adapters/lora_qkv.cpp). On CUDA (DTUNE_LORA_DROPOUT_KERNELS unset or 1), where the shapes allow
// (lora_dropout_kernels_take), fused kernels read x once and never store the masked copy (nor gh·A);
// otherwise, on the CPU and with DTUNE_LORA_DROPOUT_KERNELS=0, the same products through
// hash_dropout_no_grad and the GEMMs. In bf16 and fp16 the kernels round the masked input as the copy
// does and multiply on tensor cores, so they differ from that path by summation order only; float32
// runs on CUDA cores without rounding the masked input. No autograd. x2 is the adapter's input as [N, in]; a
// is A [r, in] in x2's dtype; gh is [N, r] (its rows may be strided); the mask is that of
// hash_dropout_no_grad(x2, seed, salt, p, index_offset).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace dtune::models {

// The hash-dropout mask's arguments (hash_dropout.h).
struct LoRADropoutMask {
    at::Tensor seed;  // one int64 element on x2's device
    uint64_t salt = 0;
    double p = 0;
    int64_t index_offset = 0;
    // The decisions lora_masked_down kept (its `keep`), for the backward products to read instead of
    // hashing them again; undefined (or not matching x2): hashed. The same mask either way.
    at::Tensor keep;
};

// Which operands go through the kernels. DTUNE_LORA_DROPOUT_KERNELS unset: kTensorCores (the default:
// an SDXL LoRA batch-4 step with lora_dropout 0.1 took 173 against 177 ms on an H200); "1": kAll;
// "0": kOff. Read on first use, a bad value is a UsageError. The setter is for tests and benchmarks.
// DTUNE_FUSED_KERNELS=0 turns the kernels off too.
enum class LoRADropoutKernels {
    kOff,          // the masked copy and the GEMMs everywhere
    kTensorCores,  // the kernels for bf16 and fp16 on sm_80 and later (tensor cores)
    kAll,          // float32 too (CUDA-core FMAs, not measured faster than the copy)
};
void set_lora_dropout_kernels(LoRADropoutKernels mode);
LoRADropoutKernels lora_dropout_kernels_mode();
bool lora_dropout_kernels_enabled();  // mode not kOff and fused kernels allowed

// Whether the kernels take these operands (CUDA build and device, mode and dtype: bf16 or fp16 on
// sm_80+, or float32 too with kAll; x2 contiguous with at least 1024 rows and `in` a multiple of 8,
// 1 <= r <= 64, 16-byte aligned x2 and a).
bool lora_dropout_kernels_take(const at::Tensor& x2, const at::Tensor& a);

// h [N, r] = (mask ⊙ x2)·aᵀ in x2's dtype; the _out form writes into h (x2's dtype, rows may be
// strided, e.g. a column slice). With `keep` given, where the tensor-core kernel runs (bf16/fp16 on
// sm_80+) it also records the mask's decisions there ([N, in / 8] uint8, one bit per element: 1/16
// of a bf16 x2) for LoRADropoutMask::keep; elsewhere `keep` is left undefined.
at::Tensor lora_masked_down(const at::Tensor& x2, const at::Tensor& a, const LoRADropoutMask& m,
                            at::Tensor* keep = nullptr);
void lora_masked_down_out(at::Tensor& h, const at::Tensor& x2, const at::Tensor& a, const LoRADropoutMask& m,
                          at::Tensor* keep = nullptr);

// dA [r, in] = ghᵀ·(mask ⊙ x2), returned in `out_dtype` (the factor's; the kernel accumulates in
// float32 and is deterministic run to run).
at::Tensor lora_masked_down_grad(const at::Tensor& gh, const at::Tensor& x2, const LoRADropoutMask& m,
                                 at::ScalarType out_dtype);

// The factor gradients dA_i [r, in] = gh_iᵀ·(mask_i ⊙ x2) of adapters of one rank that read x2
// (fused q/k/v): gh [N, n·r] holds adapter i's columns i·r .. (i+1)·r; each returned in
// out_dtypes[i]. On the tensor-core kernels, where every mask carries the forward's decisions (keep)
// and n <= 3 with n · ⌈r / 16⌉ <= 6, one pass over x2 for all of them; elsewhere adapter by adapter.
// Deterministic run to run either way.
std::vector<at::Tensor> lora_masked_down_grad_group(const at::Tensor& gh, const at::Tensor& x2,
                                                    const std::vector<LoRADropoutMask>& masks,
                                                    const std::vector<at::ScalarType>& out_dtypes);

// dx += mask ⊙ (gh·a), rounded once; dx contiguous [N, in] in x2's dtype.
void lora_masked_up_add_(at::Tensor& dx, const at::Tensor& gh, const at::Tensor& a, const LoRADropoutMask& m);

// dx += Σ_i mask_i ⊙ (gh_i·a_i) for adapters of one rank r that read the same input (fused q/k/v):
// gh [N, n·r] holds adapter i's columns i·r .. (i+1)·r, a [n·r, in] its rows, masks[i] its mask (an
// inactive one: the plain product). On the tensor-core kernels (every mask active, n <= 3, and
// n · ⌈r / 16⌉ <= 6) one pass over dx that sums the n products in float32 and rounds once;
// elsewhere adapter by adapter.
void lora_masked_up_add_group_(at::Tensor& dx, const at::Tensor& gh, const at::Tensor& a,
                               const std::vector<LoRADropoutMask>& masks);

}  // namespace dtune::models
