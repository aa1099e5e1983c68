// The demo's tiny Flux.1 [dev]-shaped model folder and its T5 tokenizer (see demo_model.h).
#include <ATen/ATen.h>

#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "demo/demo_model.h"
#include "demo/demo_parts.h"
#include "io/safetensors.h"
#include "models/clip/clip_text_model.h"
#include "models/common/config_json.h"
#include "models/common/weights.h"
#include "models/flux/flux_transformer.h"
#include "models/t5/t5_encoder.h"
#include "models/vae/autoencoder_kl.h"

namespace dtune::demo {
namespace {

using nlohmann::json;

constexpr const char* kSpace = "\xe2\x96\x81";  // "▁", SentencePiece's word-start mark
constexpr int64_t kT5Width = 32;                // T5's d_model = the transformer's joint_attention_dim
constexpr int64_t kClipWidth = 32;              // CLIP's hidden size = pooled_projection_dim

json flux_transformer_config() {
    // 4 heads of 16 (RoPE axes 4 + 6 + 6), 2 double-stream and 2 single-stream blocks; FLUX.1-dev
    // has 24 heads of 128 (16 + 56 + 56), 19 and 38.
    return json{{"_class_name", "FluxTransformer2DModel"},
                {"attention_head_dim", 16},
                {"axes_dims_rope", {4, 6, 6}},
                {"guidance_embeds", true},
                {"in_channels", 64},
                {"joint_attention_dim", kT5Width},
                {"num_attention_heads", 4},
                {"num_layers", 2},
                {"num_single_layers", 2},
                {"out_channels", nullptr},
                {"patch_size", 1},
                {"pooled_projection_dim", kClipWidth}};
}

json t5_config(int64_t vocab) {
    // transformers' T5Config for a T5 v1.1 encoder (gated GELU), as google/t5-v1_1-xxl's at toy size.
    return json{{"architectures", {"T5EncoderModel"}},
                {"model_type", "t5"},
                {"d_model", kT5Width},
                {"d_kv", 8},
                {"d_ff", 64},
                {"num_heads", 4},
                {"num_layers", 2},
                {"num_decoder_layers", 2},
                {"feed_forward_proj", "gated-gelu"},
                {"dense_act_fn", "gelu_new"},
                {"is_gated_act", true},
                {"relative_attention_num_buckets", 8},
                {"relative_attention_max_distance", 16},
                {"layer_norm_epsilon", 1e-6},
                {"dropout_rate", 0.0},
                {"initializer_factor", 1.0},
                {"is_encoder_decoder", false},
                {"use_cache", false},
                {"tie_word_embeddings", false},
                {"vocab_size", vocab},
                {"pad_token_id", 0},
                {"eos_token_id", 1}};
}

// FLUX.1-dev's scheduler: shift 3 with resolution-dependent (dynamic) shifting.
json flux_scheduler_config() {
    return json{{"_class_name", "FlowMatchEulerDiscreteScheduler"},
                {"base_image_seq_len", 256},
                {"base_shift", 0.5},
                {"max_image_seq_len", 4096},
                {"max_shift", 1.15},
                {"num_train_timesteps", 1000},
                {"shift", 3.0},
                {"use_dynamic_shifting", true}};
}

void write_t5_tokenizer(const std::filesystem::path& dir, const std::vector<std::string>& words) {
    std::filesystem::create_directories(dir);
    fs::write_file_atomic(dir / "tokenizer.json", make_demo_t5_tokenizer(words));
    const json special{{"eos_token", "</s>"}, {"pad_token", "<pad>"}, {"unk_token", "<unk>"}};
    write_json(dir / "special_tokens_map.json", special);
    json cfg = special;
    cfg["tokenizer_class"] = "T5Tokenizer";
    cfg["model_max_length"] = 512;
    cfg["extra_ids"] = 0;
    write_json(dir / "tokenizer_config.json", cfg);
}

// A random CLIP-L-shaped text tower (Flux reads its pooled output) and its BPE tokenizer.
int64_t write_clip(const std::filesystem::path& dir, const std::vector<std::string>& words) {
    const auto [vocab_text, merges] = make_demo_tokenizer(words);
    const auto vocab = json::parse(vocab_text);
    const int64_t eos = vocab.at("<|endoftext|>").get<int64_t>();
    write_clip_tokenizer(dir / "tokenizer", vocab_text, merges, "<|endoftext|>");
    const json cfg = clip_config(false, static_cast<int64_t>(vocab.size()),
                                 vocab.at("<|startoftext|>").get<int64_t>(), eos, eos, "quick_gelu");
    write_json(dir / "text_encoder" / "config.json", cfg);
    models::CLIPTextModel clip(models::CLIPTextConfig::from_json_text(cfg.dump(), "demo text_encoder"));
    io::save_safetensors(dir / "text_encoder" / "model.safetensors", models::state_dict(*clip));
    int64_t params = 0;
    for (const auto& p : clip->parameters()) params += p.numel();
    return params;
}

int64_t count(torch::nn::Module& m) {
    int64_t n = 0;
    for (const auto& p : m.parameters()) n += p.numel();
    return n;
}

}  // namespace

std::string make_demo_t5_tokenizer(const std::vector<std::string>& words) {
    // Scores: a whole word beats spelling it, so every demo word is one piece; the letters and
    // digits only cover text outside the demo's vocabulary.
    json vocab = json::array({json::array({"<pad>", 0.0}), json::array({"</s>", 0.0}),
                              json::array({"<unk>", 0.0}), json::array({kSpace, -3.0})});
    std::set<std::string> seen{"<pad>", "</s>", "<unk>", kSpace};
    for (const auto& w : words)
        if (seen.insert(kSpace + w).second) vocab.push_back(json::array({kSpace + w, -2.0}));
    for (const char* chars : {"abcdefghijklmnopqrstuvwxyz", "0123456789"})
        for (const char* c = chars; *c; ++c)
            if (seen.insert(std::string(1, *c)).second)
                vocab.push_back(json::array({std::string(1, *c), -10.0}));
    json added = json::array();
    for (int id = 0; id < 3; ++id)
        added.push_back({{"id", id},
                         {"content", vocab[static_cast<size_t>(id)][0]},
                         {"single_word", false},
                         {"lstrip", false},
                         {"rstrip", false},
                         {"normalized", false},
                         {"special", true}});
    const json metaspace{
        {"type", "Metaspace"}, {"replacement", kSpace}, {"prepend_scheme", "always"}, {"split", true}};
    const json eos_piece{{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}};
    const json seq_a{{"Sequence", {{"id", "A"}, {"type_id", 0}}}};
    const json seq_b{{"Sequence", {{"id", "B"}, {"type_id", 0}}}};
    const json tokenizer{
        {"version", "1.0"},
        {"truncation", nullptr},
        {"padding", nullptr},
        {"added_tokens", added},
        {"normalizer", nullptr},
        {"pre_tokenizer",
         {{"type", "Sequence"},
          {"pretokenizers", json::array({json{{"type", "WhitespaceSplit"}}, metaspace})}}},
        {"post_processor",
         {{"type", "TemplateProcessing"},
          {"single", json::array({seq_a, eos_piece})},
          {"pair", json::array({seq_a, eos_piece, seq_b, eos_piece})},
          {"special_tokens",
           {{"</s>", {{"id", "</s>"}, {"ids", json::array({1})}, {"tokens", json::array({"</s>"})}}}}}}},
        {"decoder", metaspace},
        {"model", {{"type", "Unigram"}, {"unk_id", 2}, {"vocab", vocab}, {"byte_fallback", false}}}};
    return tokenizer.dump(1) + "\n";
}

std::string write_demo_flux_model(const std::filesystem::path& dir, const std::vector<std::string>& words,
                                  const DemoModelOptions& o) {
    std::filesystem::create_directories(dir);
    at::manual_seed(o.seed);  // module initialisers draw from the global generator
    const int64_t clip_params = write_clip(dir, words);

    write_t5_tokenizer(dir / "tokenizer_2", words);
    const int64_t t5_vocab =
        static_cast<int64_t>(json::parse(make_demo_t5_tokenizer(words)).at("model").at("vocab").size());
    const json t5c = t5_config(t5_vocab);
    write_json(dir / "text_encoder_2" / "config.json", t5c);
    models::T5EncoderModel t5(models::T5Config::from_json(models::ConfigReader(t5c, "demo text_encoder_2")));
    io::save_safetensors(dir / "text_encoder_2" / "model.safetensors", models::state_dict(*t5));

    const json tc = flux_transformer_config();
    write_json(dir / "transformer" / "config.json", tc);
    models::FluxTransformer2DModel transformer(
        models::FluxTransformerConfig::from_json(models::ConfigReader(tc, "demo transformer config")));
    io::save_safetensors(dir / "transformer" / "diffusion_pytorch_model.safetensors",
                         models::state_dict(*transformer));

    models::AutoencoderKL vae(models::AutoencoderKLConfig::from_json(
        models::ConfigReader(demo_vae_config(16, 1.0, 0.0), "demo vae")));
    double scaling = 0.3611, shift = 0.1159, fit_mse = -1;  // FLUX.1's values when nothing is fitted
    if (o.vae_fit_images.defined() && o.vae_fit_steps > 0) {
        fit_mse = fit_vae(vae, o.vae_fit_images, o.vae_fit_steps, o.seed);
        at::NoGradGuard no_grad;
        const at::Tensor z = vae->encode(o.vae_fit_images).mean;  // [N, 16, h, w]
        shift = z.mean().item<double>();  // zero-mean, unit-variance latents, as Flux's shift and scale aim
        scaling = 1.0 / std::max(1e-3, (z - shift).std().item<double>());
    }
    write_json(dir / "vae" / "config.json", demo_vae_config(16, scaling, shift));
    io::save_safetensors(dir / "vae" / "diffusion_pytorch_model.safetensors", models::state_dict(*vae));

    write_json(dir / "scheduler" / "scheduler_config.json", flux_scheduler_config());
    write_json(dir / "model_index.json", json{{"_class_name", "FluxPipeline"},
                                              {"feature_extractor", {nullptr, nullptr}},
                                              {"image_encoder", {nullptr, nullptr}},
                                              {"scheduler", {"diffusers", "FlowMatchEulerDiscreteScheduler"}},
                                              {"text_encoder", {"transformers", "CLIPTextModel"}},
                                              {"text_encoder_2", {"transformers", "T5EncoderModel"}},
                                              {"tokenizer", {"transformers", "CLIPTokenizer"}},
                                              {"tokenizer_2", {"transformers", "T5TokenizerFast"}},
                                              {"transformer", {"diffusers", "FluxTransformer2DModel"}},
                                              {"vae", {"diffusers", "AutoencoderKL"}}});
    return str(
        "Flux transformer ", count(*transformer), " parameters, text encoders ", clip_params + count(*t5),
        " (CLIP ", clip_params, ", T5 ", count(*t5), "), T5 vocabulary ", t5_vocab, " pieces",
        fit_mse >= 0 ? str(", VAE fitted to the shapes (reconstruction MSE ", fit_mse, ")") : std::string());
}

}  // namespace dtune::demo
