// AutoencoderTiny (TAESD) against diffusers: tools/ref/gen_taesd_ref.py saved a tiny random
// AutoencoderTiny as a diffusers folder (tests/data/ref/tiny-taesd) and what diffusers' decode and
// encode return for fixed inputs (taesd_io.safetensors). The folder must load strictly and both
// directions must match; a folder of another class is refused naming it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>

#include "core/error.h"
#include "model_test_util.h"
#include "models/vae/autoencoder_tiny.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_autoencoder_tiny_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

const std::filesystem::path kRef = std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref";

TEST(AutoencoderTiny, DecodeAndEncodeMatchDiffusers) {
    AutoencoderTiny taesd = load_autoencoder_tiny(kRef / "tiny-taesd");
    const io::SafetensorsFile io(kRef / "taesd_io.safetensors");
    torch::NoGradGuard no_grad;
    const at::Tensor decoded = taesd->decode(test::fixture_tensor(io, "latents"));
    const at::Tensor want = test::fixture_tensor(io, "decoded");
    ASSERT_EQ(decoded.sizes(), want.sizes());
    const double scale = want.abs().max().item<double>();
    EXPECT_LE(test::reported_diff("decode", decoded, want), 1e-5 * scale);
    const at::Tensor encoded = taesd->encode(test::fixture_tensor(io, "image"));
    const at::Tensor want_enc = test::fixture_tensor(io, "encoded");
    ASSERT_EQ(encoded.sizes(), want_enc.sizes());
    EXPECT_LE(test::reported_diff("encode", encoded, want_enc), 1e-5 * want_enc.abs().max().item<double>());
}

// madebyollin/taef1's shape (tools/ref/gen_taef1_ref.py): 16 latent channels in and out, the
// Flux latents as FluxPipeline holds them.
TEST(AutoencoderTiny, Taef1ShapeMatchesDiffusers) {
    AutoencoderTiny taef1 = load_autoencoder_tiny(kRef / "tiny-taef1");
    EXPECT_EQ(taef1->config().latent_channels, 16);
    const io::SafetensorsFile io(kRef / "taef1_io.safetensors");
    torch::NoGradGuard no_grad;
    const at::Tensor decoded = taef1->decode(test::fixture_tensor(io, "latents"));
    const at::Tensor want = test::fixture_tensor(io, "decoded");
    ASSERT_EQ(decoded.sizes(), want.sizes());
    EXPECT_LE(test::reported_diff("decode", decoded, want), 1e-5 * want.abs().max().item<double>());
    const at::Tensor encoded = taef1->encode(test::fixture_tensor(io, "image"));
    const at::Tensor want_enc = test::fixture_tensor(io, "encoded");
    ASSERT_EQ(encoded.sizes(), want_enc.sizes());
    EXPECT_LE(test::reported_diff("encode", encoded, want_enc), 1e-5 * want_enc.abs().max().item<double>());
    // SDXL's 4-channel latents are not taef1's: refused by shape, naming what it expects.
    EXPECT_THROW(taef1->decode(at::zeros({1, 4, 6, 5})), Error);
}

TEST(AutoencoderTiny, RefusesAnotherClassNamingTheFolder) {
    test::TempDir dir;
    std::filesystem::create_directories(dir / "vae");
    std::ofstream(dir / "vae" / "config.json") << R"({"_class_name": "AutoencoderKL", "act_fn": "silu"})";
    try {
        load_autoencoder_tiny(dir / "vae");
        FAIL() << "an AutoencoderKL folder loaded as a tiny autoencoder";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("AutoencoderTiny"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("vae"), std::string::npos) << e.what();
    }
    EXPECT_THROW(load_autoencoder_tiny(dir / "missing"), Error);
}

}  // namespace
}  // namespace test_autoencoder_tiny_unit_local
}  // namespace dtune::models
