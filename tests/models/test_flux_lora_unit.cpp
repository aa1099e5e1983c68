// Flux LoRA key layouts (models/flux/flux_lora.h) on the tiny [dev] transformer of
// tools/ref/gen_flux_transformer_ref.py (2 double + 2 single blocks, guidance embedding). A random
// LoRA on every Linear layer, written with kohya's and Black Forest Labs' keys and applied unmerged,
// must equal the same LoRA merged into the fused BFL-layout weights (W += alpha / rank · up · down,
// ComfyUI's rule) and loaded through the BFL weight map (itself tested bit for bit against
// diffusers). The pipeline test checks the same against diffusers on the tiny pipeline. Layouts are
// told from the keys, and damaged or foreign files are refused naming the file, the key and the fix.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>

#include "core/error.h"
#include "model_test_util.h"
#include "models/adapters/lora_apply.h"
#include "models/common/config_json.h"
#include "models/flux/flux_lora.h"
#include "models/flux/flux_transformer.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_flux_lora_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

namespace stdfs = std::filesystem;
const stdfs::path kRef = stdfs::path(DTUNE_TEST_DATA_DIR) / "ref";

ConfigReader dev_config_json() {
    return ConfigReader::from_file(kRef / "tiny-flux-dev" / "config.json");
}

FluxTransformerConfig dev_config() {
    return FluxTransformerConfig::from_json(dev_config_json());
}

struct Factors {
    at::Tensor down, up;
    double alpha;
};

// A LoRA on every BFL Linear layer of the tiny transformer: ranks 2 and 3, alpha / rank 0.5 .. 2.
std::map<std::string, Factors> random_lora(uint64_t seed) {
    at::Generator gen = at::detail::createCPUGenerator(seed);
    std::map<std::string, Factors> lora;
    int n = 0;
    for (const FluxBflLinear& layer : flux_bfl_linear_layers(dev_config())) {
        const int64_t r = 2 + n % 2;
        const double in = static_cast<double>(layer.in_features);
        lora[layer.bfl] = {at::randn({r, layer.in_features}, gen) * (1.0 / std::sqrt(in)),
                           at::randn({layer.out_features(), r}, gen) * 0.3,
                           static_cast<double>(r) * (0.5 + 0.5 * (n % 3))};
        ++n;
    }
    return lora;
}

// The tiny BFL file with the LoRA merged into its fused weights, at alpha / rank (or 1).
stdfs::path merged_bfl_file(const std::map<std::string, Factors>& lora, bool use_alpha,
                            const stdfs::path& out) {
    io::TensorList merged;
    for (auto [key, value] : io::load_safetensors(kRef / "tiny-flux-dev-bfl.safetensors")) {
        const std::string layer = key.ends_with(".weight") ? key.substr(0, key.size() - 7) : "";
        if (const auto it = lora.find(layer); it != lora.end()) {
            const double scale =
                use_alpha ? it->second.alpha / static_cast<double>(it->second.down.size(0)) : 1.0;
            value = value + scale * at::matmul(it->second.up, it->second.down);
        }
        merged.emplace_back(key, value.contiguous());
    }
    io::save_safetensors(out, merged);
    return out;
}

at::Tensor forward(FluxTransformer2DModel& model) {
    const io::SafetensorsFile io(kRef / "flux_transformer_io.safetensors");
    const auto get = [&](const char* n) { return test::fixture_tensor(io, n); };
    torch::NoGradGuard no_grad;
    return model->forward(get("hidden"), get("encoder"), get("pooled"), get("timestep"), get("guidance"),
                          get("img_ids"), get("txt_ids"));
}

at::Tensor merged_output(const stdfs::path& file) {
    ComponentLoadOptions o;
    o.single_file = file;
    o.config = dev_config_json();
    FluxTransformer2DModel model = load_flux_transformer({}, o);
    return forward(model);
}

at::Tensor lora_output(const stdfs::path& lora_file) {
    FluxTransformer2DModel model = load_flux_transformer(kRef / "tiny-flux-dev");
    const FluxLoRA lora = read_flux_lora(lora_file, model->config());
    const LoRAAdapters adapters = apply_lora(*model, lora.tensors, 1.0);
    return forward(model);
}

