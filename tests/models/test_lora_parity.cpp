// LoRA on the tiny SDXL UNet against PEFT/diffusers (fixtures/reference/lora, made by
// fixtures/gen/gen_fixtures.py): the fixture's pytorch_lora_weights.safetensors loaded into adapters
// injected from lora_config.json must reproduce `out_with_lora`; merged weights give the same
// output; only adapter parameters get gradients; diffusers and ComfyUI files round-trip; bad files
// are DataErrors naming the keys.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "model_test_util.h"
#include "models/adapters/lora_io.h"
#include "models/unet/unet_2d_condition.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_lora_parity_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

constexpr double kTol = 1e-4;  // fixtures README: float32 CPU outputs of order 1

std::filesystem::path lora_dir() {
    return test::fixtures_dir() / "reference" / "lora";
}
std::filesystem::path lora_file() {
    return lora_dir() / "pytorch_lora_weights.safetensors";
}

// The run's LoRA settings as the fixture generator used them (rank, alpha, targets).
LoRAConfig fixture_config() {
    std::ifstream in(lora_dir() / "lora_config.json");
    const auto j = nlohmann::json::parse(in);
    LoRAConfig c;
    c.rank = j.at("rank").get<int64_t>();
    c.alpha = j.at("alpha").get<double>();
    c.target_modules = j.at("target_modules").get<std::vector<std::string>>();
    return c;
}

struct LoRAFixture {
    io::SafetensorsFile io_ref{test::fixtures_dir() / "reference" / "unet_io.safetensors"};
    UNet2DConditionModel unet = load_unet(test::fixtures_dir() / "tiny-sdxl" / "unet");
    at::Tensor get(const std::string& name) const { return test::fixture_tensor(io_ref, name); }
    at::Tensor forward() {
        return unet->forward(get("sample"), get("timestep"), get("encoder_hidden_states"),
                             {get("text_embeds"), get("time_ids")});
    }
    at::Tensor expected() const {
        return test::fixture_tensor(io::SafetensorsFile(lora_dir() / "lora_io.safetensors"), "out_with_lora");
    }
};

TEST(LoRAParity, FixtureLoRAReproducesPeftOutput) {
    LoRAFixture f;
    torch::NoGradGuard no_grad;
    const at::Tensor expected = f.expected();
    // Without the LoRA the output must be far off, or this test could not fail.
    EXPECT_GT(test::max_abs_diff(f.forward(), expected), 100 * kTol);
    LoRAAdapters adapters = inject_lora(*f.unet, fixture_config());
    // One adapter per down/up pair in the file: every attention projection of the tiny UNet.
    EXPECT_EQ(adapters.size(), io::SafetensorsFile(lora_file()).keys().size() / 2);
    const LoRALoadReport report = load_lora(adapters, lora_file());
    EXPECT_EQ(report.modules_loaded, adapters.size());
    EXPECT_EQ(report.format, "diffusers");
    const at::Tensor out = f.forward();
    ASSERT_EQ(out.sizes(), expected.sizes());
    EXPECT_LE(test::reported_diff("out_with_lora", out, expected), kTol);
}

TEST(LoRAParity, MergedWeightsGiveTheSameOutput) {
    LoRAFixture f;
    torch::NoGradGuard no_grad;
    LoRAAdapters adapters = inject_lora(*f.unet, fixture_config());
    load_lora(adapters, lora_file());
    const std::string probe = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight";
    const at::Tensor before = f.unet->named_parameters().find(probe)->clone();
    adapters.merge();
    EXPECT_GT(test::max_abs_diff(*f.unet->named_parameters().find(probe), before), 1e-3);  // merged
    EXPECT_LE(test::reported_diff("merged", f.forward(), f.expected()), kTol);
    adapters.unmerge();
    EXPECT_LE(test::max_abs_diff(*f.unet->named_parameters().find(probe), before), 1e-6);
    EXPECT_LE(test::reported_diff("unmerged", f.forward(), f.expected()), kTol);
}

TEST(LoRAParity, OnlyAdapterParametersGetGradients) {
    LoRAFixture f;
    LoRAAdapters adapters = inject_lora(*f.unet, fixture_config());
    load_lora(adapters, lora_file());  // non-zero B, so A's gradient is non-zero too
    f.forward().square().mean().backward();
    std::set<std::string> adapter_names;
    for (const auto& [name, t] : adapters.named_parameters()) adapter_names.insert(name);
    std::size_t with_grad = 0;
    for (const auto& item : f.unet->named_parameters()) {
        const bool is_adapter = adapter_names.count(item.key()) != 0;
        if (is_adapter) {
            ASSERT_TRUE(item.value().grad().defined()) << item.key();
            EXPECT_GT(item.value().grad().abs().sum().item<double>(), 0.0) << item.key();
            ++with_grad;
        } else {
            EXPECT_FALSE(item.value().requires_grad()) << item.key();
            EXPECT_FALSE(item.value().grad().defined()) << item.key();
        }
    }
    EXPECT_EQ(with_grad, adapters.size() * 2);
}

