// Fused inference path of the convolutional blocks (VAE encoding and decoding; ResNet blocks in
// sampling) on channels-last CUDA tensors:
//   - GroupNorm with an optional input bias and SiLU in one kernel sequence (the bias of the
//     convolution before it, plus a time embedding, folded in: the convolution runs without bias);
//   - the bias + residual add that ends a ResNet block, in one pass.
// ATen's GroupNorm makes a channels-last input NCHW first and back, and the convolution bias is a
// broadcast add of its own: in the SDXL VAE encoder those cost more GPU time than the
// convolutions.
// With gradients (training a channels-last UNet), GroupNorm + SiLU is one autograd function on the
// same kernels: the forward also keeps each group's mean and 1/std, and the backward recomputes the
// normalised value from x, so SiLU's input is neither written nor saved (no input bias there).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/modules/normalization.h>

namespace dtune::models {

// Process-wide switch of the fused inference path (default on). For A/B benchmarks and tests.
void set_fused_inference(bool enabled);
bool fused_inference_enabled();

// The ResNet blocks' bias folding in training (on by default: an SDXL LoRA batch-4 step 158.3
// against 159.8 ms on an H200): with gradients on channels-last CUDA input, ResnetBlock2D runs its
// convolutions without bias, folds conv1's bias and the time embedding into norm2
// (GroupNormActFunction with an input bias) and conv2's (and the shortcut's) into the closing
// residual add (one kernel), instead of three broadcast adds and a residual add per block.
// DTUNE_FUSED_RESNET_TRAINING=0 (read once) or set_fused_resnet_training(false) turns it off;
// DTUNE_FUSED_KERNELS=0 too.
void set_fused_resnet_training(bool enabled);
bool fused_resnet_training_enabled();
// Whether this build has the kernels (CMake found nvcc; DTUNE_WITH_CUDA_KERNELS).
bool fused_inference_kernels_built();

// True when the fused kernels may run on x: they were built (nvcc), the switch is on, grad mode and
// CUDA autocast are off, and x is a 4-D channels-last CUDA tensor (float32, bf16 or fp16) whose data
// is 16-byte aligned.
bool fused_inference_ready(const at::Tensor& x);

// True when the differentiable fused path may run: the kernels were built and are allowed, x is a
// 4-D channels-last CUDA tensor (float32, bf16 or fp16) with 16-byte aligned data, `norm` is affine
// and the kernels cover its channel count. Grad mode may be on or off.
bool fused_group_norm_training_ready(const torch::nn::GroupNormImpl& norm, const at::Tensor& x);

// y = act(GroupNorm(x + in_bias)) with `norm`'s groups, eps and affine weights; in_bias undefined,
// [C] or [N, C] (any float dtype), act = SiLU when `silu`. Fused when fused_inference_ready(x) and
// the shape is supported; with gradients, fused when fused_group_norm_training_ready and either no
// in_bias or fused_resnet_training_enabled() (differentiable in x, the affine weights and in_bias,
// computed in x's dtype with float statistics as norm_forward does under autocast, x + in_bias
// added in float); otherwise the composite ops (x + in_bias in x's dtype, norm_forward, at::silu),
// so any caller may use it.
at::Tensor group_norm_act(torch::nn::GroupNormImpl& norm, const at::Tensor& x, const at::Tensor& in_bias,
                          bool silu);

// (h + bias + residual) * scale; bias [C] or undefined, residual like h or undefined. Fused (in
// place into h, which the caller gives up) when fused_inference_ready(h) and residual has h's
// layout and dtype; else, with fused_resnet_training_enabled() on channels-last CUDA tensors, one
// differentiable kernel into a new tensor; otherwise composite ops.
at::Tensor add_bias_residual(at::Tensor h, const at::Tensor& bias, const at::Tensor& residual, double scale);

}  // namespace dtune::models
