// Dropout whose mask is a hash of (seed, salt, element index) instead of a draw from a generator:
// inverted dropout (kept elements scaled by 1 / (1 - p), as at::dropout) with three properties the
// LoRA trainer needs (train/adapters.h):
// - the seed is a device tensor read by the kernel, so a CUDA graph that refreshes it inside the
//   captured step gets fresh masks on every replay;
// - backward and a gradient-checkpointed recompute find the same mask again without storing it;
// - `index_offset` places this rank's rows in a global batch, so N ranks × batch b keep exactly the
//   elements one process keeps at batch N·b (offset = rank · x.numel()).
// The CPU loop and the CUDA kernel keep the same elements (common/hash_dropout_math.h). A CUDA
// tensor in a build without the kernels takes the mask through the CPU (correct, not capturable).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace dtune::models {

// x: any floating tensor; seed: one int64 element on x's device (read when the op runs); p in
// [0, 1). Returns a tensor shaped and laid out like x (x's suggested memory format), with autograd.
at::Tensor hash_dropout(const at::Tensor& x, const at::Tensor& seed, uint64_t salt, double p,
                        int64_t index_offset = 0);

// The same masked scale without autograd, for code that writes its own backward (the fused LoRA
// function applies it to its input in forward and to the input's gradient in backward).
at::Tensor hash_dropout_no_grad(const at::Tensor& x, const at::Tensor& seed, uint64_t salt, double p,
                                int64_t index_offset = 0);

// dst += hash_dropout_no_grad(src, ...), in one pass on CUDA and rounded once (the LoRA backward's
// input gradient joining the base layer's). dst contiguous, shaped like src, same dtype and device.
void hash_dropout_add_(at::Tensor& dst, const at::Tensor& src, const at::Tensor& seed, uint64_t salt,
                       double p, int64_t index_offset = 0);

}  // namespace dtune::models