// Gradient checkpointing recomputes the blocks in backward; adapter gradients must not change.
TEST(LoRAParity, CheckpointingGivesTheSameAdapterGradients) {
    LoRAFixture f;
    LoRAAdapters adapters = inject_lora(*f.unet, fixture_config());
    load_lora(adapters, lora_file());
    f.forward().square().mean().backward();
    std::vector<at::Tensor> plain;
    for (auto& t : adapters.parameters()) plain.push_back(t.grad().clone());
    f.unet->zero_grad();
    f.unet->set_gradient_checkpointing(true);
    f.forward().square().mean().backward();
    const auto params = adapters.parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
        ASSERT_TRUE(params[i].grad().defined());
        EXPECT_LE(test::max_abs_diff(params[i].grad(), plain[i]),
                  1e-7 + 1e-5 * plain[i].abs().max().item<double>());
    }
}

// Saves in `format`, loads into a fresh model and compares outputs bit for bit.
void round_trip(LoRAFormat format, const std::string& expected_first_key) {
    LoRAFixture f;
    torch::NoGradGuard no_grad;
    LoRAAdapters adapters = inject_lora(*f.unet, fixture_config());
    load_lora(adapters, lora_file());
    const at::Tensor out = f.forward();
    test::TempDir tmp;
    const auto path = tmp.path() / "pytorch_lora_weights.safetensors";
    save_lora(adapters, path, format);
    EXPECT_TRUE(io::SafetensorsFile(path).contains(expected_first_key));

    LoRAFixture g;
    LoRAConfig other = fixture_config();
    other.alpha = 1.0;  // the file's alpha (metadata or .alpha) must win over the injected one
    LoRAAdapters loaded = inject_lora(*g.unet, other);
    load_lora(loaded, path);
    EXPECT_TRUE(torch::equal(g.forward(), out));
}

TEST(LoRAParity, DiffusersFileRoundTripsWithTheFixtureKeyNames) {
    round_trip(LoRAFormat::kDiffusers,
               "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_k.lora.down.weight");
    // Same key set as diffusers' own export.
    LoRAFixture f;
    LoRAAdapters adapters = inject_lora(*f.unet, fixture_config());
    test::TempDir tmp;
    save_lora(adapters, tmp.path() / "a.safetensors", LoRAFormat::kDiffusers);
    const auto ours = io::SafetensorsFile(tmp.path() / "a.safetensors").keys();
    const auto theirs = io::SafetensorsFile(lora_file()).keys();
    EXPECT_EQ(ours, theirs);
}

TEST(LoRAParity, ComfyUIFileRoundTrips) {
    round_trip(LoRAFormat::kComfyUI,
               "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_k.alpha");
}

TEST(LoRAParity, KeysMatchingNoModuleAreListed) {
    LoRAFixture f;
    LoRAAdapters adapters = inject_lora(*f.unet, fixture_config());
    test::TempDir tmp;
    const auto path = tmp.path() / "bad.safetensors";
    io::save_safetensors(path, {{"unet.down_blocks.9.attn1.to_q.lora.down.weight", at::zeros({4, 64})},
                                {"unet.down_blocks.9.attn1.to_q.lora.up.weight", at::zeros({64, 4})}});
    try {
        load_lora(adapters, path);
        FAIL() << "expected DataError";
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("unet.down_blocks.9.attn1.to_q.lora.down.weight"),
                  std::string::npos)
            << e.what();
    }
}

TEST(LoRAParity, RankMismatchIsListed) {
    LoRAFixture f;
    LoRAConfig c = fixture_config();
    c.rank = 8;
    LoRAAdapters adapters = inject_lora(*f.unet, c);
    try {
        load_lora(adapters, lora_file());
        FAIL() << "expected DataError";
    } catch (const DataError& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("file rank 4, model rank 8"), std::string::npos) << msg;
        EXPECT_NE(msg.find("attn1.to_k"), std::string::npos) << msg;
    }
}

}  // namespace
}  // namespace test_lora_parity_local
}  // namespace dtune::models
