// transformers' T5EncoderModel, T5 v1.1 flavour: Flux.1's text_encoder_2 (google/t5-v1_1-xxl:
// d_model 4096, 24 blocks of 64 heads × d_kv 64, d_ff 10240). Module names equal transformers'
// state-dict keys (`shared.weight`, `encoder.block.N.layer.0.SelfAttention.q.weight`,
// `encoder.block.N.layer.1.DenseReluDense.wi_0.weight`, `encoder.final_layer_norm.weight`, ...), so
// a transformers folder loads name for name.
//
// Structure: token table `shared` (transformers ties `encoder.embed_tokens` to it and saves one of
// the two keys; the loader accepts either) -> N pre-norm blocks [RMS norm -> self-attention ->
// residual, RMS norm -> gated-GELU feed-forward -> residual] -> final RMS norm. No biases anywhere,
// no absolute positions: block 0 owns a relative-position bias table (num_buckets × heads, the
// bucketing is transformers' `_relative_position_bucket`, bidirectional) whose [1, H, L, L] bias is
// computed once and added to the scores of every block.
//
// Numerics follow transformers op for op (on the CPU the tiny test model matches it bit for bit in
// float32, bfloat16 and float16; the test allows 1e-5 relative in float32):
//   - attention is at::scaled_dot_product_attention with scale 1.0 (T5 never scales q·k by
//     1/sqrt(d_kv)) and the position bias as the float attn_mask; a padding mask replaces the bias
//     of masked keys by the dtype's lowest value, as transformers' sdpa path does;
//   - the RMS norm (no mean, no bias) takes the mean of squares in float32 and casts back to the
//     weight's dtype when that is half/bf16, as T5LayerNorm does;
//   - the gate is the tanh GELU written op for op as transformers' gelu_new (the only activation
//     of "gated-gelu"), so bfloat16 runs round where transformers rounds;
//   - float16 loads keep every `wo` in float32 and clamp the hidden states after each sub-layer,
//     as transformers does (T5 v1.1 overflows float16 in `wo`); bfloat16 needs neither.
// q, k, v, o, wi_0, wi_1 and wo are AdaptableLinear so adapters can target them. Dropout is
// ignored (inference and frozen-encoder training only).
#pragma once

#include <torch/nn/module.h>

#include <filesystem>
#include <vector>

#include "models/common/adaptable.h"
#include "models/common/component.h"
#include "models/common/config_json.h"
#include "models/common/layers.h"

namespace dtune::models {

struct T5Config {
    int64_t vocab_size = 32128;
    int64_t d_model = 4096;
    int64_t d_kv = 64;
    int64_t d_ff = 10240;
    int64_t num_layers = 24;
    int64_t num_heads = 64;
    int64_t relative_attention_num_buckets = 32;
    int64_t relative_attention_max_distance = 128;
    double layer_norm_epsilon = 1e-6;

    // A transformers T5Config config.json. The sizes are required (DataError naming the file and
    // key); feed_forward_proj must be "gated-gelu" (T5 v1.1) and model_type, when set, "t5": other
    // values are a UsageError naming the key.
    static T5Config from_json(const ConfigReader& config);
};

// RMS norm: weight · x / sqrt(mean(x²) + eps), mean in float32 (see the header comment).
class T5LayerNormImpl : public torch::nn::Module {
  public:
    T5LayerNormImpl(int64_t dim, double eps);
    at::Tensor forward(const at::Tensor& x);
    at::Tensor weight;  // [dim]

  private:
    double eps_;
};
TORCH_MODULE(T5LayerNorm);

class T5AttentionImpl : public torch::nn::Module {
  public:
    T5AttentionImpl(const T5Config& config, bool has_relative_attention_bias);
    // The relative-position bias [1, H, L, L] in the table's dtype (block 0 only).
    at::Tensor compute_bias(int64_t length);
    // x [B, L, D], bias [1 or B, H, L, L] (position bias, padding folded in) -> [B, L, D].
    at::Tensor forward(const at::Tensor& x, const at::Tensor& bias);

  private:
    T5Config config_;
    AdaptableLinear q_{nullptr}, k_{nullptr}, v_{nullptr}, o_{nullptr};
    Embedding relative_attention_bias_{nullptr};  // [num_buckets, H]
};
TORCH_MODULE(T5Attention);

// wo(gelu_new(wi_0(x)) · wi_1(x)), the product cast to wo's dtype (float32 in a float16 model).
class T5DenseGatedActDenseImpl : public torch::nn::Module {
  public:
    T5DenseGatedActDenseImpl(int64_t d_model, int64_t d_ff);
    at::Tensor forward(const at::Tensor& x);

  private:
    AdaptableLinear wi_0_{nullptr}, wi_1_{nullptr}, wo_{nullptr};
};
TORCH_MODULE(T5DenseGatedActDense);

// `layer.0` (layer_norm + SelfAttention) and `layer.1` (layer_norm + DenseReluDense).
class T5BlockImpl : public torch::nn::Module {
  public:
    T5BlockImpl(const T5Config& config, bool has_relative_attention_bias);
    at::Tensor forward(const at::Tensor& x, const at::Tensor& bias);  // [B, L, D] -> [B, L, D]
    T5Attention attention{nullptr};

  private:
    T5LayerNorm attention_norm_{nullptr}, ff_norm_{nullptr};
    T5DenseGatedActDense ff_{nullptr};
};
TORCH_MODULE(T5Block);

class T5EncoderModelImpl : public torch::nn::Module {
  public:
    explicit T5EncoderModelImpl(const T5Config& config);
    // input_ids [B, L] int64; attention_mask [B, L] (1 keep, 0 padding) or undefined (every token
    // attends to every token, as Flux's pipeline calls it) -> last_hidden_state [B, L, d_model] in
    // the model's dtype.
    at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask = {});
    const T5Config& config() const { return config_; }

  private:
    T5Config config_;
    Embedding shared_{nullptr};  // [vocab, D]
    std::shared_ptr<torch::nn::Module> encoder_;
    std::vector<T5Block> blocks_;
    T5LayerNorm final_layer_norm_{nullptr};
};
TORCH_MODULE(T5EncoderModel);

// A transformers T5EncoderModel folder (config.json + model.safetensors or a sharded
// model.safetensors.index.json, e.g. <flux model>/text_encoder_2), loaded strictly in options.dtype
// on options.device. options.config replaces config.json; options.single_file takes the weights
// from that one .safetensors file instead (ComfyUI's t5xxl_fp16 / t5xxl_fp8_e4m3fn keep transformers'
// key names; other dtypes are converted), with the config still from the folder. DataError naming
// the folder or file when files or tensors are missing.
T5EncoderModel load_t5_encoder(const std::filesystem::path& dir, const ComponentLoadOptions& options = {});

}  // namespace dtune::models
