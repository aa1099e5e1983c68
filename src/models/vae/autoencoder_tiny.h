// diffusers' AutoencoderTiny (TAESD: madebyollin/taesd, taesdxl, taef1): a small convolutional
// autoencoder trained to match a model's VAE latents, used for cheap previews of the latents while
// sampling runs (validation_preview). Module names follow diffusers' state dict
// (`encoder.layers.N...`, `decoder.layers.N...`), so a diffusers AutoencoderTiny folder loads as is.
//
// Latents are the diffusion model's own (already multiplied by the big VAE's scaling_factor): TAESD
// was trained on them, and its own scaling_factor is 1.0. decode() returns images in [-1, 1] (the
// decoder's [0, 1] output mapped as diffusers does); encode() takes images in [-1, 1].
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <filesystem>
#include <vector>

#include "models/common/component.h"
#include "models/common/config_json.h"

namespace dtune::models {

struct AutoencoderTinyConfig {
    int64_t in_channels = 3;
    int64_t out_channels = 3;
    int64_t latent_channels = 4;
    std::vector<int64_t> encoder_block_out_channels{64, 64, 64, 64};
    std::vector<int64_t> decoder_block_out_channels{64, 64, 64, 64};
    std::vector<int64_t> num_encoder_blocks{1, 3, 3, 3};
    std::vector<int64_t> num_decoder_blocks{3, 3, 3, 1};
    int64_t upsampling_scaling_factor = 2;

    // act_fn must be relu and upsample_fn nearest (every published TAESD); others are refused.
    static AutoencoderTinyConfig from_json(const ConfigReader& config);
};

// conv-act-conv-act-conv plus a skip (1x1 conv when the width changes), then ReLU.
class AutoencoderTinyBlockImpl : public torch::nn::Module {
  public:
    AutoencoderTinyBlockImpl(int64_t in_channels, int64_t out_channels);
    at::Tensor forward(const at::Tensor& x);

  private:
    torch::nn::Sequential conv_;
    torch::nn::AnyModule skip_;  // empty: identity
};
TORCH_MODULE(AutoencoderTinyBlock);

class AutoencoderTinyImpl : public torch::nn::Module {
  public:
    explicit AutoencoderTinyImpl(const AutoencoderTinyConfig& config);
    // Latents [B, latent_channels, h, w] -> images [B, out_channels, h·2^k, w·2^k] in [-1, 1].
    at::Tensor decode(const at::Tensor& latents);
    // Images [B, in_channels, H, W] in [-1, 1] -> latents [B, latent_channels, H / 2^k, W / 2^k].
    at::Tensor encode(const at::Tensor& images);
    const AutoencoderTinyConfig& config() const { return config_; }

  private:
    AutoencoderTinyConfig config_;
    torch::nn::Sequential encoder_layers_, decoder_layers_;
};
TORCH_MODULE(AutoencoderTiny);

// A diffusers AutoencoderTiny folder (config.json + diffusion_pytorch_model.safetensors), loaded
// strictly; errors name the folder.
AutoencoderTiny load_autoencoder_tiny(const std::filesystem::path& dir,
                                      const ComponentLoadOptions& options = {});

}  // namespace dtune::models
