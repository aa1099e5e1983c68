// Rotary position embedding as diffusers applies it to Flux.1's queries and keys
// (apply_rotary_emb with use_real, unbind_dim -1): pairs (2i, 2i + 1) of the head dimension rotate by
// the angle whose cosine and sine tables are given, in float32, and the result is cast back.
#pragma once

#include <ATen/ATen.h>

namespace dtune::models {

// x [B, S, H, D] (D even), cos and sin float32 [S, D] -> [B, S, H, D] in x's dtype:
//   out[2i] = x[2i] cos[2i] - x[2i+1] sin[2i],  out[2i+1] = x[2i+1] cos[2i+1] + x[2i] sin[2i+1].
// Fused on the GPU where the CUDA kernels were built (one pass forward, one backward, saving only the
// tables, float math with one rounding); otherwise, and with DTUNE_FUSED_KERNELS=0, the composite.
at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The composite path, always: float casts, a stacked rotation and two products (diffusers' order of
// operations). The reference the fused path is tested against.
at::Tensor rotary_embedding_composite(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace dtune::models
