// T5 v1.1 encoder (behaviour and numerics documented in t5_encoder.h).
#include "models/t5/t5_encoder.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/autograd.h>

#include <cmath>
#include <limits>
#include <numbers>

#include "core/error.h"
#include "models/common/weights.h"

namespace dtune::models {
namespace {

// transformers' T5Attention._relative_position_bucket, bidirectional (the encoder's): `relative`
// (key - query) [L, L] int64 -> bucket ids [L, L]. Half the buckets per direction; within each,
// distances below max_exact get one bucket each, longer ones log-spaced buckets up to
// max_distance (float32 arithmetic, as transformers computes it).
at::Tensor relative_position_bucket(const at::Tensor& relative, int64_t num_buckets, int64_t max_distance) {
    const int64_t half = num_buckets / 2;
    const int64_t max_exact = half / 2;
    const at::Tensor buckets = relative.gt(0).to(at::kLong) * half;
    const at::Tensor distance = relative.abs();
    // log(0) = -inf at distance 0 only, which the `where` below never selects.
    at::Tensor large =
        max_exact +
        (at::log(distance.to(at::kFloat) / max_exact) /
         std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)) * (half - max_exact))
            .to(at::kLong);
    large = at::clamp_max(large, half - 1);
    return buckets + at::where(distance.lt(max_exact), distance, large);
}

// torch.finfo(dtype).min: the additive "minus infinity" transformers puts on masked keys.
double lowest(at::ScalarType dtype) {
    double value = 0.0;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "t5_lowest", [&] {
        value = static_cast<double>(std::numeric_limits<scalar_t>::lowest());
    });
    return value;
}

// transformers' T5Block keeps float16 hidden states finite after each sub-layer (a no-op otherwise).
at::Tensor clamp_float16(const at::Tensor& h) {
    if (h.scalar_type() != at::kHalf) return h;
    constexpr double kMax = 65504.0;                                           // torch.finfo(float16).max
    const at::Tensor limit = at::where(h.isinf().any(), kMax - 1000.0, kMax);  // no host sync
    return at::clamp(h, -limit, limit);
}

// transformers' gelu_new, op for op: in bfloat16 each step rounds, and at::gelu(x, "tanh") (one
// float-internal kernel) would move the outputs by about one bf16 step from transformers'.
at::Tensor gelu_new(const at::Tensor& x) {
    const double k = std::sqrt(2.0 / std::numbers::pi);
    return 0.5 * x * (1.0 + at::tanh(k * (x + 0.044715 * at::pow(x, 3.0))));
}

AdaptableLinear linear(int64_t in, int64_t out) {
    return AdaptableLinear(torch::nn::LinearOptions(in, out).bias(false));
}

}  // namespace

T5Config T5Config::from_json(const ConfigReader& c) {
    if (c.has("model_type")) c.expect_value("model_type", "t5");
    // transformers' default is "relu" (T5 v1.0), so an absent key is refused too.
    if (c.get_string("feed_forward_proj", "relu") != "gated-gelu")
        c.unsupported("feed_forward_proj",
                      "only \"gated-gelu\" (T5 v1.1, e.g. google/t5-v1_1-xxl as Flux's text_encoder_2) is "
                      "implemented");
    T5Config v;
    v.vocab_size = c.require_int("vocab_size");
    v.d_model = c.require_int("d_model");
    v.d_kv = c.require_int("d_kv");
    v.d_ff = c.require_int("d_ff");
    v.num_layers = c.require_int("num_layers");
    v.num_heads = c.require_int("num_heads");
    v.relative_attention_num_buckets = c.get_int("relative_attention_num_buckets", 32);
    v.relative_attention_max_distance = c.get_int("relative_attention_max_distance", 128);
    v.layer_norm_epsilon = c.get_double("layer_norm_epsilon", 1e-6);
    DTUNE_CHECK_AS(
        DataError,
        v.vocab_size > 0 && v.d_model > 0 && v.d_kv > 0 && v.d_ff > 0 && v.num_layers > 0 && v.num_heads > 0,
        c.origin(),
        ": vocab_size, d_model, d_kv, d_ff, num_layers and num_heads must be positive; fix "
        "config.json");
    // Fewer than 4 buckets leaves no exact bucket per direction (transformers would divide by zero).
    DTUNE_CHECK_AS(DataError,
                   v.relative_attention_num_buckets >= 4 &&
                       v.relative_attention_max_distance > v.relative_attention_num_buckets / 4,
                   c.origin(), ": relative_attention_num_buckets ", v.relative_attention_num_buckets,
                   " must be >= 4 and relative_attention_max_distance ", v.relative_attention_max_distance,
                   " above a quarter of it; fix config.json");
    return v;
}

