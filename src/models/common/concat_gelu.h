// cat([a, gelu_tanh(h)], -1) as one op: a Flux single block's attention output beside its MLP
// activation, which its output projection reads as one input. On the GPU (bf16, fp16, float32; both
// widths whole 16-byte packs) one kernel each way (cuda/concat_gelu_kernels.h); the backward hands
// back both gradients dense, so the attention's output gradient needs no copy and the GELU's is not
// computed from strided columns. Elsewhere (CPU, other widths, no nvcc, DTUNE_FUSED_KERNELS=0 or
// DTUNE_FUSED_CONCAT_GELU=0) at::cat and at::gelu(h, "tanh"), with the same values up to float
// rounding.
#pragma once

#include <ATen/ATen.h>

namespace dtune::models {

// a [..., da] and h [..., dh] of one dtype, device and leading sizes -> [..., da + dh].
at::Tensor concat_gelu_tanh(const at::Tensor& a, const at::Tensor& h);

// DTUNE_FUSED_CONCAT_GELU (read once, on first use: unset or 1 = the kernels where they apply, 0 = the
// composite ops); set_fused_concat_gelu overrides it (tests, benchmarks).
void set_fused_concat_gelu(bool enabled);
bool fused_concat_gelu_enabled();

}  // namespace dtune::models
