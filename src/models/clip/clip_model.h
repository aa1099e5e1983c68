// transformers' CLIPModel (text tower + vision tower + both projections), for the CLIP score of
// validation images (evaluation_type clip, report/clip_score.h). Module names follow transformers'
// state dict (`text_model.*`, `vision_model.*`, `visual_projection.weight`,
// `text_projection.weight`, `logit_scale`), so openai/clip-vit-large-patch14-336 loads as saved.
//
// The vision tower: a patch convolution, a class token and learned positions, pre_layrnorm (sic),
// non-causal encoder layers, post_layernorm of the class token, then visual_projection. The text
// tower is the SDXL encoders' CLIPTextTransformer (causal; pooled at the EOS position).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/normalization.h>

#include <filesystem>
#include <string>
#include <vector>

#include "models/clip/clip_text_model.h"
#include "models/common/layers.h"

namespace dtune::models {

struct CLIPVisionConfig {
    int64_t hidden_size = 1024;
    int64_t intermediate_size = 4096;
    int64_t num_hidden_layers = 24;
    int64_t num_attention_heads = 16;
    int64_t image_size = 336;
    int64_t patch_size = 14;
    int64_t num_channels = 3;
    double layer_norm_eps = 1e-5;
    std::string hidden_act = "quick_gelu";
};

struct CLIPModelConfig {
    CLIPTextConfig text;
    CLIPVisionConfig vision;
    int64_t projection_dim = 768;
    // A transformers CLIPConfig config.json (text_config, vision_config, projection_dim); DataError
    // naming the file and key otherwise.
    static CLIPModelConfig from_json_file(const std::filesystem::path& path);
};

class CLIPVisionTransformerImpl : public torch::nn::Module {
  public:
    explicit CLIPVisionTransformerImpl(const CLIPVisionConfig& config);
    // pixel_values [B, 3, S, S] (S = image_size, normalised) -> pooled [B, hidden] (post_layernorm
    // of the class token).
    at::Tensor forward(const at::Tensor& pixel_values);

  private:
    CLIPVisionConfig config_;
    std::shared_ptr<torch::nn::Module> embeddings_, encoder_;
    at::Tensor class_embedding_;  // [hidden]
    Conv2d patch_embedding_{nullptr};
    Embedding position_embedding_{nullptr};
    torch::nn::LayerNorm pre_layrnorm_{nullptr}, post_layernorm_{nullptr};
    std::vector<CLIPEncoderLayer> layers_;
};
TORCH_MODULE(CLIPVisionTransformer);

class CLIPModelImpl : public torch::nn::Module {
  public:
    explicit CLIPModelImpl(const CLIPModelConfig& config);
    // transformers' get_image_features / get_text_features: the projected pooled outputs [B, P].
    at::Tensor image_features(const at::Tensor& pixel_values);
    at::Tensor text_features(const at::Tensor& input_ids);
    const CLIPModelConfig& config() const { return config_; }

  private:
    CLIPModelConfig config_;
    CLIPTextTransformer text_model_{nullptr};
    CLIPVisionTransformer vision_model_{nullptr};
    Linear visual_projection_{nullptr}, text_projection_{nullptr};
    at::Tensor logit_scale_;
};
TORCH_MODULE(CLIPModel);

// A transformers CLIPModel folder (config.json + model.safetensors), loaded strictly in float32 on
// `device`. DataError naming the folder when it is missing or is not a CLIPModel.
CLIPModel load_clip_model(const std::filesystem::path& dir, c10::Device device = c10::Device(c10::kCPU));

// CLIPImageProcessor's steps with the torchvision backend (what transformers uses where torchvision
// is installed, as SimpleTuner requires for CLIP evaluation): images [3, H, W] float in [0, 255] ->
// resize the shorter side to `size` (the longer one int(size · long / short)) with antialiased
// bicubic, center crop size×size (offsets rounded), rescale by 1/255 and normalise by CLIP's mean
// and std. Returns [3, size, size] float32.
at::Tensor clip_preprocess(const at::Tensor& image, int64_t size);

}  // namespace dtune::models