T5LayerNormImpl::T5LayerNormImpl(int64_t dim, double eps) : eps_(eps) {
    // In a loading scope the weight is allocated like the big layers' (the strict load fills it).
    const auto uninitialized = UninitializedParameters::current();
    weight = register_parameter("weight", uninitialized ? at::empty({dim}, *uninitialized) : at::ones({dim}));
}

at::Tensor T5LayerNormImpl::forward(const at::Tensor& x) {
    const at::Tensor variance = x.to(at::kFloat).pow(2).mean(-1, /*keepdim=*/true);  // [..., 1] float32
    at::Tensor h = x * at::rsqrt(variance + eps_);                                   // float32
    if (weight.scalar_type() == at::kHalf || weight.scalar_type() == at::kBFloat16)
        h = h.to(weight.scalar_type());
    return weight * h;
}

T5AttentionImpl::T5AttentionImpl(const T5Config& c, bool has_relative_attention_bias) : config_(c) {
    const int64_t inner = c.num_heads * c.d_kv;
    q_ = register_module("q", linear(c.d_model, inner));
    k_ = register_module("k", linear(c.d_model, inner));
    v_ = register_module("v", linear(c.d_model, inner));
    o_ = register_module("o", linear(inner, c.d_model));
    if (has_relative_attention_bias)
        relative_attention_bias_ = register_module("relative_attention_bias",
                                                   Embedding(c.relative_attention_num_buckets, c.num_heads));
}

at::Tensor T5AttentionImpl::compute_bias(int64_t length) {
    DTUNE_CHECK(!relative_attention_bias_.is_empty(), "T5: only block 0 holds the relative attention bias");
    const at::Tensor position = at::arange(
        length, at::TensorOptions().dtype(at::kLong).device(relative_attention_bias_->weight.device()));
    const at::Tensor relative =
        position.unsqueeze(0) - position.unsqueeze(1);  // [L query, L key]: key - query
    const at::Tensor buckets = relative_position_bucket(relative, config_.relative_attention_num_buckets,
                                                        config_.relative_attention_max_distance);
    return relative_attention_bias_->forward(buckets)
        .permute({2, 0, 1})
        .unsqueeze(0)
        .contiguous();  // [1, H, L, L]
}

at::Tensor T5AttentionImpl::forward(const at::Tensor& x, const at::Tensor& bias) {
    const int64_t b = x.size(0), l = x.size(1);
    const auto heads = [&](const at::Tensor& y) {
        return y.view({b, l, config_.num_heads, config_.d_kv}).transpose(1, 2);  // [B, H, L, d_kv]
    };
    const at::Tensor q = heads(q_->forward(x)), k = heads(k_->forward(x)), v = heads(v_->forward(x));
    const at::Tensor o =
        at::scaled_dot_product_attention(q, k, v, bias.to(q.scalar_type()), /*dropout_p=*/0.0,
                                         /*is_causal=*/false, /*scale=*/1.0);  // [B, H, L, d_kv]
    return o_->forward(o.transpose(1, 2).reshape({b, l, -1}));
}

T5DenseGatedActDenseImpl::T5DenseGatedActDenseImpl(int64_t d_model, int64_t d_ff) {
    wi_0_ = register_module("wi_0", linear(d_model, d_ff));
    wi_1_ = register_module("wi_1", linear(d_model, d_ff));
    wo_ = register_module("wo", linear(d_ff, d_model));
}

at::Tensor T5DenseGatedActDenseImpl::forward(const at::Tensor& x) {
    at::Tensor h = gelu_new(wi_0_->forward(x)) * wi_1_->forward(x);  // [B, L, d_ff]
    if (h.scalar_type() != wo_->dtype()) h = h.to(wo_->dtype());     // float32 wo of a float16 load
    return wo_->forward(h);
}

T5BlockImpl::T5BlockImpl(const T5Config& c, bool has_relative_attention_bias) {
    auto layer = register_module("layer", std::make_shared<torch::nn::Module>());
    auto self_attention = layer->register_module("0", std::make_shared<torch::nn::Module>());
    attention = self_attention->register_module("SelfAttention", T5Attention(c, has_relative_attention_bias));
    attention_norm_ =
        self_attention->register_module("layer_norm", T5LayerNorm(c.d_model, c.layer_norm_epsilon));
    auto feed_forward = layer->register_module("1", std::make_shared<torch::nn::Module>());
    ff_ = feed_forward->register_module("DenseReluDense", T5DenseGatedActDense(c.d_model, c.d_ff));
    ff_norm_ = feed_forward->register_module("layer_norm", T5LayerNorm(c.d_model, c.layer_norm_epsilon));
}

