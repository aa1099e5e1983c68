// Convolutional building blocks shared by the UNet and the VAE, named as in diffusers
// (`norm1`, `conv1`, `time_emb_proj`, `conv_shortcut`, `downsamplers.0.conv`, `linear_1`, ...).
//
// Tensors are NCHW (or channels-last strided NCHW). Every block computes in the dtype of its
// weights; callers cast inputs.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <optional>
#include <vector>

#include "models/common/adaptable.h"
#include "models/common/unit_hooks.h"

namespace dtune::models {

// diffusers' get_timestep_embedding: [N] timesteps -> [N, dim] float32 sinusoids, frequencies
// exp(-ln(10000) * i / (dim/2 - freq_shift)); [sin, cos] or [cos, sin] when flip_sin_to_cos.
at::Tensor timestep_embedding(const at::Tensor& timesteps, int64_t dim, bool flip_sin_to_cos,
                              double freq_shift);

// LayerNorm / GroupNorm forward that, under autocast, keeps a bf16/fp16 input in its dtype (the
// affine weights cast to it) instead of autocast's float32 upcast: the kernels accumulate in float32
// either way, and what follows a norm (a matmul, or SiLU then a convolution) rounds to bf16 anyway,
// so this saves an upcast copy, a float32 output and the downcast after it, forward and backward.
// Without autocast, or for a float32 input, exactly module.forward(x).
at::Tensor norm_forward(torch::nn::LayerNormImpl& norm, const at::Tensor& x);
at::Tensor norm_forward(torch::nn::GroupNormImpl& norm, const at::Tensor& x);

// Off by default. When on, norm_forward(GroupNorm) of a channels-last 4-D input stays in NHWC
// memory (group statistics in float32, then one multiply-add rounded once to the input's dtype)
// instead of at::group_norm, whose CUDA kernel makes the input NCHW-contiguous: two layout copies
// per norm in a channels-last network. A measured choice (bench_vae_cache's "gn" variant).
void set_group_norm_nhwc(bool enabled);
bool group_norm_nhwc_enabled();
// The NHWC GroupNorm itself (x [N, C, H, W] channels-last; weight/bias [C] or undefined).
at::Tensor group_norm_nhwc(const at::Tensor& x, int64_t groups, const at::Tensor& weight,
                           const at::Tensor& bias, double eps);

// linear_1 -> SiLU -> linear_2 (diffusers' TimestepEmbedding with act_fn "silu").
class TimestepEmbeddingImpl : public torch::nn::Module {
  public:
    TimestepEmbeddingImpl(int64_t in_channels, int64_t time_embed_dim);
    at::Tensor forward(const at::Tensor& x);

  private:
    AdaptableLinear linear_1_{nullptr}, linear_2_{nullptr};
};
TORCH_MODULE(TimestepEmbedding);

struct ResnetBlock2DOptions {
    int64_t in_channels = 0;
    int64_t out_channels = 0;
    int64_t temb_channels = 0;  // 0: no time embedding (VAE)
    int64_t groups = 32;
    double eps = 1e-6;
    double output_scale_factor = 1.0;
};

// GroupNorm -> SiLU -> conv -> (+ time embedding) -> GroupNorm -> SiLU -> conv, plus a 1x1
// shortcut when the channel count changes; the sum is divided by output_scale_factor.
class ResnetBlock2DImpl : public torch::nn::Module, public HookableUnit {
  public:
    explicit ResnetBlock2DImpl(const ResnetBlock2DOptions& options);
    // temb: [B, temb_channels] or undefined.
    at::Tensor forward(const at::Tensor& x, const at::Tensor& temb = {});

  private:
    // Inference on channels-last CUDA input (group_norm_act.h), and training there with
    // fused_resnet_training_enabled(): the convolutions run without bias, conv1's bias and the time
    // embedding fold into norm2, conv2's (and the shortcut's) into the residual add. Same math; the
    // roundings differ (fewer).
    bool can_fuse(const at::Tensor& x) const;
    at::Tensor forward_fused(const at::Tensor& x, const at::Tensor& temb);

    ResnetBlock2DOptions options_;
    torch::nn::GroupNorm norm1_{nullptr}, norm2_{nullptr};
    AdaptableConv2d conv1_{nullptr}, conv2_{nullptr}, conv_shortcut_{nullptr};
    AdaptableLinear time_emb_proj_{nullptr};
};
TORCH_MODULE(ResnetBlock2D);

// Strided 3x3 conv (`conv`). padding 0 pads right/bottom by one first (the VAE's layout).
class Downsample2DImpl : public torch::nn::Module {
  public:
    Downsample2DImpl(int64_t channels, int64_t padding);
    at::Tensor forward(const at::Tensor& x);

  private:
    int64_t padding_;
    AdaptableConv2d conv_{nullptr};
};
TORCH_MODULE(Downsample2D);

// Nearest 2x upsampling (or to `size`, for latents not divisible by the UNet's factor) + 3x3 conv.
class Upsample2DImpl : public torch::nn::Module {
  public:
    explicit Upsample2DImpl(int64_t channels);
    at::Tensor forward(const at::Tensor& x, std::optional<std::vector<int64_t>> size = std::nullopt);

  private:
    AdaptableConv2d conv_{nullptr};
};
TORCH_MODULE(Upsample2D);

// The parameters of a module as a list (for checkpointed()).
std::vector<at::Tensor> parameter_list(const torch::nn::Module& module);

}  // namespace dtune::models