// Every fused layer split, every embedder and the swapped final AdaLN, kohya's alphas applied.
TEST(FluxLoRA, KohyaLoRAEqualsTheLoRAMergedIntoFusedWeights) {
    test::TempDir dir;
    const auto lora = random_lora(1);
    io::TensorList kohya;
    for (const auto& [layer, f] : lora) {
        std::string name = "lora_unet_" + layer;
        for (char& c : name)
            if (c == '.') c = '_';
        kohya.emplace_back(name + ".lora_down.weight", f.down);
        kohya.emplace_back(name + ".lora_up.weight", f.up);
        kohya.emplace_back(name + ".alpha", at::scalar_tensor(f.alpha, at::kFloat));
    }
    io::save_safetensors(dir.path() / "kohya.safetensors", kohya);
    EXPECT_EQ(read_flux_lora(dir.path() / "kohya.safetensors", dev_config()).layout, FluxLoRALayout::kKohya);
    const at::Tensor want = merged_output(merged_bfl_file(lora, true, dir.path() / "merged.safetensors"));
    const at::Tensor base = merged_output(kRef / "tiny-flux-dev-bfl.safetensors");
    EXPECT_GT(test::max_abs_diff(want, base), 0.05);  // the LoRA matters
    EXPECT_LE(test::reported_diff("kohya", lora_output(dir.path() / "kohya.safetensors"), want),
              1e-5 * want.abs().max().item<double>());
}

// BFL keys (lora_A / lora_B, no alpha: scale 1) with ComfyUI's prefix and without.
TEST(FluxLoRA, BlackForestLabsLoRAEqualsTheLoRAMergedIntoFusedWeights) {
    test::TempDir dir;
    const auto lora = random_lora(2);
    const at::Tensor want = merged_output(merged_bfl_file(lora, false, dir.path() / "merged.safetensors"));
    for (const std::string prefix : {"diffusion_model.", ""}) {
        SCOPED_TRACE(prefix);
        io::TensorList bfl;
        for (const auto& [layer, f] : lora) {
            bfl.emplace_back(prefix + layer + ".lora_A.weight", f.down);
            bfl.emplace_back(prefix + layer + ".lora_B.weight", f.up);
        }
        io::save_safetensors(dir.path() / "bfl.safetensors", bfl);
        EXPECT_EQ(read_flux_lora(dir.path() / "bfl.safetensors", dev_config()).layout,
                  FluxLoRALayout::kBlackForestLabs);
        EXPECT_LE(test::reported_diff("bfl " + prefix, lora_output(dir.path() / "bfl.safetensors"), want),
                  1e-5 * want.abs().max().item<double>());
    }
}

