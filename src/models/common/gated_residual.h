// x + gate · y, the gated residual of AdaLN-Zero blocks (Flux.1's double and single blocks), with the
// gate one row per sample broadcast over the tokens. On the GPU (bf16, fp16, float32; D whole 16-byte
// packs; x and y contiguous) one vectorised kernel each way (cuda/gated_residual_kernels.h) where ATen's
// addcmul and its backward's mul take their scalar path for the broadcast gate. The gate's gradient
// (when it takes one: a full fine-tune or adapters on the modulation) is Σ_tokens grad · y by ATen.
// Elsewhere (CPU, other layouts, no nvcc, DTUNE_FUSED_KERNELS=0 or DTUNE_FUSED_GATED_RESIDUAL=0)
// at::addcmul, with the same values up to float rounding.
#pragma once

#include <ATen/ATen.h>

namespace dtune::models {

// x, y [B, S, D]; gate [B, 1, D] (any strides); one dtype.
at::Tensor gated_residual(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& y);

// DTUNE_FUSED_GATED_RESIDUAL (read once, on first use: unset or 1 = the kernels where they apply,
// 0 = at::addcmul); set_fused_gated_residual overrides it (tests, benchmarks).
void set_fused_gated_residual(bool enabled);
bool fused_gated_residual_enabled();

}  // namespace dtune::models
