// The transformer blocks' LayerNorms on CUDA as dtune's kernels (cuda/layer_norm_kernels.cu): a plain
// LayerNorm, and a residual add fused with the LayerNorm after it, (h, y) = (a + b, LayerNorm(a + b)),
// whose backward adds the residual's gradient to the norm's input gradient in the same pass.
// Differentiable in the inputs and the affine weights. Elsewhere (CPU, other dtypes or shapes, no
// nvcc, DTUNE_FUSED_KERNELS=0 or set_fused_layer_norm(false)) the composite ops: a + b and
// norm_forward (blocks.h), with the same values up to float rounding.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/modules/normalization.h>

#include <utility>

namespace dtune::models {

// By default ("auto") the kernels run where the norm's weight and bias take no gradient: a LoRA
// run's frozen norms and inference. There, on an H200, they made the SDXL LoRA step 1.6 ms faster
// than ATen's add and layer_norm; where the affine weights train (a full fine-tune) their per-block
// gradient sums made the step 6 ms slower, so those norms stay ATen's (docs/BENCHMARKS.md).
// DTUNE_FUSED_LAYER_NORM (read once): unset or auto, 1 (everywhere), 0 (never);
// set_fused_layer_norm(true/false) overrides it (tests, benchmarks), reset_fused_layer_norm() hands
// the choice back; DTUNE_FUSED_KERNELS=0 turns them off too.
void set_fused_layer_norm(bool enabled);
void reset_fused_layer_norm();
bool fused_layer_norm_enabled();  // not switched off (the auto rule still applies per norm)

// True when the kernels take x: built and allowed (on, or auto with `norm`'s weight and bias taking
// no gradient), x a contiguous CUDA tensor (float32, bf16 or fp16, 16-byte aligned) whose last
// dimension is `norm`'s only normalised dimension, `norm` affine, and the kernels cover that width
// (add_layer_norm_supported).
bool fused_layer_norm_ready(const torch::nn::LayerNormImpl& norm, const at::Tensor& x);

// LayerNorm(x), computed in x's dtype with float statistics (as norm_forward under autocast).
at::Tensor layer_norm(torch::nn::LayerNormImpl& norm, const at::Tensor& x);

// (a + b, LayerNorm(a + b)); a and b of one shape and dtype.
std::pair<at::Tensor, at::Tensor> add_layer_norm(torch::nn::LayerNormImpl& norm, const at::Tensor& a,
                                                 const at::Tensor& b);

}  // namespace dtune::models