TEST(FluxLoRA, LayoutIsToldFromTheKeys) {
    using L = FluxLoRALayout;
    const auto layout = [](std::vector<std::string> keys) { return flux_lora_layout(keys); };
    EXPECT_EQ(layout({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"}), L::kKohya);
    EXPECT_EQ(layout({"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight",
                      "lora_unet_img_in.lora_up.weight"}),
              L::kKohya);
    EXPECT_EQ(layout({"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"}), L::kBlackForestLabs);
    EXPECT_EQ(layout({"single_blocks.3.linear1.lora_B.weight"}), L::kBlackForestLabs);
    EXPECT_EQ(layout({"diffusion_model.final_layer.linear.lora_down.weight"}), L::kBlackForestLabs);
    EXPECT_EQ(layout({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight"}), L::kDiffusers);
    EXPECT_EQ(layout({"base_model.model.single_transformer_blocks.0.proj_mlp.lora_A.weight"}), L::kDiffusers);
    // Not Flux LoRAs: an SDXL one, a Flux transformer checkpoint, text-encoder tensors only.
    EXPECT_EQ(layout({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight"}), std::nullopt);
    EXPECT_EQ(layout({"unet.down_blocks.0.attentions.0.proj_in.lora.down.weight"}), std::nullopt);
    EXPECT_EQ(layout({"double_blocks.0.img_attn.qkv.weight"}), std::nullopt);
    EXPECT_EQ(layout({"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"}), std::nullopt);
}

// Writes `tensors` and expects read_flux_lora to throw a DataError holding every `needles` entry.
void expect_refused(const io::TensorList& tensors, const std::vector<std::string>& needles) {
    test::TempDir dir;
    const stdfs::path file = dir.path() / "lora.safetensors";
    io::save_safetensors(file, tensors);
    try {
        read_flux_lora(file, dev_config());
        ADD_FAILURE() << "accepted: " << tensors.front().first;
    } catch (const DataError& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(file.string()), std::string::npos) << msg;
        for (const auto& needle : needles)
            EXPECT_NE(msg.find(needle), std::string::npos) << needle << "\n" << msg;
    }
}

TEST(FluxLoRA, RefusesForeignAndDamagedFilesNamingTheKey) {
    const at::Tensor down = at::randn({2, 16}), up = at::randn({48, 2});
    const std::string qkv = "lora_unet_double_blocks_0_img_attn_qkv";
    // Not a Flux LoRA: the message names the file's key and shows the three layouts' keys.
    expect_refused({{"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight", down}},
                   {"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight",
                    "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
                    "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight", "SDXL"});
    // A block this transformer does not have (the LoRA is for FLUX.1's 19 + 38 blocks).
    expect_refused({{"lora_unet_double_blocks_7_img_attn_qkv.lora_down.weight", down},
                    {"lora_unet_double_blocks_7_img_attn_qkv.lora_up.weight", up}},
                   {"lora_unet_double_blocks_7_img_attn_qkv.lora_down.weight", "2 double + 2 single blocks"});
    // Shapes of another model; an alpha that would switch the layer off; a lone down matrix.
    expect_refused({{qkv + ".lora_down.weight", down}, {qkv + ".lora_up.weight", at::randn({96, 2})}},
                   {qkv + ".lora_up.weight", "another model"});
    expect_refused({{qkv + ".lora_down.weight", down},
                    {qkv + ".lora_up.weight", up},
                    {qkv + ".alpha", at::scalar_tensor(-1.0)}},
                   {qkv + ".alpha", "positive finite"});
    expect_refused({{qkv + ".lora_down.weight", down}}, {qkv + ".lora_down.weight", "no up"});
    expect_refused({{qkv + ".lora_down.weight", down}, {qkv + ".lora_up.weight", up * NAN}},
                   {qkv + ".lora_up.weight", "NaN"});
    // DoRA magnitudes and weight differences are refused, not dropped.
    expect_refused({{qkv + ".lora_down.weight", down},
                    {qkv + ".lora_up.weight", up},
                    {qkv + ".dora_scale", at::ones({48, 1})}},
                   {qkv + ".dora_scale", "DoRA"});
    expect_refused({{"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight", down},
                    {"lora_unet_double_blocks_0_img_attn_qkv.diff", at::zeros({48, 16})}},
                   {"lora_unet_double_blocks_0_img_attn_qkv.diff"});
}

// Text-encoder tensors are skipped; the transformer part still loads and splits q/k/v.
TEST(FluxLoRA, SkipsTextEncoderTensorsAndSplitsQkv) {
    test::TempDir dir;
    const at::Tensor down = at::randn({2, 16}), up = at::randn({48, 2});
    io::save_safetensors(
        dir.path() / "lora.safetensors",
        {{"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight", at::randn({2, 8})},
         {"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight", at::randn({8, 2})},
         {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight", down},
         {"lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight", up},
         {"lora_unet_double_blocks_0_img_attn_qkv.alpha", at::scalar_tensor(4.0)}});
    const FluxLoRA lora = read_flux_lora(dir.path() / "lora.safetensors", dev_config());
    std::map<std::string, at::Tensor> got(lora.tensors.tensors.begin(), lora.tensors.tensors.end());
    ASSERT_EQ(got.size(), 9u);  // to_q, to_k, to_v: A, B and alpha each
    const char* parts[] = {"to_q", "to_k", "to_v"};
    for (int j = 0; j < 3; ++j) {
        const std::string base = std::string("transformer.transformer_blocks.0.attn.") + parts[j];
        EXPECT_TRUE(at::equal(got.at(base + ".lora_A.weight"), down));
        EXPECT_TRUE(at::equal(got.at(base + ".lora_B.weight"), up.narrow(0, 16 * j, 16)));
        EXPECT_EQ(got.at(base + ".alpha").item<double>(), 4.0);
    }
}

}  // namespace
}  // namespace test_flux_lora_unit_local
}  // namespace dtune::models
