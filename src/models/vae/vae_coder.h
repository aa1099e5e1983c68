// The VAE's Encoder and Decoder (diffusers' autoencoders/vae.py), named `conv_in`,
// `down_blocks.N.resnets.M`, `down_blocks.N.downsamplers.0`, `mid_block.resnets.{0,1}`,
// `mid_block.attentions.0`, `up_blocks.N.resnets.M`, `up_blocks.N.upsamplers.0`, `conv_norm_out`,
// `conv_out`. No time embedding; GroupNorm eps is 1e-6 throughout as in diffusers.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/normalization.h>

#include <vector>

#include "models/common/attention.h"
#include "models/common/blocks.h"
#include "models/common/layers.h"

namespace dtune::models {

struct VAECoderOptions {
    int64_t in_channels = 3;   // encoder: image channels; decoder: latent channels
    int64_t out_channels = 3;  // encoder: 2 * latent channels (mean, logvar); decoder: image channels
    std::vector<int64_t> block_out_channels;
    int64_t layers_per_block = 2;
    int64_t norm_num_groups = 32;
    bool mid_block_add_attention = true;
};

// UNetMidBlock2D without time embedding: resnet, spatial self-attention, resnet.
class VAEMidBlockImpl : public torch::nn::Module {
  public:
    VAEMidBlockImpl(int64_t channels, int64_t groups, bool add_attention);
    at::Tensor forward(const at::Tensor& x);

  private:
    ResnetBlock2D resnet0_{nullptr}, resnet1_{nullptr};
    Attention attention_{nullptr};
};
TORCH_MODULE(VAEMidBlock);

// A list of ResNets followed by an optional resampler (DownEncoderBlock2D / UpDecoderBlock2D).
class VAECoderBlockImpl : public torch::nn::Module {
  public:
    VAECoderBlockImpl(int64_t in, int64_t out, int64_t layers, int64_t groups, bool down, bool resample);
    at::Tensor forward(at::Tensor x);

  private:
    std::vector<ResnetBlock2D> resnets_;
    Downsample2D downsampler_{nullptr};
    Upsample2D upsampler_{nullptr};
};
TORCH_MODULE(VAECoderBlock);

class VAEEncoderImpl : public torch::nn::Module {
  public:
    explicit VAEEncoderImpl(const VAECoderOptions& options);
    at::Tensor forward(const at::Tensor& x);  // [B, 3, H, W] -> [B, 2*latent, H/f, W/f]

  private:
    Conv2d conv_in_{nullptr}, conv_out_{nullptr};
    std::vector<VAECoderBlock> blocks_;
    VAEMidBlock mid_block_{nullptr};
    torch::nn::GroupNorm conv_norm_out_{nullptr};
};
TORCH_MODULE(VAEEncoder);

class VAEDecoderImpl : public torch::nn::Module {
  public:
    explicit VAEDecoderImpl(const VAECoderOptions& options);
    at::Tensor forward(const at::Tensor& z);  // [B, latent, h, w] -> [B, 3, h*f, w*f]

  private:
    Conv2d conv_in_{nullptr}, conv_out_{nullptr};
    std::vector<VAECoderBlock> blocks_;
    VAEMidBlock mid_block_{nullptr};
    torch::nn::GroupNorm conv_norm_out_{nullptr};
};
TORCH_MODULE(VAEDecoder);

}  // namespace dtune::models
