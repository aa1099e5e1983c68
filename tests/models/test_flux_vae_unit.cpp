// Flux.1's VAE is diffusers' AutoencoderKL with 16 latent channels, no quant_conv /
// post_quant_conv and a shift_factor: tools/ref/gen_flux_vae_ref.py saved a tiny random one with
// those options (tests/data/ref/tiny-flux-vae) and what diffusers computes with it
// (flux_vae_io.safetensors). dtune's AutoencoderKL must load it strictly and match encode, decode
// and the (z - shift) · scale latents the Flux pipeline and training use.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "model_test_util.h"
#include "models/vae/autoencoder_kl.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_flux_vae_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

const std::filesystem::path kRef = std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref";

TEST(FluxVae, SixteenChannelsAndShiftMatchDiffusers) {
    AutoencoderKL vae = load_autoencoder_kl(kRef / "tiny-flux-vae");
    EXPECT_EQ(vae->config().latent_channels, 16);
    EXPECT_FALSE(vae->config().use_quant_conv);
    EXPECT_DOUBLE_EQ(vae->config().shift_factor, 0.1159);
    const io::SafetensorsFile io(kRef / "flux_vae_io.safetensors");
    const auto get = [&](const char* n) { return test::fixture_tensor(io, n); };
    torch::NoGradGuard no_grad;
    const DiagonalGaussian d = vae->encode(get("image"));
    const auto check = [](const char* what, const at::Tensor& got, const at::Tensor& want) {
        ASSERT_EQ(got.sizes(), want.sizes()) << what;
        EXPECT_LE(test::reported_diff(what, got, want), 1e-5 * (1 + want.abs().max().item<double>())) << what;
    };
    check("mean", d.mean, get("mean"));
    check("logvar", d.logvar, get("logvar"));
    check("scaled", vae->scale_latents(d.mean), get("scaled"));
    check("decoded", vae->decode(get("latents")), get("decoded"));
    EXPECT_TRUE(at::allclose(vae->unscale_latents(vae->scale_latents(d.mean)), d.mean, 1e-6, 1e-6));
}

}  // namespace
}  // namespace test_flux_vae_unit_local
}  // namespace dtune::models
