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

// Off by default: on an H200 the kernels made the SDXL LoRA step 1.4 ms slower and a full
// fine-tune's 7.7 ms slower than ATen's layer_norm and add (docs/BENCHMARKS.md); kept, tested, for
// tuning. DTUNE_FUSED_LAYER_NORM=1 (read once) or set_fused_layer_norm(true) turns them on;
// set_fused_layer_norm(false) or DTUNE_FUSED_KERNELS=0 off.
void set_fused_layer_norm(bool enabled);
bool fused_layer_norm_enabled();

// True when the kernels take x: built and allowed, x a contiguous CUDA tensor (float32, bf16 or
// fp16, 16-byte aligned) whose last dimension is `norm`'s only normalised dimension, `norm` affine,
// and the kernels cover that width (add_layer_norm_supported).
bool fused_layer_norm_ready(const torch::nn::LayerNormImpl& norm, const at::Tensor& x);

// LayerNorm(x), computed in x's dtype with float statistics (as norm_forward under autocast).
at::Tensor layer_norm(torch::nn::LayerNormImpl& norm, const at::Tensor& x);

// (a + b, LayerNorm(a + b)); a and b of one shape and dtype.
std::pair<at::Tensor, at::Tensor> add_layer_norm(torch::nn::LayerNormImpl& norm, const at::Tensor& a,
                                                 const at::Tensor& b);

}  // namespace dtune::models
