// The UNet's down, mid and up blocks (diffusers' unet_2d_blocks.py): DownBlock2D,
// CrossAttnDownBlock2D, UNetMidBlock2DCrossAttn, CrossAttnUpBlock2D and UpBlock2D, with children
// `resnets.N`, `attentions.N`, `downsamplers.0`, `upsamplers.0`.
//
// A block with cross_attention false is the plain (Down|Up)Block2D: same class, no `attentions`.
// Down blocks return every intermediate state; up blocks consume them from the back (skips).
#pragma once

#include <torch/nn/module.h>

#include <optional>
#include <vector>

#include "models/common/attention.h"
#include "models/common/blocks.h"

namespace dtune::models {

struct UNetBlockOptions {
    int64_t num_layers = 2;
    int64_t in_channels = 0;
    int64_t out_channels = 0;
    int64_t prev_output_channels = 0;  // up blocks: channels coming from the block below
    int64_t temb_channels = 0;
    bool cross_attention = false;  // CrossAttn*Block2D vs *Block2D
    bool add_sample = false;       // downsampler / upsampler at the end
    int64_t transformer_layers = 1;
    int64_t heads = 1;
    int64_t cross_attention_dim = 0;
    int64_t groups = 32;
    double eps = 1e-5;
    double output_scale_factor = 1.0;
    int64_t downsample_padding = 1;
    bool use_linear_projection = false;
    bool only_cross_attention = false;
    bool upcast_attention = false;
};

// State shared by the three block kinds: ResNets, transformers, and how to run them (optionally
// checkpointed).
class UNetBlockBase : public torch::nn::Module {
  public:
    // Units in forward order (ResNet i, then attention i's transformer blocks) take the selector's
    // decisions: SimpleTuner's gradient_checkpointing_interval.
    void set_gradient_checkpointing(CheckpointSelector& selector);

  protected:
    void build_transformer(const UNetBlockOptions& o, int64_t channels);
    at::Tensor run_resnet(std::size_t i, const at::Tensor& x, const at::Tensor& temb);
    at::Tensor run_attention(std::size_t i, const at::Tensor& x, const at::Tensor& context);

    torch::nn::ModuleList resnet_list_{nullptr}, attention_list_{nullptr};
    std::vector<ResnetBlock2D> resnets_;
    std::vector<Transformer2DModel> attentions_;
    std::vector<bool> resnet_checkpointing_;  // per ResNet: checkpointed (empty: none)
};

class DownBlockImpl : public UNetBlockBase {
  public:
    explicit DownBlockImpl(const UNetBlockOptions& options);
    // Returns the output and appends each intermediate state to `skips`.
    at::Tensor forward(at::Tensor x, const at::Tensor& temb, const at::Tensor& context,
                       std::vector<at::Tensor>& skips);

  private:
    Downsample2D downsampler_{nullptr};
};
TORCH_MODULE(DownBlock);

class MidBlockImpl : public UNetBlockBase {
  public:
    explicit MidBlockImpl(const UNetBlockOptions& options);
    at::Tensor forward(at::Tensor x, const at::Tensor& temb, const at::Tensor& context);
};
TORCH_MODULE(MidBlock);

class UpBlockImpl : public UNetBlockBase {
  public:
    explicit UpBlockImpl(const UNetBlockOptions& options);
    // Pops one skip per ResNet from the back of `skips`, then upsamples to the spatial size of the
    // next skip (so latents whose size is not a multiple of the UNet's factor round-trip).
    at::Tensor forward(at::Tensor x, const at::Tensor& temb, const at::Tensor& context,
                       std::vector<at::Tensor>& skips);
    std::size_t num_resnets() const { return resnets_.size(); }

  private:
    Upsample2D upsampler_{nullptr};
};
TORCH_MODULE(UpBlock);

}  // namespace dtune::models
