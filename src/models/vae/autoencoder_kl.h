// AutoencoderKL (the SD/SDXL VAE) built from a diffusers `vae/config.json`: encoder -> quant_conv
// -> diagonal Gaussian posterior; post_quant_conv -> decoder. Child names equal diffusers' keys.
//
// dtype: encode/decode run in the weights' dtype and return the input's dtype. `force_upcast`
// (SDXL's VAE overflows in fp16) makes load_autoencoder_kl keep fp32 weights when fp16 is asked.
// Tiled encode/decode run the encoder/decoder on overlapping tiles one at a time and blend the
// overlaps linearly (as diffusers does), so peak activation memory depends on the tile size, not
// on the image size.
#pragma once

#include <ATen/core/Generator.h>
#include <torch/nn/module.h>

#include <filesystem>
#include <functional>
#include <optional>
#include <vector>

#include "models/common/component.h"
#include "models/common/config_json.h"
#include "models/vae/vae_coder.h"

namespace dtune::models {

struct AutoencoderKLConfig {
    int64_t in_channels = 3;
    int64_t out_channels = 3;
    int64_t latent_channels = 4;
    std::vector<int64_t> block_out_channels;
    int64_t layers_per_block = 1;
    int64_t norm_num_groups = 32;
    int64_t sample_size = 512;
    double scaling_factor = 0.18215;
    double shift_factor = 0.0;  // null in the config means 0
    bool force_upcast = true;
    bool use_quant_conv = true;
    bool use_post_quant_conv = true;
    bool mid_block_add_attention = true;

    static AutoencoderKLConfig from_json(const ConfigReader& config);
    int64_t downsampling_factor() const { return int64_t{1} << (block_out_channels.size() - 1); }
};

// The encoder's output distribution. logvar is clamped to [-30, 20] as in diffusers.
struct DiagonalGaussian {
    at::Tensor mean;    // [B, latent, h, w]
    at::Tensor logvar;  // [B, latent, h, w]
    at::Tensor std;
    at::Tensor sample(std::optional<at::Generator> generator = std::nullopt) const;
    at::Tensor mode() const { return mean; }
};

struct VAETileOptions {
    int64_t tile_sample_size = 512;  // tile edge in pixels (latent tile = this / downsampling factor)
    double overlap = 0.25;           // fraction of a tile shared with its neighbour
};

class AutoencoderKLImpl : public torch::nn::Module {
  public:
    explicit AutoencoderKLImpl(AutoencoderKLConfig config);

    DiagonalGaussian encode(const at::Tensor& image);  // image [B, 3, H, W] in [-1, 1]
    at::Tensor decode(const at::Tensor& latents);      // unscaled latents -> [B, 3, H, W]
    DiagonalGaussian encode_tiled(const at::Tensor& image, const VAETileOptions& tiles);
    at::Tensor decode_tiled(const at::Tensor& latents, const VAETileOptions& tiles);

    // (z - shift_factor) * scaling_factor: what the UNet is trained on.
    at::Tensor scale_latents(const at::Tensor& z) const;
    at::Tensor unscale_latents(const at::Tensor& z) const;
    const AutoencoderKLConfig& config() const { return config_; }

  private:
    at::Tensor encode_moments(const at::Tensor& x);
    at::Tensor decode_raw(const at::Tensor& z);
    DiagonalGaussian posterior(const at::Tensor& moments, c10::ScalarType out_dtype) const;

    AutoencoderKLConfig config_;
    VAEEncoder encoder_{nullptr};
    VAEDecoder decoder_{nullptr};
    Conv2d quant_conv_{nullptr}, post_quant_conv_{nullptr};
};
TORCH_MODULE(AutoencoderKL);

// Builds from `<dir>/config.json` (or options.config) and loads the weights (as load_unet). With force_upcast
// and dtype fp16 the weights stay fp32 (logged), matching diffusers pipelines' upcast of the SDXL VAE.
// options.single_file: the ldm-layout VAE of an SD/SDXL checkpoint (first_stage_model.), of a ComfyUI
// Flux checkpoint (vae.) or a VAE file on its own (Black Forest Labs' ae.safetensors, no prefix), or a
// VAE file in diffusers' layout; a file whose latent channels differ from the config's is a DataError.
AutoencoderKL load_autoencoder_kl(const std::filesystem::path& dir, const ComponentLoadOptions& options = {});

// Runs fn over overlapping tiles of x [B, C, H, W] and blends them (exposed for tests). The
// output of fn on a tile of size t must be of size t * scale; stride = tile * (1 - overlap).
at::Tensor run_tiled(const at::Tensor& x, int64_t tile, double overlap, double scale,
                     const std::function<at::Tensor(const at::Tensor&)>& fn);

}  // namespace dtune::models