at::Tensor T5BlockImpl::forward(const at::Tensor& x, const at::Tensor& bias) {
    const at::Tensor h = clamp_float16(x + attention->forward(attention_norm_->forward(x), bias));
    return clamp_float16(h + ff_->forward(ff_norm_->forward(h)));
}

T5EncoderModelImpl::T5EncoderModelImpl(const T5Config& c) : config_(c) {
    shared_ = register_module("shared", Embedding(c.vocab_size, c.d_model));
    encoder_ = register_module("encoder", std::make_shared<torch::nn::Module>());
    auto list = encoder_->register_module("block", std::make_shared<torch::nn::Module>());
    for (int64_t i = 0; i < c.num_layers; ++i)
        blocks_.push_back(
            list->register_module(std::to_string(i), T5Block(c, /*has_relative_attention_bias=*/i == 0)));
    final_layer_norm_ =
        encoder_->register_module("final_layer_norm", T5LayerNorm(c.d_model, c.layer_norm_epsilon));
}

at::Tensor T5EncoderModelImpl::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask) {
    DTUNE_CHECK_AS(UsageError, input_ids.dim() == 2 && input_ids.size(1) >= 1,
                   "T5 encoder input_ids must be [batch, tokens], got ", input_ids.sizes());
    const c10::Device device = shared_->weight.device();
    const at::Tensor ids = input_ids.to(device, at::kLong);
    const int64_t b = ids.size(0), l = ids.size(1);
    at::Tensor bias = blocks_[0]->attention->compute_bias(l);  // [1, H, L, L], shared by every block
    if (attention_mask.defined()) {
        DTUNE_CHECK_AS(UsageError, attention_mask.sizes() == input_ids.sizes(), "T5 encoder attention_mask ",
                       attention_mask.sizes(), " does not match input_ids ", input_ids.sizes());
        const at::Tensor keep = attention_mask.to(device).ne(0).view({b, 1, 1, l});
        bias = at::where(keep, bias, lowest(bias.scalar_type()));  // [B, H, L, L]
    }
    at::Tensor h = shared_->forward(ids);  // [B, L, D]
    for (auto& block : blocks_) h = block->forward(h, bias);
    return final_layer_norm_->forward(h);
}

T5EncoderModel load_t5_encoder(const std::filesystem::path& dir, const ComponentLoadOptions& options) {
    const T5Config config = T5Config::from_json(component_config(dir, options, "T5 encoder"));
    T5EncoderModel model{nullptr};
    {
        UninitializedParameters scope(options.dtype, options.device);  // the strict load fills every tensor
        model = T5EncoderModel(config);
    }
    // float16 keeps `wo` in float32 (transformers' _keep_in_fp32_modules): read straight into it.
    if (options.dtype == at::kHalf)
        for (auto& p : model->named_parameters())
            if (p.key().ends_with(".DenseReluDense.wo.weight"))
                p.value().set_data(at::empty_like(p.value(), p.value().options().dtype(at::kFloat)));
    // A single file (ComfyUI's t5xxl_fp16 / fp8_e4m3fn: transformers' key names, converted to the
    // load dtype), else the folder's weights: transformers' names first, so a folder that also
    // holds model.fp16.safetensors stays unambiguous.
    std::filesystem::path weights = options.single_file.value_or(dir);
    if (!options.single_file)
        for (const char* name : {"model.safetensors.index.json", "model.safetensors"})
            if (std::filesystem::is_regular_file(dir / name)) {
                weights = dir / name;
                break;
            }
    const io::WeightSource source = io::WeightSource::open(weights, "model");
    // `encoder.embed_tokens` is tied to `shared`: transformers saves either key (or both).
    const bool has_shared = source.contains("shared.weight");
    LoadOptions load;  // no dtype/device: every tensor already has its own (wo may differ)
    load.rename = [has_shared](const std::string& key) -> std::string {
        if (key == "encoder.embed_tokens.weight") return has_shared ? "" : "shared.weight";
        return key;
    };
    load_weights(*model, source, load, str("T5 encoder from ", weights.string()));
    model->eval();
    return model;
}

}  // namespace dtune::models
