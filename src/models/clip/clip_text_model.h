// CLIP text encoders as transformers defines them: CLIPTextModel (SDXL's text_encoder) and
// CLIPTextModelWithProjection (text_encoder_2), driven by a transformers `config.json`.
//
// Parameter names equal transformers' checkpoint keys with the "text_model." prefix
// ("text_model.encoder.layers.0.self_attn.q_proj.weight", "text_projection.weight"), so both
// classes load transformers' safetensors name for name. (transformers >= 5 saves CLIPTextModel
// without the prefix; load_clip_text_encoder() adds it, see clip_loading.h.)
//
// Forward: token + position embeddings -> pre-LN transformer layers with a causal mask (attention
// through at::scaled_dot_product_attention) -> final layer norm. Outputs every hidden state
// (hidden_states[0] = embeddings, [i] = output of layer i; SDXL uses [-2], the penultimate, which
// is NOT final-normed) and the pooled state at the EOS position:
//   - config eos_token_id != 2: the first position whose id equals eos_token_id;
//   - config eos_token_id == 2 (legacy configs, e.g. the real SDXL ones): argmax of the ids,
//     which is where EOS (49407, the largest id) sits for CLIP tokenizers.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "models/common/layers.h"

namespace dtune::models {

struct CLIPTextConfig {
    int64_t vocab_size = 49408;
    int64_t hidden_size = 768;
    int64_t intermediate_size = 3072;
    int64_t num_hidden_layers = 12;
    int64_t num_attention_heads = 12;
    int64_t max_position_embeddings = 77;
    int64_t projection_dim = 768;
    double layer_norm_eps = 1e-5;
    std::string hidden_act = "quick_gelu";  // quick_gelu | gelu | gelu_new / gelu_pytorch_tanh
    int64_t eos_token_id = 2;
    int64_t bos_token_id = 0;
    int64_t pad_token_id = 1;
    bool with_projection = false;  // architectures[0] == "CLIPTextModelWithProjection"

    // Parses a transformers config.json (also a CLIPConfig with a "text_config" block). Throws
    // DataError naming the file and key on missing/invalid values.
    static CLIPTextConfig from_json_file(const std::filesystem::path& path);
    static CLIPTextConfig from_json_text(const std::string& text, const std::string& source);
};

struct CLIPTextOutput {
    at::Tensor last_hidden_state;           // [B, T, D], final-normed
    at::Tensor pooler_output;               // [B, D] at the EOS position
    at::Tensor text_embeds;                 // [B, P] projected pooled state (WithProjection only)
    std::vector<at::Tensor> hidden_states;  // num_hidden_layers + 1 tensors [B, T, D]
};

class CLIPAttentionImpl : public torch::nn::Module {
  public:
    // causal: the text encoder's mask; false for the vision tower (every patch sees every patch).
    CLIPAttentionImpl(int64_t dim, int64_t heads, bool causal = true);
    at::Tensor forward(const at::Tensor& x);  // self-attention, [B, T, D] -> [B, T, D]

  private:
    int64_t heads_;
    bool causal_;
    Linear q_proj_{nullptr}, k_proj_{nullptr}, v_proj_{nullptr}, out_proj_{nullptr};
};
TORCH_MODULE(CLIPAttention);

class CLIPMLPImpl : public torch::nn::Module {
  public:
    CLIPMLPImpl(int64_t dim, int64_t hidden, std::string act);
    at::Tensor forward(const at::Tensor& x);

  private:
    std::string act_;
    Linear fc1_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(CLIPMLP);

class CLIPEncoderLayerImpl : public torch::nn::Module {
  public:
    explicit CLIPEncoderLayerImpl(const CLIPTextConfig& config, bool causal = true);
    at::Tensor forward(const at::Tensor& x);

