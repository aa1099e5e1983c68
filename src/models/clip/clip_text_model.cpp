// CLIP text encoder modules and config parsing (behaviour documented in clip_text_model.h).
#include "models/clip/clip_text_model.h"

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"

namespace dtune::models {
using nlohmann::json;

CLIPTextConfig CLIPTextConfig::from_json_file(const std::filesystem::path& path) {
    DTUNE_CHECK_AS(DataError, std::filesystem::is_regular_file(path),
                   "text encoder config not found: ", path.string(),
                   "; a text encoder folder needs the transformers config.json");
    return from_json_text(fs::read_file(path), path.string());
}

CLIPTextConfig CLIPTextConfig::from_json_text(const std::string& text, const std::string& source) {
    json j;
    try {
        j = json::parse(text);
    } catch (const json::exception& e) {
        throw DataError(str("text encoder config ", source, " is not valid JSON (", e.what(),
                            "); re-download config.json"));
    }
    CLIPTextConfig c;
    if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty())
        c.with_projection = j["architectures"][0].get<std::string>() == "CLIPTextModelWithProjection";
    if (j.contains("text_config") && j["text_config"].is_object()) j = j["text_config"];  // a full CLIPConfig
    const auto get_int = [&](const char* key, int64_t& into) {
        if (!j.contains(key) || j[key].is_null()) return;
        DTUNE_CHECK_AS(DataError, j[key].is_number_integer(), "text encoder config ", source, ": \"", key,
                       "\" must be an integer, got ", j[key].dump(), "; fix config.json");
        into = j[key].get<int64_t>();
    };
    get_int("vocab_size", c.vocab_size);
    get_int("hidden_size", c.hidden_size);
    get_int("intermediate_size", c.intermediate_size);
    get_int("num_hidden_layers", c.num_hidden_layers);
    get_int("num_attention_heads", c.num_attention_heads);
    get_int("max_position_embeddings", c.max_position_embeddings);
    get_int("projection_dim", c.projection_dim);
    get_int("eos_token_id", c.eos_token_id);
    get_int("bos_token_id", c.bos_token_id);
    get_int("pad_token_id", c.pad_token_id);
    if (j.contains("layer_norm_eps") && j["layer_norm_eps"].is_number())
        c.layer_norm_eps = j["layer_norm_eps"];
    if (j.contains("hidden_act") && j["hidden_act"].is_string()) c.hidden_act = j["hidden_act"];
    const std::string& act = c.hidden_act;
    DTUNE_CHECK_AS(DataError,
                   act == "quick_gelu" || act == "gelu" || act == "gelu_new" || act == "gelu_pytorch_tanh",
                   "text encoder config ", source, ": hidden_act \"", act,
                   "\" is not supported; CLIP uses quick_gelu or gelu");
    DTUNE_CHECK_AS(
        DataError,
        c.hidden_size > 0 && c.num_attention_heads > 0 && c.hidden_size % c.num_attention_heads == 0,
        "text encoder config ", source, ": hidden_size ", c.hidden_size,
        " is not a positive multiple of num_attention_heads ", c.num_attention_heads, "; fix config.json");
    DTUNE_CHECK_AS(DataError, c.num_hidden_layers >= 1, "text encoder config ", source,
                   ": num_hidden_layers ", c.num_hidden_layers, " must be >= 1");
    return c;
}

CLIPAttentionImpl::CLIPAttentionImpl(int64_t dim, int64_t heads, bool causal)
    : heads_(heads), causal_(causal) {
    k_proj_ = register_module("k_proj", Linear(dim, dim));
    v_proj_ = register_module("v_proj", Linear(dim, dim));
    q_proj_ = register_module("q_proj", Linear(dim, dim));
    out_proj_ = register_module("out_proj", Linear(dim, dim));
}

at::Tensor CLIPAttentionImpl::forward(const at::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), d = x.size(2);
    const auto heads = [&](const at::Tensor& y) {
        return y.view({b, t, heads_, d / heads_}).transpose(1, 2);
    };
    const at::Tensor q = heads(q_proj_->forward(x));  // [B, H, T, D/H]
    const at::Tensor k = heads(k_proj_->forward(x));
    const at::Tensor v = heads(v_proj_->forward(x));
    // Default scale 1/sqrt(D/H) is CLIP's; the causal mask is the only mask SDXL uses.
    const at::Tensor o = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                                          /*is_causal=*/causal_);  // [B, H, T, D/H]
    return out_proj_->forward(o.transpose(1, 2).reshape({b, t, d}));
}

CLIPMLPImpl::CLIPMLPImpl(int64_t dim, int64_t hidden, std::string act) : act_(std::move(act)) {
    fc1_ = register_module("fc1", Linear(dim, hidden));
    fc2_ = register_module("fc2", Linear(hidden, dim));
}

