// `model_type lora` in the trainer on the tiny SDXL fixture (CPU): config parsing of the LoRA keys,
// only adapters train, the written pytorch_lora_weights.safetensors (diffusers and ComfyUI keys,
// LoRA and DoRA, LoCon conv targets) loads back with lora_io into a fresh UNet and gives the trained
// model's output exactly, init_lora reproduces the fixture's PEFT output, and seeded dropout masks
// replay when gradient checkpointing recomputes a block.
#include <gtest/gtest.h>

#include <set>

#include "core/error.h"
#include "io/safetensors.h"
#include "models/adapters/lora_io.h"
#include "train/adapters.h"
#include "trainer_test_util.h"

namespace dtune::train {
namespace test_lora_train_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

const std::vector<std::string> kSdxlTargets = family::sdxl_family().default_lora_targets();

using testutil::make_trainer;
using testutil::tiny_config;
using testutil::tiny_unet;

struct UNetInputs {
    io::SafetensorsFile file{test::fixtures_dir() / "reference" / "unet_io.safetensors"};
    at::Tensor get(const std::string& name) const { return file.get(name).to(at::kFloat).clone(); }
    at::Tensor forward(models::UNet2DConditionModelImpl& unet) const {
        at::NoGradGuard no_grad;
        return unet.forward(get("sample"), get("timestep"), get("encoder_hidden_states"),
                            {get("text_embeds"), get("time_ids")});
    }
};

double max_diff(const at::Tensor& a, const at::Tensor& b) {
    return (a - b).abs().max().item<double>();
}

// Trains a LoRA for `steps` and checks the trained in-memory model against a fresh UNet with the
// written file loaded through lora_io.
void train_and_load_back(const nlohmann::json& lora_keys, int64_t steps, const std::string& key_prefix) {
    test::TempDir dir;
    const TrainConfig config = tiny_config(dir.path(), steps, lora_keys);
    auto trainer = make_trainer(config);
    trainer->run();

    // Only adapter tensors were trainable, and the base weights did not move.
    ASSERT_NE(trainer->lora(), nullptr);
    const std::size_t per_module = config.flag("use_dora") ? 3 : 2;
    EXPECT_EQ(trainer->trainable_parameters().size(), trainer->lora()->adapters().size() * per_module);
    for (const auto& p : trainer->trainable_parameters()) EXPECT_NE(p.name.find(".lora_"), std::string::npos);
    const auto base = models::state_dict(*tiny_unet());
    std::map<std::string, at::Tensor> trained;
    for (auto& [k, v] : models::state_dict(*testutil::unet_of(*trainer))) trained[k] = v;
    for (const auto& [k, v] : base) EXPECT_TRUE(at::equal(trained.at(k), v)) << k << " moved";
    EXPECT_GT(trainer->lora()->adapters().entries().front().layer->up().abs().max().item<double>(), 0)
        << "lora_B is still zero: nothing was trained";

    const auto file = dir / kLoRAWeightsFile;
    ASSERT_TRUE(std::filesystem::exists(file));
    EXPECT_TRUE(std::filesystem::exists(dir / ("checkpoint-" + std::to_string(steps)) / kLoRAWeightsFile));
    EXPECT_FALSE(std::filesystem::exists(dir / "pipeline"));
    for (const auto& key : io::SafetensorsFile(file).keys())
        EXPECT_EQ(key.rfind(key_prefix, 0), 0u) << key << " does not start with " << key_prefix;

    auto fresh = tiny_unet();
    models::LoRAAdapters adapters =
        models::inject_lora(*fresh, lora_config_from(config, family::sdxl_family()));
    models::load_lora(adapters, file);
    testutil::unet_of(*trainer)->eval();  // no dropout in the comparison
    fresh->eval();
    const UNetInputs in;
    const at::Tensor expected = in.forward(*testutil::unet_of(*trainer));
    EXPECT_EQ(max_diff(in.forward(*fresh), expected), 0.0);
    EXPECT_GT(max_diff(in.forward(*tiny_unet()), expected), 1e-6) << "the LoRA changes nothing";
}

TEST(LoRATrainConfig, TargetsAndSettings) {
    EXPECT_EQ(parse_lora_targets(nullptr, kSdxlTargets),
              (std::vector<std::string>{"to_k", "to_q", "to_v", "to_out.0"}));
    EXPECT_EQ(parse_lora_targets(nlohmann::json::array({"to_q", "conv1"}), kSdxlTargets),
              (std::vector<std::string>{"to_q", "conv1"}));
    EXPECT_EQ(parse_lora_targets(R"(["proj_in"])", kSdxlTargets), (std::vector<std::string>{"proj_in"}));
    test::TempDir dir;
    fs::write_file_atomic(dir / "targets.json", R"(["to_k", "ff.net.2"])");
    EXPECT_EQ(parse_lora_targets((dir / "targets.json").string(), kSdxlTargets),
              (std::vector<std::string>{"to_k", "ff.net.2"}));
    EXPECT_THROW(parse_lora_targets("to_q,to_k", kSdxlTargets), UsageError);  // neither JSON nor a file
    EXPECT_THROW(parse_lora_targets(nlohmann::json::array(), kSdxlTargets), UsageError);
    EXPECT_THROW(parse_lora_targets(42, kSdxlTargets), UsageError);

    const TrainConfig c = tiny_config(dir.path(), 1,
                                      {{"model_type", "lora"},
                                       {"lora_rank", 8},
                                       {"lora_alpha", 4},
                                       {"lora_dropout", 0.05},
                                       {"use_dora", true},
                                       {"lora_init_type", "gaussian"},
                                       {"peft_lora_target_modules", R"(["to_q"])"}});
    const models::LoRAConfig lc = lora_config_from(c, family::sdxl_family());
    EXPECT_EQ(lc.rank, 8);
    EXPECT_DOUBLE_EQ(lc.alpha, 4);
    EXPECT_DOUBLE_EQ(lc.dropout, 0.05);
    EXPECT_TRUE(lc.use_dora);
    EXPECT_EQ(lc.init, models::LoRAInit::kGaussian);
    EXPECT_EQ(lc.target_modules, std::vector<std::string>{"to_q"});
    EXPECT_THROW(
        lora_config_from(tiny_config(dir.path(), 1, {{"lora_init_type", "pissa"}}), family::sdxl_family()),
        UsageError);
}

TEST(LoRATrain, DiffusersFileLoadsBackToTheTrainedModel) {
    train_and_load_back({{"model_type", "lora"}, {"lora_rank", 4}, {"lora_dropout", 0.1}}, 1, "unet.");
}

TEST(LoRATrain, ComfyUIDoRAWithConvTargetsLoadsBack) {
    train_and_load_back({{"model_type", "lora"},
                         {"lora_rank", 2},
                         {"lora_alpha", 3},
                         {"lora_dropout", 0.0},
                         {"use_dora", true},
                         {"lora_format", "comfyui"},
                         {"peft_lora_target_modules", nlohmann::json::array({"to_q", "to_v", "conv1"})}},
                        1, "lora_unet_");
}

TEST(LoRATrain, InitLoraReproducesTheFixtureOutput) {
    test::TempDir dir;
    const auto lora_dir = test::fixtures_dir() / "reference" / "lora";
    auto trainer = make_trainer(tiny_config(dir.path(), 1,
                                            {{"model_type", "lora"},
                                             {"lora_rank", 4},
                                             {"lora_alpha", 8},
                                             {"lora_dropout", 0.0},
                                             {"init_lora", (lora_dir / kLoRAWeightsFile).string()}}));
    testutil::unet_of(*trainer)->eval();
    const at::Tensor expected =
        io::SafetensorsFile(lora_dir / "lora_io.safetensors").get("out_with_lora").to(at::kFloat);
    const at::Tensor out = UNetInputs().forward(*testutil::unet_of(*trainer));
    EXPECT_LE(max_diff(out, expected), 1e-4);
    EXPECT_GT(max_diff(UNetInputs().forward(*tiny_unet()), expected), 1e-2);  // the file matters
}

// Gradients of the adapters for one forward/backward with LoRA dropout 0.5 and a given mask seed.
std::vector<at::Tensor> dropout_grads(bool checkpointing, uint64_t seed) {
    auto unet = tiny_unet();
    models::LoRAConfig lc;
    lc.rank = 4;
    lc.dropout = 0.5;
    models::LoRAAdapters adapters = models::inject_lora(*unet, lc);
    {
        at::NoGradGuard no_grad;
        auto gen = at::detail::createCPUGenerator(99);
        for (auto& t : adapters.parameters()) t.copy_(at::randn(t.sizes(), gen) * 0.1);  // non-zero B
        for (auto& t : adapters.parameters()) t.set_requires_grad(true);
    }
    unet->train();
    unet->set_gradient_checkpointing(checkpointing);
    adapters.set_dropout_seed(seed);
    const UNetInputs in;
    const at::Tensor out =
        unet->forward(in.get("sample"), in.get("timestep"), in.get("encoder_hidden_states"),
                      {in.get("text_embeds"), in.get("time_ids")});
    out.pow(2).mean().backward();
    std::vector<at::Tensor> grads;
    for (auto& t : adapters.parameters()) grads.push_back(t.grad().clone());
    return grads;
}

TEST(LoRATrain, SeededDropoutReplaysUnderGradientCheckpointing) {
    const auto plain = dropout_grads(false, 5);
    const auto recomputed = dropout_grads(true, 5);
    const auto other_seed = dropout_grads(false, 6);
    ASSERT_EQ(plain.size(), recomputed.size());
    double worst = 0, seed_effect = 0;
    for (std::size_t i = 0; i < plain.size(); ++i) {
        worst = std::max(worst,
                         max_diff(plain[i], recomputed[i]) / (plain[i].abs().max().item<double>() + 1e-12));
        seed_effect = std::max(seed_effect, max_diff(plain[i], other_seed[i]));
    }
    EXPECT_LE(worst, 1e-5);        // the recomputation saw the same masks
    EXPECT_GT(seed_effect, 1e-6);  // and the masks do depend on the seed
}

TEST(LoRATrain, FusedLinearWithDropoutMatchesTheComposite) {
    // With a seeded (hash) mask the dropout rides inside the fused linear LoRA function (mask applied
    // to the adapter's input in forward, recomputed in backward); the composite path drops x first.
    // Same masks, so the same gradients up to float rounding; and gradient checkpointing too.
    models::set_fused_lora(false);
    const auto composite = dropout_grads(false, 5);
    models::set_fused_lora(true);
    const auto fused = dropout_grads(false, 5);
    const auto fused_recomputed = dropout_grads(true, 5);
    ASSERT_EQ(fused.size(), composite.size());
    double worst = 0, worst_gc = 0;
    for (std::size_t i = 0; i < fused.size(); ++i) {
        const double scale = composite[i].abs().max().item<double>() + 1e-12;
        worst = std::max(worst, max_diff(fused[i], composite[i]) / scale);
        worst_gc = std::max(worst_gc, max_diff(fused_recomputed[i], fused[i]) / scale);
    }
    EXPECT_LE(worst, 1e-4);
    EXPECT_LE(worst_gc, 1e-5);
}

// One process at batch B against two ranks at B/2 with LoRA dropout 0.5: the largest difference of
// the outputs, and the effect of another seed. `grad` runs the forward with autograd on, so the
// linear adapters take the fused LoRA function (dropout applied inside it, with the rank offset).
std::pair<double, double> two_rank_split(bool grad) {
    auto unet = tiny_unet();
    models::LoRAConfig lc;
    lc.rank = 4;
    lc.dropout = 0.5;
    models::LoRAAdapters adapters = models::inject_lora(*unet, lc);
    {
        at::NoGradGuard no_grad;
        auto gen = at::detail::createCPUGenerator(99);
        for (auto& t : adapters.parameters()) t.copy_(at::randn(t.sizes(), gen) * 0.1);  // non-zero B
    }
    unet->train();
    const UNetInputs in;
    const int64_t batch = in.get("sample").size(0);
    EXPECT_GE(batch, 2);
    auto forward = [&](int rank, int world, uint64_t seed = 5) {
        adapters.set_dropout_seed(seed, rank, world);
        const at::AutoGradMode mode(grad);
        const int64_t n = batch / world, lo = rank * n;
        auto rows = [&](const char* name) {
            const at::Tensor t = in.get(name);
            return t.dim() == 0 ? t : t.narrow(0, lo, n);
        };
        return unet
            ->forward(rows("sample"), rows("timestep"), rows("encoder_hidden_states"),
                      {rows("text_embeds"), rows("time_ids")})
            .detach();
    };
    const at::Tensor whole = forward(0, 1);  // [B, C, H, W]
    const at::Tensor split = at::cat({forward(0, 2), forward(1, 2)});
    const at::Tensor other = forward(0, 1, 6);
    return {max_diff(whole, split), max_diff(whole, other)};
}

TEST(LoRATrain, DropoutMasksOfTwoRanksAreTheGlobalBatchsRows) {
    // Issue #25: each rank drew its masks for its own rows, so N ranks × b differed from one
    // process × N·b with dropout on. Both ranks' outputs must be rows of the one-process output.
    const auto [split, seed_effect] = two_rank_split(/*grad=*/false);
    EXPECT_LE(split, 1e-5);
    EXPECT_GT(seed_effect, 1e-4);  // the masks matter at this scale
}

TEST(LoRATrain, FusedDropoutKeepsTheGlobalBatchsRowsAcrossRanks) {
    // The same through the fused linear LoRA function (training forward, autograd on).
    const auto [split, seed_effect] = two_rank_split(/*grad=*/true);
    EXPECT_LE(split, 1e-5);
    EXPECT_GT(seed_effect, 1e-4);
}

}  // namespace
}  // namespace test_lora_train_local
}  // namespace dtune::train