  private:
    CLIPAttention self_attn_{nullptr};
    torch::nn::LayerNorm layer_norm1_{nullptr}, layer_norm2_{nullptr};
    CLIPMLP mlp_{nullptr};
};
TORCH_MODULE(CLIPEncoderLayer);

// transformers' CLIPTextTransformer: registered as "text_model" by the two public classes.
class CLIPTextTransformerImpl : public torch::nn::Module {
  public:
    explicit CLIPTextTransformerImpl(const CLIPTextConfig& config);
    // input_ids [B, T] int64, T <= max_position_embeddings. `all_hidden_states` = false keeps
    // only the last two layer outputs in hidden_states (enough for [-1]/[-2]) to save memory.
    CLIPTextOutput forward(const at::Tensor& input_ids, bool all_hidden_states = true);
    const CLIPTextConfig& config() const { return config_; }

  private:
    CLIPTextConfig config_;
    std::shared_ptr<torch::nn::Module> embeddings_;  // holds token_/position_embedding
    Embedding token_embedding_{nullptr}, position_embedding_{nullptr};
    std::shared_ptr<torch::nn::Module> encoder_;  // holds the `layers` list
    std::vector<CLIPEncoderLayer> layers_;
    torch::nn::LayerNorm final_layer_norm_{nullptr};
};
TORCH_MODULE(CLIPTextTransformer);

// Position of the pooled token per row of input_ids [B, T] under the config's rule (see above).
at::Tensor clip_eos_positions(const at::Tensor& input_ids, int64_t eos_token_id);

class CLIPTextModelImpl : public torch::nn::Module {
  public:
    explicit CLIPTextModelImpl(const CLIPTextConfig& config);
    CLIPTextOutput forward(const at::Tensor& input_ids, bool all_hidden_states = true);
    const CLIPTextConfig& config() const { return text_model->config(); }
    CLIPTextTransformer text_model{nullptr};
};
TORCH_MODULE(CLIPTextModel);

class CLIPTextModelWithProjectionImpl : public torch::nn::Module {
  public:
    explicit CLIPTextModelWithProjectionImpl(const CLIPTextConfig& config);
    CLIPTextOutput forward(const at::Tensor& input_ids, bool all_hidden_states = true);
    const CLIPTextConfig& config() const { return text_model->config(); }
    CLIPTextTransformer text_model{nullptr};
    Linear text_projection{nullptr};  // [P, D], no bias
};
TORCH_MODULE(CLIPTextModelWithProjection);

// Loading CLIP text encoders (defined in sdxl_text_encoders.cpp; Flux reads CLIP-L through them too).

struct TextEncoderLoadOptions {
    std::optional<c10::ScalarType> dtype;  // nullopt: float32
    std::optional<c10::Device> device;     // nullopt: CPU
    // The weights from this one .safetensors file instead of the folder's (config.json still from the
    // folder): transformers' key names under the prefix clip_text_file_prefix finds, e.g. ComfyUI's
    // clip_l.safetensors; other dtypes are converted.
    std::optional<std::filesystem::path> single_file;
};

// Checkpoint key -> module name for transformers CLIP text checkpoints: adds the "text_model."
// prefix that transformers >= 5 omits for CLIPTextModel and drops the non-persistent
// "position_ids" buffer that older checkpoints carry. Returns "" for dropped keys.
std::string clip_text_key_to_module(const std::string& key);

// The prefix under which a single file holds a transformers CLIP text model, found from its first
// layer's q_proj key with any "text_model." stripped: "" for ComfyUI's clip_l.safetensors
// ("text_model.encoder...") and transformers' own files, "transformer." / "clip_l.transformer." /
// "text_encoders.clip_l.transformer." for ComfyUI's saved CLIPs and checkpoints that embed CLIP-L
// ("cond_stage_model.transformer." / "conditioner.embedders.0.transformer." in SD ones). Where a file
// holds several (SD3's clip_l and clip_g), the one naming clip_l. nullopt when there is none; DataError
// naming the file when several remain.
std::optional<std::string> clip_text_file_prefix(const std::vector<std::string>& keys,
                                                 const std::string& origin);

// A transformers text encoder folder (config.json + model.safetensors or sharded index).
// Throws DataError naming the folder on missing files, wrong class, or missing/unexpected keys.
CLIPTextModel load_clip_text_model(const std::filesystem::path& dir,
                                   const TextEncoderLoadOptions& options = {});
CLIPTextModelWithProjection load_clip_text_model_with_projection(const std::filesystem::path& dir,
                                                                 const TextEncoderLoadOptions& options = {});

}  // namespace dtune::models
