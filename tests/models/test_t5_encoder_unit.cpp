// T5 v1.1 encoder against transformers: tools/ref/gen_t5_ref.py saved a tiny random T5EncoderModel
// (gated-gelu, relative attention bias, 2 blocks) as a transformers folder (tests/data/ref/tiny-t5)
// and what transformers returns for fixed ids with and without a padding mask (t5_io.safetensors).
// The folder must load strictly and match in float32; bfloat16 and float16 loads must stay close;
// the tied token table loads from either of its keys; an unsupported feed-forward is refused.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>

#include "core/error.h"
#include "io/safetensors.h"
#include "model_test_util.h"
#include "models/t5/t5_encoder.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_t5_encoder_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

const std::filesystem::path kRef = std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref";

struct T5Fixture {
    io::SafetensorsFile io{kRef / "t5_io.safetensors"};
    at::Tensor ids = test::fixture_tensor(io, "input_ids");            // [2, 11]
    at::Tensor mask = test::fixture_tensor(io, "attention_mask");      // [2, 11], row 1 padded
    at::Tensor plain = test::fixture_tensor(io, "last_hidden_state");  // [2, 11, 32]
    at::Tensor masked = test::fixture_tensor(io, "last_hidden_state_masked");
};

TEST(T5Encoder, MatchesTransformersWithAndWithoutMask) {
    T5EncoderModel t5 = load_t5_encoder(kRef / "tiny-t5");
    const T5Fixture f;
    torch::NoGradGuard no_grad;
    const at::Tensor plain = t5->forward(f.ids);
    ASSERT_EQ(plain.sizes(), f.plain.sizes());
    EXPECT_LE(test::reported_diff("no mask", plain, f.plain), 1e-5 * f.plain.abs().max().item<double>());
    const at::Tensor masked = t5->forward(f.ids, f.mask);
    ASSERT_EQ(masked.sizes(), f.masked.sizes());
    EXPECT_LE(test::reported_diff("mask", masked, f.masked), 1e-5 * f.masked.abs().max().item<double>());
    // The padding must matter, or the masked case would test nothing.
    EXPECT_GT(test::max_abs_diff(f.plain, f.masked), 0.1);
}

// A single .safetensors with transformers' keys (ComfyUI's t5xxl_fp16 / t5xxl_fp8_e4m3fn) loads with
// the folder's config: the same file gives the same output, an fp16 copy loads into float32 close
// to it.
TEST(T5Encoder, LoadsASingleFileWithTheFoldersConfig) {
    test::TempDir dir;
    const T5Fixture f;
    io::TensorList fp16;
    for (const auto& [k, v] : io::load_safetensors(kRef / "tiny-t5" / "model.safetensors"))
        fp16.emplace_back(k, v.to(at::kHalf));
    io::save_safetensors(dir / "t5xxl_fp16.safetensors", fp16);
    torch::NoGradGuard no_grad;
    const at::Tensor folder = load_t5_encoder(kRef / "tiny-t5")->forward(f.ids);
    ComponentLoadOptions same;
    same.single_file = kRef / "tiny-t5" / "model.safetensors";
    EXPECT_TRUE(at::equal(load_t5_encoder(kRef / "tiny-t5", same)->forward(f.ids), folder));
    ComponentLoadOptions half;
    half.single_file = dir / "t5xxl_fp16.safetensors";
    const at::Tensor out = load_t5_encoder(kRef / "tiny-t5", half)->forward(f.ids);
    EXPECT_EQ(out.scalar_type(), at::kFloat);
    EXPECT_LE(test::reported_diff("fp16 file", out, folder), 1e-2 * folder.abs().max().item<double>());
}

TEST(T5Encoder, ReducedPrecisionStaysCloseToFloat32) {
    const T5Fixture f;
    const double scale = f.masked.abs().max().item<double>();
    for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
        ComponentLoadOptions options;
        options.dtype = dtype;
        T5EncoderModel t5 = load_t5_encoder(kRef / "tiny-t5", options);
        torch::NoGradGuard no_grad;
        const at::Tensor out = t5->forward(f.ids, f.mask);
        EXPECT_EQ(out.scalar_type(), dtype);
        EXPECT_LE(test::reported_diff(c10::toString(dtype), out, f.masked), 2e-2 * scale);
        for (const auto& p : t5->named_parameters()) {  // float16 keeps wo in float32, as transformers
            const bool fp32_wo = dtype == at::kHalf && p.key().ends_with("DenseReluDense.wo.weight");
            EXPECT_EQ(p.value().scalar_type(), fp32_wo ? at::kFloat : dtype) << p.key();
        }
    }
}

TEST(T5Encoder, LoadsTheTiedTokenTableFromEitherKey) {
    const io::SafetensorsFile weights(kRef / "tiny-t5" / "model.safetensors");
    const T5Fixture f;
    for (const bool keep_shared : {false, true}) {
        test::TempDir dir;
        std::filesystem::copy_file(kRef / "tiny-t5" / "config.json", dir / "config.json");
        io::TensorList tensors;
        for (const auto& key : weights.keys()) {
            tensors.emplace_back(key, weights.get(key));
            if (key == "shared.weight") {
                tensors.back().first = "encoder.embed_tokens.weight";
                if (keep_shared) tensors.emplace_back(key, weights.get(key));
            }
        }
        io::save_safetensors(dir / "model.safetensors", tensors);
        T5EncoderModel t5 = load_t5_encoder(dir.path());
        torch::NoGradGuard no_grad;
        EXPECT_LE(test::max_abs_diff(t5->forward(f.ids), f.plain), 1e-5 * f.plain.abs().max().item<double>())
            << "shared.weight also present: " << keep_shared;
    }
}

TEST(T5Encoder, RefusesAnUnsupportedFeedForwardNamingTheKey) {
    std::ifstream in(kRef / "tiny-t5" / "config.json");
    nlohmann::json config = nlohmann::json::parse(in);
    for (const char* value : {"relu", "gated-silu"}) {
        config["feed_forward_proj"] = value;
        test::TempDir dir;
        std::ofstream(dir / "config.json") << config.dump();
        try {
            load_t5_encoder(dir.path());
            FAIL() << "feed_forward_proj " << value << " was accepted";
        } catch (const UsageError& e) {
            EXPECT_NE(std::string(e.what()).find("feed_forward_proj"), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find(value), std::string::npos) << e.what();
        }
    }
    EXPECT_THROW(load_t5_encoder(kRef / "missing-t5"), Error);
}

}  // namespace
}  // namespace test_t5_encoder_unit_local
}  // namespace dtune::models
