// The demo models' shared pieces (see demo_parts.h).
#include "demo/demo_parts.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adam.h>

#include "core/fs.h"

namespace dtune::demo {

using nlohmann::json;

void write_json(const std::filesystem::path& path, const json& j) {
    std::filesystem::create_directories(path.parent_path());
    fs::write_file_atomic(path, j.dump(2) + "\n");
}

void write_clip_tokenizer(const std::filesystem::path& dir, const std::string& vocab,
                          const std::string& merges, const std::string& pad) {
    std::filesystem::create_directories(dir);
    fs::write_file_atomic(dir / "vocab.json", vocab);
    fs::write_file_atomic(dir / "merges.txt", merges);
    const json special{{"bos_token", "<|startoftext|>"},
                       {"eos_token", "<|endoftext|>"},
                       {"pad_token", pad},
                       {"unk_token", "<|endoftext|>"}};
    write_json(dir / "special_tokens_map.json", special);
    json cfg = special;
    cfg["tokenizer_class"] = "CLIPTokenizer";
    cfg["model_max_length"] = 77;
    write_json(dir / "tokenizer_config.json", cfg);
}

json clip_config(bool projection, int64_t vocab, int64_t bos, int64_t eos, int64_t pad, const char* act) {
    return json{{"architectures", {projection ? "CLIPTextModelWithProjection" : "CLIPTextModel"}},
                {"model_type", "clip_text_model"},
                {"hidden_act", act},
                {"hidden_size", 32},
                {"intermediate_size", 64},
                {"num_attention_heads", 4},
                {"num_hidden_layers", 3},
                {"max_position_embeddings", 77},
                {"projection_dim", 32},
                {"layer_norm_eps", 1e-5},
                {"vocab_size", vocab},
                {"bos_token_id", bos},
                {"eos_token_id", eos},
                {"pad_token_id", pad}};
}

double fit_vae(models::AutoencoderKL& vae, const at::Tensor& images, int steps, uint64_t seed) {
    torch::optim::Adam opt(vae->parameters(), torch::optim::AdamOptions(2e-3));
    auto gen = at::detail::createCPUGenerator(seed);
    vae->train();
    double mse = 0;
    const int64_t n = images.size(0), batch = std::min<int64_t>(4, n);
    for (int s = 0; s < steps; ++s) {
        const at::Tensor idx = at::randperm(n, gen).slice(0, 0, batch);
        const at::Tensor x = images.index_select(0, idx);  // [b, 3, H, W]
        const auto post = vae->encode(x);
        const at::Tensor z = post.mean + post.std * at::randn(post.mean.sizes(), gen);
        const at::Tensor rec = vae->decode(z);
        const at::Tensor l_rec = (rec - x).pow(2).mean();
        const at::Tensor kl = 0.5 * (post.mean.pow(2) + post.logvar.exp() - 1 - post.logvar).mean();
        const at::Tensor loss = l_rec + 1e-3 * kl;
        opt.zero_grad();
        loss.backward();
        opt.step();
        mse = l_rec.item<double>();
    }
    vae->eval();
    return mse;
}

nlohmann::json demo_vae_config(int64_t latent_channels, double scaling_factor,
                               std::optional<double> shift_factor) {
    nlohmann::json j{
        {"_class_name", "AutoencoderKL"},
        {"act_fn", "silu"},
        {"block_out_channels", {16, 16, 32, 32}},
        {"down_block_types",
         {"DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"}},
        {"up_block_types", {"UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"}},
        {"force_upcast", true},
        {"in_channels", 3},
        {"out_channels", 3},
        {"latent_channels", latent_channels},
        {"layers_per_block", 1},
        {"mid_block_add_attention", true},
        {"norm_num_groups", 16},
        {"sample_size", 64},
        {"scaling_factor", scaling_factor},
        {"use_quant_conv", !shift_factor.has_value()},
        {"use_post_quant_conv", !shift_factor.has_value()}};
    if (shift_factor) {
        j["shift_factor"] = *shift_factor;
        j["latents_mean"] = nullptr;
        j["latents_std"] = nullptr;
    }
    return j;
}

}  // namespace dtune::demo
