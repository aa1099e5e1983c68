// AutoencoderKL without reference outputs: tile assembly (exact on local operators), tiled vs
// untiled encode/decode on the tiny VAE, posterior sampling, latent scaling, force_upcast, errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/error.h"
#include "model_test_util.h"
#include "models/vae/autoencoder_kl.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_vae_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

std::filesystem::path tiny_vae() {
    return test::fixtures_dir() / "tiny-sdxl" / "vae";
}

// A smooth image in [-1, 1] with period `period` pixels in both directions. When the tile stride
// is a multiple of the period every tile sees the same GroupNorm statistics and the same set of
// attention keys as the whole image, so tiled and untiled differ only by tile-edge effects
// (random weights would otherwise make any two crops of a natural image disagree).
at::Tensor periodic_image(int64_t h, int64_t w, int64_t period = 16) {
    const double k = 2 * M_PI / static_cast<double>(period);
    at::Tensor y = (at::arange(h, at::kFloat) * k).view({1, 1, h, 1});
    at::Tensor x = (at::arange(w, at::kFloat) * k).view({1, 1, 1, w});
    at::Tensor c = at::tensor({0.3, 1.1, 2.0}).view({1, 3, 1, 1});
    return (0.8 * (y + c).sin() * (x - c).cos()).contiguous();  // [1, 3, h, w]
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

// With random weights the tiny VAE is far from local (edge effects of zero padding spread through
// GroupNorm statistics and the global mid-block attention), so tiled and untiled outputs of a whole
// image differ by O(1) and closeness can only be judged with trained weights. What is checked here:
// the region that only the first tile covers equals the model run on that crop, the assembled
// output has the untiled shape, and a tile covering the input reproduces the untiled output.
TEST(VAEUnit, TiledEncodeAndDecodeRunTheModelOnTiles) {
    AutoencoderKL vae = load_autoencoder_kl(tiny_vae());
    torch::NoGradGuard no_grad;
    const at::Tensor image = periodic_image(128, 160);
    VAETileOptions tiles;
    tiles.tile_sample_size = 64;  // latent tile 8, blend 2, so each tile contributes 6x6 latents
    const DiagonalGaussian full = vae->encode(image);
    const DiagonalGaussian tiled = vae->encode_tiled(image, tiles);
    ASSERT_EQ(tiled.mean.sizes(), full.mean.sizes());
    const at::Tensor first = vae->encode(image.narrow(2, 0, 64).narrow(3, 0, 64)).mean;  // [1, 4, 8, 8]
    EXPECT_LE(
        test::max_abs_diff(tiled.mean.narrow(2, 0, 6).narrow(3, 0, 6), first.narrow(2, 0, 6).narrow(3, 0, 6)),
        1e-5);
    EXPECT_GT(test::max_abs_diff(tiled.mean, full.mean), 1e-3);  // the tiled path really tiled

    const at::Tensor latents = full.mean;  // [1, 4, 16, 20]
    const at::Tensor decoded = vae->decode(latents);
    const at::Tensor tiled_decoded = vae->decode_tiled(latents, tiles);
    ASSERT_EQ(tiled_decoded.sizes(), decoded.sizes());
    const at::Tensor first_dec = vae->decode(latents.narrow(2, 0, 8).narrow(3, 0, 8));  // [1, 3, 64, 64]
    EXPECT_LE(test::max_abs_diff(tiled_decoded.narrow(2, 0, 48).narrow(3, 0, 48),
                                 first_dec.narrow(2, 0, 48).narrow(3, 0, 48)),
              1e-5);

    tiles.tile_sample_size = 256;  // one tile covers everything: the untiled computation
    EXPECT_LE(test::max_abs_diff(vae->decode_tiled(latents, tiles), decoded), 1e-6);
    EXPECT_LE(test::max_abs_diff(vae->encode_tiled(image, tiles).mean, full.mean), 1e-6);
}

TEST(VAEUnit, SampleIsMeanPlusStdTimesGeneratorNoise) {
    AutoencoderKL vae = load_autoencoder_kl(tiny_vae());
    torch::NoGradGuard no_grad;
    const DiagonalGaussian post = vae->encode(periodic_image(32, 32));
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
}  // namespace test_vae_unit_local
}  // namespace dtune::models
