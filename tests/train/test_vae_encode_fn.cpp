// The training VAE callable (train::make_vae_encode_fn) on the tiny fixture VAE: each row is the
// posterior sample mean + std * eps with eps drawn from a CPU generator seeded by the image's
// content hash, scaled; so a row does not depend on its batch or position, and the channels-last
// variant gives the same latents in the standard layout.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "models/vae/autoencoder_kl.h"
#include "support/test_support.h"
#include "train/sdxl_data_encoders.h"

namespace dtune::train {
namespace {

class VaeEncodeFnTest : public ::testing::Test {
  protected:
    models::AutoencoderKL vae = models::load_autoencoder_kl(test::fixtures_dir() / "tiny-sdxl" / "vae");
    at::Tensor images = at::rand({3, 3, 64, 48}, at::Generator(at::detail::createCPUGenerator(7))) * 2 - 1;
};

TEST_F(VaeEncodeFnTest, RowsArePixelSeededScaledPosteriorSamples) {
    const auto encode = make_vae_encode_fn(vae.ptr(), c10::Device(c10::kCPU), at::kFloat);
    const at::Tensor got = encode(images);  // [3, C, 8, 6]
    ASSERT_EQ(got.dim(), 4);
    EXPECT_EQ(got.size(0), 3);
    EXPECT_EQ(got.size(2), 8);
    EXPECT_EQ(got.size(3), 6);
    const double scaling = vae->config().scaling_factor, shift = vae->config().shift_factor;
    at::NoGradGuard no_grad;
    for (int64_t i = 0; i < 3; ++i) {
        // Independently: one image alone, eps from its own seeded generator.
        const auto posterior = vae->encode(images.narrow(0, i, 1));  // [1, C, h, w] each
        at::Generator g = at::detail::createCPUGenerator(tensor_content_hash(images[i]) >> 1);
        const at::Tensor eps = at::randn(posterior.mean.sizes().slice(1), g, at::kFloat);  // [C, h, w]
        const at::Tensor want = ((posterior.mean[0] + posterior.std[0] * eps) - shift) * scaling;
        EXPECT_TRUE(at::allclose(got[i], want, 1e-5, 1e-6)) << "row " << i;
    }
    // Another order in the batch permutes the rows and changes nothing else.
    const at::Tensor order = at::tensor({2, 0, 1}, at::kLong);
    EXPECT_TRUE(at::allclose(encode(images.index_select(0, order)), got.index_select(0, order), 1e-5, 1e-6));
    // Another image gets other noise: rows of equal-mean inputs still differ.
    EXPECT_FALSE(at::allclose(got[0], got[1]));
}

TEST_F(VaeEncodeFnTest, ChannelsLastGivesTheSameLatentsInTheStandardLayout) {
    const at::Tensor plain = make_vae_encode_fn(vae.ptr(), c10::Device(c10::kCPU), at::kFloat)(images);
    auto copy = models::load_autoencoder_kl(test::fixtures_dir() / "tiny-sdxl" / "vae");
    const at::Tensor nhwc =
        make_vae_encode_fn(copy.ptr(), c10::Device(c10::kCPU), at::kFloat, {.channels_last = true})(images);
    EXPECT_TRUE(nhwc.is_contiguous());
    EXPECT_TRUE(at::allclose(nhwc, plain, 1e-4, 1e-5)) << (nhwc - plain).abs().max().item<double>();
}

}  // namespace
}  // namespace dtune::train
