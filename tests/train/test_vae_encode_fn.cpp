// The training VAE callable (family::make_vae_encode_fn) on the tiny fixture VAE: each row is the
// posterior sample mean + std * eps with eps drawn from a CPU generator seeded by the image's
// content hash, scaled; so a row does not depend on its batch or position, and the channels-last
// variant gives the same latents in the standard layout; so does the NHWC GroupNorm.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <torch/torch.h>
#include <filesystem>
#include <fstream>

#include "family/data_encoders.h"
#include "models/common/blocks.h"
#include "models/vae/autoencoder_kl.h"
#include "support/test_support.h"

namespace dtune::family {
namespace test_vae_encode_fn_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

class VaeEncodeFnTest : public ::testing::Test {
  protected:
    models::AutoencoderKL vae = models::load_autoencoder_kl(test::fixtures_dir() / "tiny-sdxl" / "vae");
    at::Tensor images = at::rand({3, 3, 64, 48}, at::Generator(at::detail::createCPUGenerator(7))) * 2 - 1;
    const std::vector<uint64_t> salts = std::vector<uint64_t>(3, 0);  // 0: the cache entries' seed
};

TEST_F(VaeEncodeFnTest, RowsArePixelSeededScaledPosteriorSamples) {
    const auto encode = make_vae_encode_fn(vae.ptr(), c10::Device(c10::kCPU), at::kFloat);
    const at::Tensor got = encode(images, salts);  // [3, C, 8, 6]
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
    EXPECT_TRUE(
        at::allclose(encode(images.index_select(0, order), salts), got.index_select(0, order), 1e-5, 1e-6));
    // Another image gets other noise: rows of equal-mean inputs still differ.
    EXPECT_FALSE(at::allclose(got[0], got[1]));
}

TEST_F(VaeEncodeFnTest, ChannelsLastGivesTheSameLatentsInTheStandardLayout) {
    const at::Tensor plain = make_vae_encode_fn(vae.ptr(), c10::Device(c10::kCPU), at::kFloat)(images, salts);
    auto copy = models::load_autoencoder_kl(test::fixtures_dir() / "tiny-sdxl" / "vae");
    const at::Tensor nhwc = make_vae_encode_fn(copy.ptr(), c10::Device(c10::kCPU), at::kFloat,
                                               {.channels_last = true})(images, salts);
    EXPECT_TRUE(nhwc.is_contiguous());
    EXPECT_TRUE(at::allclose(nhwc, plain, 1e-4, 1e-5)) << (nhwc - plain).abs().max().item<double>();
}

// The NHWC GroupNorm equals at::group_norm computed in float64 (float32 input: to rounding;
// bf16 input: no worse than at::group_norm in bf16), and the tiny VAE encodes the same with it.
TEST_F(VaeEncodeFnTest, NhwcGroupNormMatchesGroupNorm) {
    at::Generator g = at::detail::createCPUGenerator(3);
    const at::Tensor x = (at::randn({2, 64, 6, 10}, g) * 3 + 1).contiguous(at::MemoryFormat::ChannelsLast);
    const at::Tensor w = at::randn({64}, g), b = at::randn({64}, g);
    const at::Tensor want = at::group_norm(x.to(at::kDouble), 32, w.to(at::kDouble), b.to(at::kDouble), 1e-6);
    const at::Tensor got = models::group_norm_nhwc(x, 32, w, b, 1e-6);
    EXPECT_TRUE(got.is_contiguous(at::MemoryFormat::ChannelsLast));
    EXPECT_LT((got.to(at::kDouble) - want).abs().max().item<double>(), 1e-5);
    const at::Tensor xb = x.to(at::kBFloat16);
    const at::Tensor ref = at::group_norm(xb.to(at::kDouble), 32, w.to(at::kDouble), b.to(at::kDouble), 1e-6);
    const double ours =
        (models::group_norm_nhwc(xb, 32, w, b, 1e-6).to(at::kDouble) - ref).abs().max().item<double>();
    const double native =
        (at::group_norm(xb, 32, w.to(at::kBFloat16), b.to(at::kBFloat16), 1e-6).to(at::kDouble) - ref)
            .abs()
            .max()
            .item<double>();
    EXPECT_LE(ours, native * 1.01) << "ours " << ours << " vs at::group_norm " << native;
    EXPECT_TRUE(models::group_norm_nhwc(x, 32, at::Tensor(), at::Tensor(), 1e-6)
                    .allclose(at::group_norm(x, 32, {}, {}, 1e-6), 1e-4, 1e-5));

    const at::Tensor plain = make_vae_encode_fn(vae.ptr(), c10::Device(c10::kCPU), at::kFloat)(images, salts);
    auto copy = models::load_autoencoder_kl(test::fixtures_dir() / "tiny-sdxl" / "vae");
    models::set_group_norm_nhwc(true);
    const at::Tensor nhwc = make_vae_encode_fn(copy.ptr(), c10::Device(c10::kCPU), at::kFloat,
                                               {.channels_last = true})(images, salts);
    models::set_group_norm_nhwc(false);
    EXPECT_TRUE(at::allclose(nhwc, plain, 1e-4, 1e-5)) << (nhwc - plain).abs().max().item<double>();
}

TEST(TextEncoderIdentity, FollowsTheEncoderFilesNotTheFolder) {
    // Issue #25: the text cache is keyed by the encoders; a copy of the same files elsewhere keeps
    // the identity, another tokenizer or encoder gets another.
    namespace stdfs = std::filesystem;
    test::TempDir dir;
    for (const char* model : {"a", "b"}) {
        stdfs::create_directories(dir / model);
        for (const char* part : {"text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "unet"})
            stdfs::copy(test::fixtures_dir() / "tiny-sdxl" / part, dir / model / part,
                        stdfs::copy_options::recursive);
    }
    const std::string a = text_encoder_identity(dir / "a");
    EXPECT_EQ(a, text_encoder_identity(dir / "b"));
    // The UNet is not part of it.
    stdfs::remove_all(dir / "b" / "unet");
    EXPECT_EQ(a, text_encoder_identity(dir / "b"));
    stdfs::path vocab;
    for (const auto& e : stdfs::directory_iterator(dir / "b" / "tokenizer_2"))
        if (e.is_regular_file()) vocab = e.path();
    ASSERT_FALSE(vocab.empty());
    std::ofstream(vocab, std::ios::app) << " ";
    EXPECT_NE(a, text_encoder_identity(dir / "b"));
}

}  // namespace
}  // namespace test_vae_encode_fn_local
}  // namespace dtune::family
