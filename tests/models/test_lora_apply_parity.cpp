// apply_lora_file (inference LoRA, `dtune sample --lora`) on the tiny UNet against the fixture's
// PEFT output `out_with_lora`, made with rank 4 / alpha 8 (lora_config.json), i.e. scale 2. The
// fixture file itself carries no alpha, so (as diffusers' load_lora_weights) it loads with alpha =
// rank: strength alpha/rank = 2 reproduces the reference, and so does strength 1 once the file
// states lora_alpha 8 (diffusers metadata, PEFT layout) or per-module kohya `.alpha`. Strength 0 is
// exactly the base output; other strengths differ from both; unknown layers are a listed DataError.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "model_test_util.h"
#include "models/adapters/lora_apply.h"
#include "models/adapters/lora_io.h"
#include "models/unet/unet_2d_condition.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_lora_apply_parity_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

constexpr double kTol = 1e-4;  // fixtures README

std::filesystem::path lora_file() {
    return test::fixtures_dir() / "reference" / "lora" / "pytorch_lora_weights.safetensors";
}

struct Fixture {
    io::SafetensorsFile io_ref{test::fixtures_dir() / "reference" / "unet_io.safetensors"};
    UNet2DConditionModel unet = load_unet(test::fixtures_dir() / "tiny-sdxl" / "unet");
    at::Tensor get(const std::string& name) const { return test::fixture_tensor(io_ref, name); }
    at::Tensor forward() {
        torch::NoGradGuard no_grad;
        return unet->forward(get("sample"), get("timestep"), get("encoder_hidden_states"),
                             {get("text_embeds"), get("time_ids")});
    }
};

// The reference's scale alpha / rank, from the fixture's own config.
double reference_scale() {
    const auto j = nlohmann::json::parse(
        fs::read_file(test::fixtures_dir() / "reference" / "lora" / "lora_config.json"));
    return j.at("alpha").get<double>() / j.at("rank").get<double>();
}

at::Tensor expected_with_lora() {
    return test::fixture_tensor(
        io::SafetensorsFile(test::fixtures_dir() / "reference" / "lora" / "lora_io.safetensors"),
        "out_with_lora");
}

TEST(LoRAApplyParity, ReferenceScaleReproducesTheReference) {
    Fixture f;
    const at::Tensor expected = expected_with_lora();
    EXPECT_GT(test::max_abs_diff(f.forward(), expected), 100 * kTol);  // the LoRA matters
    ASSERT_DOUBLE_EQ(reference_scale(), 2.0);
    const LoRAAdapters adapters = apply_lora_file(*f.unet, lora_file(), reference_scale());
    EXPECT_EQ(adapters.size(), io::SafetensorsFile(lora_file()).keys().size() / 2);
    EXPECT_LE(test::reported_diff("out_with_lora", f.forward(), expected), kTol);
}

TEST(LoRAApplyParity, StrengthZeroIsExactlyTheBaseModel) {
    Fixture f;
    const at::Tensor base = f.forward();
    apply_lora_file(*f.unet, lora_file(), 0.0);
    EXPECT_TRUE(at::equal(f.forward(), base));
}

TEST(LoRAApplyParity, OtherStrengthsDifferFromBaseAndFull) {
    Fixture base_f;
    const at::Tensor base = base_f.forward();
    const at::Tensor full = expected_with_lora();
    Fixture f;
    apply_lora_file(*f.unet, lora_file(), 1.0);
    const at::Tensor half = f.forward();
    EXPECT_GT(test::max_abs_diff(half, base), 10 * kTol);
    EXPECT_GT(test::max_abs_diff(half, full), 10 * kTol);
    Fixture g;
    apply_lora_file(*g.unet, lora_file(), -1.0);  // negative strength inverts the adaptation
    EXPECT_GT(test::max_abs_diff(g.forward(), base), 10 * kTol);
}

TEST(LoRAApplyParity, FilesStatingAlphaReproduceTheReferenceAtStrengthOne) {
    test::TempDir dir;
    // kohya/ComfyUI: written by our own save_lora from adapters at the reference scale, so each
    // module's `.alpha` is 8.
    {
        Fixture f;
        LoRAAdapters adapters = apply_lora_file(*f.unet, lora_file(), reference_scale());
        save_lora(adapters, dir / "kohya.safetensors", LoRAFormat::kComfyUI);
    }
    // PEFT: the fixture's tensors renamed to base_model.model.<module>.lora_A/lora_B.weight, with
    // diffusers' adapter metadata stating lora_alpha 8.
    {
        const io::SafetensorsFile src(lora_file());
        io::TensorList peft;
        for (const auto& k : src.keys()) {
            std::string name = k.substr(std::string("unet.").size());
            for (const auto& [from, to] : {std::pair{".lora.down.weight", ".lora_A.weight"},
                                           std::pair{".lora.up.weight", ".lora_B.weight"}})
                if (name.ends_with(from)) name = name.substr(0, name.size() - std::strlen(from)) + to;
            peft.emplace_back("base_model.model." + name, src.get(k));
        }
        io::Metadata meta = src.metadata();
        meta["lora_adapter_metadata"] = R"({"r": 4, "lora_alpha": 8})";
        io::save_safetensors(dir / "peft.safetensors", peft, meta);
    }
    const at::Tensor expected = expected_with_lora();
    for (const char* name : {"kohya.safetensors", "peft.safetensors"}) {
        Fixture f;
        apply_lora_file(*f.unet, dir / name, 1.0);
        EXPECT_LE(test::reported_diff(name, f.forward(), expected), kTol) << name;
    }
}

TEST(LoRAApplyParity, UnknownLayersAreListed) {
    test::TempDir dir;
    io::save_safetensors(dir / "bad.safetensors",
                         {{"unet.no_such_block.to_q.lora.down.weight", at::zeros({4, 8})},
                          {"unet.no_such_block.to_q.lora.up.weight", at::zeros({8, 4})}});
    Fixture f;
    try {
        apply_lora_file(*f.unet, dir / "bad.safetensors", 1.0);
        FAIL() << "unknown layers must be an error";
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("unet.no_such_block.to_q.lora.down.weight"), std::string::npos)
            << e.what();
    }
}

}  // namespace
}  // namespace test_lora_apply_parity_local
}  // namespace dtune::models
