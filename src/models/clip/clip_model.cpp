// CLIPModel (see clip_model.h).
#include "models/clip/clip_model.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/fs.h"
#include "models/common/weights.h"

namespace dtune::models {

namespace {

// The encoder-layer settings of the vision tower, in the form CLIPEncoderLayer takes.
CLIPTextConfig layer_config(const CLIPVisionConfig& v) {
    CLIPTextConfig c;
    c.hidden_size = v.hidden_size;
    c.intermediate_size = v.intermediate_size;
    c.num_attention_heads = v.num_attention_heads;
    c.layer_norm_eps = v.layer_norm_eps;
    c.hidden_act = v.hidden_act;
    return c;
}

torch::nn::LayerNorm layer_norm(int64_t dim, double eps) {
    return torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(eps));
}

}  // namespace

CLIPModelConfig CLIPModelConfig::from_json_file(const std::filesystem::path& path) {
    DTUNE_CHECK_AS(DataError, std::filesystem::is_regular_file(path),
                   "CLIP model config not found: ", path.string(),
                   "; point pretrained_evaluation_model_name_or_path at a CLIPModel folder (config.json + "
                   "model.safetensors)");
    const std::string text = fs::read_file(path);
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    DTUNE_CHECK_AS(DataError, !j.is_discarded() && j.is_object(), path.string(), " is not valid JSON");
    DTUNE_CHECK_AS(DataError, j.contains("text_config") && j.contains("vision_config"), path.string(),
                   " is not a CLIPModel config (no text_config / vision_config); point "
                   "pretrained_evaluation_model_name_or_path at e.g. openai/clip-vit-large-patch14-336");
    CLIPModelConfig c;
    c.text = CLIPTextConfig::from_json_text(text, path.string());
    const nlohmann::json& v = j.at("vision_config");
    const auto get_int = [&](const char* key, int64_t& into) {
        if (!v.contains(key) || v[key].is_null()) return;
        DTUNE_CHECK_AS(DataError, v[key].is_number_integer(), path.string(), ": vision_config.", key,
                       " must be an integer, got ", v[key].dump());
        into = v[key].get<int64_t>();
    };
    get_int("hidden_size", c.vision.hidden_size);
    get_int("intermediate_size", c.vision.intermediate_size);
    get_int("num_hidden_layers", c.vision.num_hidden_layers);
    get_int("num_attention_heads", c.vision.num_attention_heads);
    get_int("image_size", c.vision.image_size);
    get_int("patch_size", c.vision.patch_size);
    get_int("num_channels", c.vision.num_channels);
    if (v.contains("layer_norm_eps") && v["layer_norm_eps"].is_number())
        c.vision.layer_norm_eps = v["layer_norm_eps"];
    if (v.contains("hidden_act") && v["hidden_act"].is_string()) c.vision.hidden_act = v["hidden_act"];
    if (j.contains("projection_dim") && j["projection_dim"].is_number_integer())
        c.projection_dim = j["projection_dim"];
    DTUNE_CHECK_AS(DataError,
                   c.vision.hidden_size % c.vision.num_attention_heads == 0 && c.vision.patch_size > 0 &&
                       c.vision.image_size % c.vision.patch_size == 0,
                   path.string(), ": vision_config sizes do not fit (hidden_size ", c.vision.hidden_size,
                   ", heads ", c.vision.num_attention_heads, ", image_size ", c.vision.image_size,
                   ", patch_size ", c.vision.patch_size, ")");
    return c;
}

CLIPVisionTransformerImpl::CLIPVisionTransformerImpl(const CLIPVisionConfig& c) : config_(c) {
    embeddings_ = register_module("embeddings", std::make_shared<torch::nn::Module>());
    class_embedding_ = embeddings_->register_parameter("class_embedding", at::randn({c.hidden_size}));
    patch_embedding_ = embeddings_->register_module(
        "patch_embedding", Conv2d(torch::nn::Conv2dOptions(c.num_channels, c.hidden_size, c.patch_size)
                                      .stride(c.patch_size)
                                      .bias(false)));
    const int64_t patches = (c.image_size / c.patch_size) * (c.image_size / c.patch_size);
    position_embedding_ =
        embeddings_->register_module("position_embedding", Embedding(patches + 1, c.hidden_size));
    pre_layrnorm_ = register_module("pre_layrnorm", layer_norm(c.hidden_size, c.layer_norm_eps));
    encoder_ = register_module("encoder", std::make_shared<torch::nn::Module>());
    auto list = encoder_->register_module("layers", std::make_shared<torch::nn::Module>());
    for (int64_t i = 0; i < c.num_hidden_layers; ++i)
        layers_.push_back(
            list->register_module(std::to_string(i), CLIPEncoderLayer(layer_config(c), /*causal=*/false)));
    post_layernorm_ = register_module("post_layernorm", layer_norm(c.hidden_size, c.layer_norm_eps));
}

