// AutoencoderKL without reference outputs: tile assembly (exact on local operators), tiled vs
// untiled encode/decode on the tiny VAE, posterior sampling, latent scaling, force_upcast, errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/error.h"
#include "model_test_util.h"
#include "models/vae/autoencoder_kl.h"
#include "support/test_support.h"

namespace dtune::models {
namespace {

std::filesystem::path tiny_vae() {
    return test::fixtures_dir() / "tiny-sdxl" / "vae";
}

// A smooth image in [-1, 1]: tiles see similar statistics, as with natural images.
at::Tensor smooth_image(int64_t h, int64_t w) {
    at::Tensor y = at::linspace(0, 3.0, h).view({1, 1, h, 1});
    at::Tensor x = at::linspace(0, 4.0, w).view({1, 1, 1, w});
    at::Tensor c = at::tensor({0.5, 1.0, 1.5}).view({1, 3, 1, 1});
    return (0.8 * (y * c + x).sin()).contiguous();  // [1, 3, h, w]
}

TEST(VAEUnit, TilesReassembleLocalOperatorsExactly) {
    at::manual_seed(0);
    const at::Tensor x = at::randn({1, 2, 40, 52});
    // Identity: overlapping tiles hold the same values, so blending must give x back.
    const at::Tensor same = run_tiled(x, 16, 0.25, 1.0, [](const at::Tensor& t) { return t; });
    EXPECT_LE(test::max_abs_diff(same, x), 1e-6);
    // 2x2 average pooling, scale 1/2: the stride (12) is even so every tile is grid-aligned.
    auto pool = [](const at::Tensor& t) { return at::avg_pool2d(t, {2, 2}); };
    const at::Tensor pooled = run_tiled(x, 16, 0.25, 0.5, pool);
    EXPECT_EQ(pooled.sizes(), (std::vector<int64_t>{1, 2, 20, 26}));
    EXPECT_LE(test::max_abs_diff(pooled, pool(x)), 1e-6);
    // 2x nearest upsampling, scale 2.
    auto up = [](const at::Tensor& t) { return at::upsample_nearest2d(t, {t.size(2) * 2, t.size(3) * 2}); };
    EXPECT_LE(test::max_abs_diff(run_tiled(x, 8, 0.25, 2.0, up), up(x)), 1e-6);
}

TEST(VAEUnit, TiledEncodeAndDecodeAreCloseToUntiled) {
    AutoencoderKL vae = load_autoencoder_kl(tiny_vae());
    torch::NoGradGuard no_grad;
    const at::Tensor image = smooth_image(128, 160);
    const at::Tensor mean = vae->encode(image).mean;
    VAETileOptions tiles;
    tiles.tile_sample_size = 64;
    const at::Tensor tiled_mean = vae->encode_tiled(image, tiles).mean;
    ASSERT_EQ(tiled_mean.sizes(), mean.sizes());
    const double enc_err = (tiled_mean - mean).abs().mean().item<double>() / mean.abs().mean().item<double>();
    EXPECT_LT(enc_err, 0.2) << "mean relative error of tiled encode";

    const at::Tensor latents = vae->encode(image).mean;  // smooth latents [1, 4, 16, 20]
    const at::Tensor decoded = vae->decode(latents);
    const at::Tensor tiled = vae->decode_tiled(latents, tiles);
    ASSERT_EQ(tiled.sizes(), decoded.sizes());
    const double dec_err =
        (tiled - decoded).abs().mean().item<double>() / decoded.abs().mean().item<double>();
    EXPECT_LT(dec_err, 0.2) << "mean relative error of tiled decode";

    // A tile at least as large as the input is the untiled computation.
    tiles.tile_sample_size = 256;
    EXPECT_TRUE(at::allclose(vae->decode_tiled(latents, tiles), decoded, 0, 1e-6));
}

TEST(VAEUnit, SampleIsMeanPlusStdTimesGeneratorNoise) {
    AutoencoderKL vae = load_autoencoder_kl(tiny_vae());
    torch::NoGradGuard no_grad;
    const DiagonalGaussian post = vae->encode(smooth_image(32, 32));
    EXPECT_TRUE(at::allclose(post.std, (0.5 * post.logvar).exp()));
    at::Generator g1 = at::detail::createCPUGenerator(42);
    at::Generator g2 = at::detail::createCPUGenerator(42);
    const at::Tensor noise = at::empty_like(post.mean).normal_(0.0, 1.0, g2);
    EXPECT_TRUE(at::allclose(post.sample(g1), post.mean + post.std * noise));
    EXPECT_TRUE(at::equal(post.mode(), post.mean));
}

TEST(VAEUnit, LatentScalingUsesConfigFactors) {
    AutoencoderKL vae = load_autoencoder_kl(tiny_vae());
    const at::Tensor z = at::randn({1, 4, 2, 2});
    EXPECT_TRUE(at::allclose(vae->scale_latents(z), z * 0.13025));
    EXPECT_TRUE(at::allclose(vae->unscale_latents(vae->scale_latents(z)), z));
}

TEST(VAEUnit, ForceUpcastKeepsFp32WeightsForFp16) {
    ComponentLoadOptions fp16;
    fp16.dtype = at::kHalf;
    EXPECT_EQ(load_autoencoder_kl(tiny_vae(), fp16)->parameters()[0].scalar_type(), at::kFloat);
    ComponentLoadOptions bf16;
    bf16.dtype = at::kBFloat16;
    AutoencoderKL vae = load_autoencoder_kl(tiny_vae(), bf16);
    EXPECT_EQ(vae->parameters()[0].scalar_type(), at::kBFloat16);
    torch::NoGradGuard no_grad;
    EXPECT_EQ(vae->decode(at::randn({1, 4, 4, 4})).scalar_type(), at::kFloat);  // returns the input's dtype
}

TEST(VAEUnit, ErrorsNameThePathOrShape) {
    test::TempDir dir;
    try {
        load_autoencoder_kl(dir / "vae");
        ADD_FAILURE();
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find((dir / "vae").string()), std::string::npos) << e.what();
    }
    AutoencoderKL vae = load_autoencoder_kl(tiny_vae());
    torch::NoGradGuard no_grad;
    EXPECT_THROW(vae->encode(at::zeros({1, 3, 30, 32})), UsageError);  // not a multiple of 8
    EXPECT_THROW(vae->decode(at::zeros({1, 3, 4, 4})), UsageError);    // 3 latent channels
}

}  // namespace
}  // namespace dtune::models
