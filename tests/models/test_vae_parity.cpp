// AutoencoderKL against diffusers (fixtures/reference/vae_io.safetensors from the tiny SDXL VAE):
// posterior mean/std of a square and a non-square image, and the decoded latent.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "model_test_util.h"
#include "models/vae/autoencoder_kl.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_vae_parity_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

constexpr double kTol = 1e-4;

struct VAEFixture {
    io::SafetensorsFile ref{test::fixtures_dir() / "reference" / "vae_io.safetensors"};
    AutoencoderKL vae = load_autoencoder_kl(test::fixtures_dir() / "tiny-sdxl" / "vae");
    at::Tensor get(const std::string& name) const { return test::fixture_tensor(ref, name); }
};

TEST(VAEParity, PosteriorMatchesDiffusers) {
    VAEFixture f;
    torch::NoGradGuard no_grad;
    const DiagonalGaussian post = f.vae->encode(f.get("image"));
    ASSERT_EQ(post.mean.sizes(), f.get("posterior_mean").sizes());
    EXPECT_LE(test::reported_diff("mean", post.mean, f.get("posterior_mean")), kTol);
    EXPECT_LE(test::reported_diff("std", post.std, f.get("posterior_std")), kTol);
}

TEST(VAEParity, NonSquarePosteriorMatchesDiffusers) {
    VAEFixture f;
    torch::NoGradGuard no_grad;
    const DiagonalGaussian post = f.vae->encode(f.get("image_nonsquare"));
    const at::Tensor expected = f.get("posterior_mean_nonsquare");
    ASSERT_EQ(post.mean.sizes(), expected.sizes());
    EXPECT_LE(test::reported_diff("mean", post.mean, expected), kTol);
}

TEST(VAEParity, DecodeMatchesDiffusers) {
    VAEFixture f;
    torch::NoGradGuard no_grad;
    const at::Tensor out = f.vae->decode(f.get("latent"));
    const at::Tensor expected = f.get("decoded");
    ASSERT_EQ(out.sizes(), expected.sizes());
    EXPECT_LE(test::reported_diff("output", out, expected), kTol);
}

TEST(VAEParity, ConfigValuesAreRead) {
    VAEFixture f;
    EXPECT_DOUBLE_EQ(f.vae->config().scaling_factor, 0.13025);
    EXPECT_TRUE(f.vae->config().force_upcast);
    EXPECT_EQ(f.vae->config().downsampling_factor(), 8);
}

}  // namespace
}  // namespace test_vae_parity_local
}  // namespace dtune::models
