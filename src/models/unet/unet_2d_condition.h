// UNet2DConditionModel (SDXL, SD 1.x/2.x) built from a diffusers `unet/config.json`.
//
// Child modules carry diffusers' names (`conv_in`, `time_embedding.linear_1`, `add_embedding`,
// `down_blocks.N`, `mid_block`, `up_blocks.N`, `conv_norm_out`, `conv_out`), so a diffusers folder
// loads with no renaming. Config values this implementation does not handle are rejected with a
// UsageError naming the key, never silently ignored.
//
// Note on diffusers' naming: `attention_head_dim` in UNet configs is the number of heads per block
// (head size = channels / heads); `num_attention_heads` overrides it when set.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>

#include <filesystem>
#include <string>
#include <vector>

#include "models/common/blocks.h"
#include "models/common/component.h"
#include "models/common/config_json.h"
#include "models/unet/unet_blocks.h"

namespace dtune::models {

struct UNet2DConditionConfig {
    int64_t in_channels = 4;
    int64_t out_channels = 4;
    int64_t conv_in_kernel = 3;
    int64_t conv_out_kernel = 3;
    bool center_input_sample = false;
    bool flip_sin_to_cos = true;
    double freq_shift = 0;
    std::vector<std::string> down_block_types;
    std::vector<std::string> up_block_types;
    std::vector<int64_t> block_out_channels;
    std::vector<int64_t> layers_per_block;              // per down block
    std::vector<int64_t> transformer_layers_per_block;  // per down block
    std::vector<int64_t> heads;                         // per down block
    std::vector<int64_t> cross_attention_dim;           // per down block
    std::vector<bool> only_cross_attention;             // per down block
    int64_t downsample_padding = 1;
    double mid_block_scale_factor = 1.0;
    int64_t norm_num_groups = 32;
    double norm_eps = 1e-5;
    bool use_linear_projection = false;
    bool upcast_attention = false;
    // SDXL micro-conditioning: "text_time" adds add_embedding(cat(text_embeds, sinusoids(time_ids))).
    bool text_time_embedding = false;
    int64_t addition_time_embed_dim = 0;
    int64_t projection_class_embeddings_input_dim = 0;

    // Parses and validates; UsageError/DataError naming the key for anything unsupported.
    static UNet2DConditionConfig from_json(const ConfigReader& config);
    int64_t time_embed_dim() const { return block_out_channels.at(0) * 4; }
    // Spatial size must be a multiple of this for the exact diffusers path (others are upsampled
    // to the skip's size).
    int64_t downsampling_factor() const;
};

// SDXL's extra conditioning; both undefined for SD 1.x/2.x.
struct UNetAddedCond {
    at::Tensor text_embeds;  // [B, pooled_dim]
    at::Tensor time_ids;     // [B, n] (SDXL: original size, crop top-left, target size = 6 values)
};

class UNet2DConditionModelImpl : public torch::nn::Module {
  public:
    explicit UNet2DConditionModelImpl(UNet2DConditionConfig config);

    // sample [B, in, H, W]; timestep [B] or [1] or a 0-dim tensor; encoder_hidden_states
    // [B, 77, cross_attention_dim]. Inputs are cast to the weights' dtype. Returns [B, out, H, W].
    at::Tensor forward(const at::Tensor& sample, const at::Tensor& timestep,
                       const at::Tensor& encoder_hidden_states, const UNetAddedCond& added = {});

    const UNet2DConditionConfig& config() const { return config_; }
    // The dtype the model computes in (its weights' dtype; the dense dtype of quantised weights).
    c10::ScalarType dtype() const { return conv_in_->dtype(); }
    // Recompute each ResNet and transformer block in backward instead of storing activations.
    // interval n > 1 checkpoints every n-th ResNet/transformer block in forward order (SimpleTuner's
    // gradient_checkpointing_interval): less recomputation, more activation memory than n = 1.
    void set_gradient_checkpointing(bool enabled, int64_t interval = 1);
    // How many ResNet and transformer blocks the last set_gradient_checkpointing checkpoints, of all.
    std::pair<int64_t, int64_t> checkpointed_blocks() const { return checkpointed_blocks_; }
    // Conv weights and the input sample in NHWC memory order (faster convolutions on tensor cores).
    void set_channels_last(bool enabled);

  private:
    at::Tensor embed_time(const at::Tensor& timestep, const UNetAddedCond& added, int64_t batch,
                          c10::ScalarType dtype);

    UNet2DConditionConfig config_;
    bool channels_last_ = false;
    std::pair<int64_t, int64_t> checkpointed_blocks_{0, 0};
    AdaptableConv2d conv_in_{nullptr}, conv_out_{nullptr};
    TimestepEmbedding time_embedding_{nullptr}, add_embedding_{nullptr};
    std::vector<DownBlock> down_blocks_;
    MidBlock mid_block_{nullptr};
    std::vector<UpBlock> up_blocks_;
    torch::nn::GroupNorm conv_norm_out_{nullptr};
};
TORCH_MODULE(UNet2DConditionModel);

// Builds the model from `<dir>/config.json` (or options.config) and loads
// `<dir>/diffusion_pytorch_model.safetensors` (the sharded index, or options.single_file) straight
// into options.dtype on options.device (see component.h).
UNet2DConditionModel load_unet(const std::filesystem::path& dir, const ComponentLoadOptions& options = {});
// The UNet of `dir`'s config with its weights from a quantised file (models/common/quantize.h's
// save_quantized; base_model_precision with quantized_model_cache) instead of the folder's weights.
UNet2DConditionModel load_quantized_unet(const std::filesystem::path& dir, const std::filesystem::path& file,
                                         const ComponentLoadOptions& options);

}  // namespace dtune::models