at::Tensor CLIPVisionTransformerImpl::forward(const at::Tensor& pixel_values) {
    const int64_t s = config_.image_size;
    DTUNE_CHECK(pixel_values.dim() == 4 && pixel_values.size(1) == config_.num_channels &&
                    pixel_values.size(2) == s && pixel_values.size(3) == s,
                "CLIP vision tower: pixel values ", pixel_values.sizes(), " are not [B, ",
                config_.num_channels, ", ", s, ", ", s, "]");
    const int64_t b = pixel_values.size(0);
    const at::Tensor patches =
        patch_embedding_->forward(pixel_values.to(patch_embedding_->dtype())).flatten(2).transpose(1, 2);
    const at::Tensor cls = class_embedding_.view({1, 1, -1}).expand({b, 1, config_.hidden_size});
    at::Tensor h = at::cat({cls, patches}, 1);  // [B, 1 + N, D]
    h = h + position_embedding_->weight.unsqueeze(0);
    h = pre_layrnorm_->forward(h);
    for (auto& layer : layers_) h = layer->forward(h);
    return post_layernorm_->forward(h.select(1, 0));  // [B, D]
}

CLIPModelImpl::CLIPModelImpl(const CLIPModelConfig& c) : config_(c) {
    text_model_ = register_module("text_model", CLIPTextTransformer(c.text));
    vision_model_ = register_module("vision_model", CLIPVisionTransformer(c.vision));
    visual_projection_ =
        register_module("visual_projection",
                        Linear(torch::nn::LinearOptions(c.vision.hidden_size, c.projection_dim).bias(false)));
    text_projection_ =
        register_module("text_projection",
                        Linear(torch::nn::LinearOptions(c.text.hidden_size, c.projection_dim).bias(false)));
    logit_scale_ = register_parameter("logit_scale", at::zeros({}));
}

at::Tensor CLIPModelImpl::image_features(const at::Tensor& pixel_values) {
    return visual_projection_->forward(vision_model_->forward(pixel_values));
}

at::Tensor CLIPModelImpl::text_features(const at::Tensor& input_ids) {
    return text_projection_->forward(
        text_model_->forward(input_ids, /*all_hidden_states=*/false).pooler_output);
}

CLIPModel load_clip_model(const std::filesystem::path& dir, c10::Device device) {
    DTUNE_CHECK_AS(DataError, std::filesystem::is_directory(dir),
                   "CLIP model folder not found: ", dir.string(),
                   "; download openai/clip-vit-large-patch14-336 (huggingface-cli download "
                   "openai/clip-vit-large-patch14-336 --local-dir clip-336) and point "
                   "pretrained_evaluation_model_name_or_path at it");
    const CLIPModelConfig config = CLIPModelConfig::from_json_file(dir / "config.json");
    CLIPModel model{nullptr};
    {
        UninitializedParameters scope(at::kFloat, device);  // the strict load fills every tensor
        model = CLIPModel(config);
    }
    LoadOptions load;
    load.dtype = at::kFloat;
    load.device = device;
    // transformers saves no position_ids (non-persistent); older files may hold them.
    load.rename = [](const std::string& key) { return key.ends_with("embeddings.position_ids") ? "" : key; };
    std::filesystem::path weights = dir / "model.safetensors";
    if (!std::filesystem::exists(weights) && std::filesystem::exists(dir / "model.safetensors.index.json"))
        weights = dir / "model.safetensors.index.json";
    load_weights(*model, io::WeightSource::open(weights), load, str("CLIP model from ", dir.string()));
    model->to(device);
    model->eval();
    return model;
}

at::Tensor clip_preprocess(const at::Tensor& image, int64_t size) {
    DTUNE_CHECK(image.dim() == 3 && image.size(0) == 3, "clip_preprocess: image ", image.sizes(),
                " is not [3, H, W]");
    const int64_t h = image.size(1), w = image.size(2);
    // The shorter side to `size`, the longer in proportion (truncated, as transformers computes it).
    const bool wide = w >= h;
    const int64_t short_side = wide ? h : w, long_side = wide ? w : h;
    const int64_t new_long = static_cast<int64_t>(static_cast<double>(size) * long_side / short_side);
    const int64_t out_h = wide ? size : new_long, out_w = wide ? new_long : size;
    at::Tensor x = image.to(at::kFloat).unsqueeze(0);  // [1, 3, H, W]
    if (out_h != h || out_w != w)
        x = at::_upsample_bicubic2d_aa(x, {out_h, out_w}, /*align_corners=*/false);  // torchvision's resize
    const int64_t top = static_cast<int64_t>((out_h - size) / 2.0),
                  left = static_cast<int64_t>((out_w - size) / 2.0);
    x = x.narrow(2, top, size).narrow(3, left, size).squeeze(0);  // [3, size, size]
    // Rescale (1/255) and normalise fused, as transformers does: (x - 255 mean) / (255 std).
    const at::Tensor mean = at::tensor({0.48145466f, 0.4578275f, 0.40821073f}).mul(255.0f).view({3, 1, 1});
    const at::Tensor std = at::tensor({0.26862954f, 0.26130258f, 0.27577711f}).mul(255.0f).view({3, 1, 1});
    return (x - mean.to(x.device())) / std.to(x.device());
}

}  // namespace dtune::models
