// The demo's tiny SDXL-shaped model folder (see demo_model.h).
#include "demo/demo_model.h"

#include <ATen/ATen.h>

#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/log.h"
#include "demo/demo_parts.h"
#include "io/safetensors.h"
#include "models/clip/clip_text_model.h"
#include "models/common/config_json.h"
#include "models/common/weights.h"
#include "models/unet/unet_2d_condition.h"
#include "models/vae/autoencoder_kl.h"

namespace dtune::demo {
namespace {

using nlohmann::json;

// GPT-2 / CLIP's reversible byte -> printable unicode map, as UTF-8 strings.
std::vector<std::string> bytes_to_unicode() {
    std::vector<int> cps(256, -1);
    auto keep = [&](int lo, int hi) {
        for (int b = lo; b <= hi; ++b) cps[static_cast<size_t>(b)] = b;
    };
    keep('!', '~'), keep(0xA1, 0xAC), keep(0xAE, 0xFF);
    int next = 256;
    for (auto& c : cps)
        if (c < 0) c = next++;
    std::vector<std::string> out;
    for (const int cp : cps) {
        std::string s;
        if (cp < 0x80) {
            s.push_back(static_cast<char>(cp));
        } else {  // two-byte UTF-8 (all code points here are < 0x800)
            s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
            s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
        }
        out.push_back(s);
    }
    return out;
}

json unet_config(int64_t cross_dim, int64_t pooled_dim) {
    return json{{"_class_name", "UNet2DConditionModel"},
                {"act_fn", "silu"},
                {"addition_embed_type", "text_time"},
                {"addition_time_embed_dim", 8},
                {"attention_head_dim", {2, 4, 4}},
                {"block_out_channels", {32, 64, 64}},
                {"cross_attention_dim", cross_dim},
                {"down_block_types", {"DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"}},
                {"up_block_types", {"CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"}},
                {"in_channels", 4},
                {"out_channels", 4},
                {"layers_per_block", 1},
                {"mid_block_type", "UNetMidBlock2DCrossAttn"},
                {"norm_num_groups", 32},
                {"norm_eps", 1e-5},
                {"projection_class_embeddings_input_dim", pooled_dim + 6 * 8},
                {"sample_size", 8},
                {"transformer_layers_per_block", {1, 1, 1}},
                {"use_linear_projection", true},
                {"flip_sin_to_cos", true},
                {"freq_shift", 0}};
}

}  // namespace

std::pair<std::string, std::string> make_demo_tokenizer(const std::vector<std::string>& words) {
    const auto byte_sym = bytes_to_unicode();
    std::vector<std::string> vocab;
    std::set<std::string> seen;
    auto add = [&](const std::string& t) {
        if (seen.insert(t).second) vocab.push_back(t);
    };
    // CLIP's order: the printable bytes ('!'..'~', 0xA1..0xAC, 0xAE..0xFF), then the others.
    std::vector<int> order;
    for (int b = '!'; b <= '~'; ++b) order.push_back(b);
    for (int b = 0xA1; b <= 0xAC; ++b) order.push_back(b);
    for (int b = 0xAE; b <= 0xFF; ++b) order.push_back(b);
    for (int b = 0; b < 256; ++b)
        if (b < '!' || (b > '~' && b < 0xA1) || b == 0xAD) order.push_back(b);
    for (const int b : order) add(byte_sym[static_cast<size_t>(b)]);
    for (const int b : order) add(byte_sym[static_cast<size_t>(b)] + "</w>");
    std::string merges = "#version: 0.2\n";
    std::set<std::string> merge_seen;
    for (const auto& w : words) {
        // Symbols of the word; the last carries the end-of-word marker, as CLIP's BPE splits.
        std::vector<std::string> syms;
        for (size_t i = 0; i < w.size(); ++i) {
            std::string s = byte_sym[static_cast<uint8_t>(w[i])];
            if (i + 1 == w.size()) s += "</w>";
            syms.push_back(s);
        }
        std::string left = syms[0];
        for (size_t i = 1; i < syms.size(); ++i) {
            const std::string line = left + " " + syms[i];
            if (merge_seen.insert(line).second) merges += line + "\n";
            left += syms[i];
            add(left);
        }
    }
    add("<|startoftext|>");
    add("<|endoftext|>");
    json v = json::object();
    for (size_t i = 0; i < vocab.size(); ++i) v[vocab[i]] = i;
    return {v.dump(), merges};
}

std::string write_demo_model(const std::filesystem::path& dir, const std::vector<std::string>& words,
                             const DemoModelOptions& o) {
    std::filesystem::create_directories(dir);
    const auto [vocab_text, merges] = make_demo_tokenizer(words);
    const auto vocab = json::parse(vocab_text);
    const int64_t n_vocab = static_cast<int64_t>(vocab.size());
    const int64_t bos = vocab.at("<|startoftext|>").get<int64_t>(),
                  eos = vocab.at("<|endoftext|>").get<int64_t>();
    const int64_t bang = vocab.at("!").get<int64_t>();
    write_clip_tokenizer(dir / "tokenizer", vocab_text, merges, "<|endoftext|>");
    write_clip_tokenizer(dir / "tokenizer_2", vocab_text, merges,
                         "!");  // SDXL's second tokenizer pads with "!"

    at::manual_seed(o.seed);  // module initialisers draw from the global generator
    const json te1 = clip_config(false, n_vocab, bos, eos, eos, "quick_gelu");
    const json te2 = clip_config(true, n_vocab, bos, eos, bang, "gelu");
    write_json(dir / "text_encoder" / "config.json", te1);
    write_json(dir / "text_encoder_2" / "config.json", te2);
    models::CLIPTextModel m1(models::CLIPTextConfig::from_json_text(te1.dump(), "demo text_encoder"));
    models::CLIPTextModelWithProjection m2(
        models::CLIPTextConfig::from_json_text(te2.dump(), "demo text_encoder_2"));
    io::save_safetensors(dir / "text_encoder" / "model.safetensors", models::state_dict(*m1));
    io::save_safetensors(dir / "text_encoder_2" / "model.safetensors", models::state_dict(*m2));
    int64_t params = 0;
    for (const auto& p : m1->parameters()) params += p.numel();
    for (const auto& p : m2->parameters()) params += p.numel();

    const json uc = unet_config(32 + 32, 32);
    write_json(dir / "unet" / "config.json", uc);
    models::UNet2DConditionModel unet(
        models::UNet2DConditionConfig::from_json(models::ConfigReader(uc, "demo unet config")));
    io::save_safetensors(dir / "unet" / "diffusion_pytorch_model.safetensors", models::state_dict(*unet));
    int64_t unet_params = 0;
    for (const auto& p : unet->parameters()) unet_params += p.numel();

    models::AutoencoderKL vae(
        models::AutoencoderKLConfig::from_json(models::ConfigReader(demo_vae_config(4, 1.0), "demo vae")));
    double scaling = 0.13025, fit_mse = -1;
    if (o.vae_fit_images.defined() && o.vae_fit_steps > 0) {
        fit_mse = fit_vae(vae, o.vae_fit_images, o.vae_fit_steps, o.seed);
        at::NoGradGuard no_grad;
        const at::Tensor z = vae->encode(o.vae_fit_images).mean;  // [N, 4, h, w]
        scaling = 1.0 / std::max(1e-3, z.std().item<double>());  // unit-variance latents, as SD chose 0.18215
    }
    write_json(dir / "vae" / "config.json", demo_vae_config(4, scaling));
    io::save_safetensors(dir / "vae" / "diffusion_pytorch_model.safetensors", models::state_dict(*vae));

    write_json(dir / "scheduler" / "scheduler_config.json", json{{"_class_name", "EulerDiscreteScheduler"},
                                                                 {"beta_start", 0.00085},
                                                                 {"beta_end", 0.012},
                                                                 {"beta_schedule", "scaled_linear"},
                                                                 {"num_train_timesteps", 1000},
                                                                 {"prediction_type", "epsilon"},
                                                                 {"steps_offset", 1},
                                                                 {"timestep_spacing", "leading"},
                                                                 {"interpolation_type", "linear"},
                                                                 {"use_karras_sigmas", false}});
    write_json(dir / "model_index.json",
               json{{"_class_name", "StableDiffusionXLPipeline"},
                    {"force_zeros_for_empty_prompt", true},
                    {"scheduler", {"diffusers", "EulerDiscreteScheduler"}},
                    {"text_encoder", {"transformers", "CLIPTextModel"}},
                    {"text_encoder_2", {"transformers", "CLIPTextModelWithProjection"}},
                    {"tokenizer", {"transformers", "CLIPTokenizer"}},
                    {"tokenizer_2", {"transformers", "CLIPTokenizer"}},
                    {"unet", {"diffusers", "UNet2DConditionModel"}},
                    {"vae", {"diffusers", "AutoencoderKL"}}});
    return str(
        "UNet ", unet_params, " parameters, text encoders ", params, ", vocabulary ", n_vocab, " tokens",
        fit_mse >= 0 ? str(", VAE fitted to the shapes (reconstruction MSE ", fit_mse, ")") : std::string());
}

}  // namespace dtune::demo
