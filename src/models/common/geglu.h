// GEGLU's activation, out = hidden * gelu(gate) with [hidden | gate] = the projection's output split
// in half along the last dimension (diffusers' GEGLU, exact erf GELU).
#pragma once

#include <ATen/ATen.h>

namespace dtune::models {

// The activation of a [.., 2d] projection output: [.., d]. Fused (one pass forward, one backward,
// saving only `proj` for the backward) on the CPU and, where the CUDA kernels were built, on the
// GPU for float, bf16 and fp16; otherwise chunk + gelu + mul. Same values up to one rounding of the
// result (the fused path rounds once, the composite rounds gelu(gate) first).
at::Tensor geglu(const at::Tensor& proj);

// The composite (chunk + gelu + mul) path, always: the reference the fused one is tested against.
at::Tensor geglu_composite(const at::Tensor& proj);

// Process-wide switch of the fused path (default on); off = geglu() is geglu_composite().
// For A/B benchmarks (bench_train_step --no-fused-geglu) and tests.
void set_fused_geglu(bool enabled);
bool fused_geglu_enabled();

// Whether the fused path runs on `device` (CPU: always; CUDA: if the kernels were built).
bool fused_geglu_available(const at::Device& device);

}  // namespace dtune::models