at::Tensor CLIPMLPImpl::forward(const at::Tensor& x) {
    at::Tensor h = fc1_->forward(x);
    if (act_ == "quick_gelu") {
        h = h * at::sigmoid(h * 1.702);
    } else if (act_ == "gelu") {
        h = at::gelu(h);
    } else {  // gelu_new / gelu_pytorch_tanh
        h = at::gelu(h, "tanh");
    }
    return fc2_->forward(h);
}

CLIPEncoderLayerImpl::CLIPEncoderLayerImpl(const CLIPTextConfig& c, bool causal) {
    const auto ln = [&] {
        return torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps));
    };
    self_attn_ = register_module("self_attn", CLIPAttention(c.hidden_size, c.num_attention_heads, causal));
    layer_norm1_ = register_module("layer_norm1", ln());
    mlp_ = register_module("mlp", CLIPMLP(c.hidden_size, c.intermediate_size, c.hidden_act));
    layer_norm2_ = register_module("layer_norm2", ln());
}

at::Tensor CLIPEncoderLayerImpl::forward(const at::Tensor& x) {
    at::Tensor h = x + self_attn_->forward(layer_norm1_->forward(x));
    return h + mlp_->forward(layer_norm2_->forward(h));
}

CLIPTextTransformerImpl::CLIPTextTransformerImpl(const CLIPTextConfig& c) : config_(c) {
    embeddings_ = register_module("embeddings", std::make_shared<torch::nn::Module>());
    token_embedding_ =
        embeddings_->register_module("token_embedding", Embedding(c.vocab_size, c.hidden_size));
    position_embedding_ = embeddings_->register_module("position_embedding",
                                                       Embedding(c.max_position_embeddings, c.hidden_size));
    encoder_ = register_module("encoder", std::make_shared<torch::nn::Module>());
    torch::nn::ModuleList layers;
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
        layers_.push_back(CLIPEncoderLayer(c));
        layers->push_back(layers_.back());
    }
    encoder_->register_module("layers", layers);
    final_layer_norm_ = register_module(
        "final_layer_norm",
        torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps)));
}

at::Tensor clip_eos_positions(const at::Tensor& input_ids, int64_t eos_token_id) {
    if (eos_token_id == 2) return input_ids.to(at::kInt).argmax(-1);  // legacy: EOS has the largest id
    // argmax over a 0/1 int mask returns the first maximal index: the first EOS.
    return input_ids.eq(eos_token_id).to(at::kInt).argmax(-1);  // [B]
}

CLIPTextOutput CLIPTextTransformerImpl::forward(const at::Tensor& input_ids, bool all_hidden_states) {
    DTUNE_CHECK_AS(UsageError, input_ids.dim() == 2,
                   "CLIP text encoder input_ids must be [batch, tokens], got ", input_ids.sizes());
    const int64_t t = input_ids.size(1);
    DTUNE_CHECK_AS(UsageError, t >= 1 && t <= config_.max_position_embeddings, "CLIP text encoder got ", t,
                   " tokens; it has ", config_.max_position_embeddings,
                   " positions (tokenize with truncation, or use the chunked long-prompt encoding)");
    const at::Tensor ids = input_ids.to(token_embedding_->weight.device(), at::kLong);
    const at::Tensor positions = at::arange(t, ids.options());
    at::Tensor h = token_embedding_->forward(ids) + position_embedding_->forward(positions);  // [B, T, D]
    CLIPTextOutput out;
    out.hidden_states.push_back(h);
    for (auto& layer : layers_) {
        h = layer->forward(h);
        out.hidden_states.push_back(h);
        if (!all_hidden_states && out.hidden_states.size() > 2)
            out.hidden_states.erase(out.hidden_states.begin());
    }
    out.last_hidden_state = final_layer_norm_->forward(h);
    const at::Tensor rows = at::arange(ids.size(0), ids.options());
    out.pooler_output =
        out.last_hidden_state.index({rows, clip_eos_positions(ids, config_.eos_token_id)});  // [B, D]
    return out;
}

CLIPTextModelImpl::CLIPTextModelImpl(const CLIPTextConfig& config) {
    text_model = register_module("text_model", CLIPTextTransformer(config));
}

CLIPTextOutput CLIPTextModelImpl::forward(const at::Tensor& input_ids, bool all_hidden_states) {
    return text_model->forward(input_ids, all_hidden_states);
}

CLIPTextModelWithProjectionImpl::CLIPTextModelWithProjectionImpl(const CLIPTextConfig& config) {
    text_model = register_module("text_model", CLIPTextTransformer(config));
    text_projection = register_module(
        "text_projection",
        Linear(torch::nn::LinearOptions(config.hidden_size, config.projection_dim).bias(false)));
}

CLIPTextOutput CLIPTextModelWithProjectionImpl::forward(const at::Tensor& input_ids, bool all_hidden_states) {
    CLIPTextOutput out = text_model->forward(input_ids, all_hidden_states);
    out.text_embeds = text_projection->forward(out.pooler_output);  // [B, P]
    return out;
}

}  // namespace dtune::models
