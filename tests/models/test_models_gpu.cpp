// The tiny SDXL UNet and VAE on CUDA in bf16 (label gpu; skipped without a CUDA device):
// outputs stay close to the float32 CPU reference, gradient checkpointing and channels-last run,
// and SDPA picks a fused kernel for the UNet's attention shapes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "model_test_util.h"
#include "models/common/geglu.h"
#include "models/unet/unet_2d_condition.h"
#include "models/vae/autoencoder_kl.h"
#include "support/test_support.h"

namespace dtune::models {
namespace {

ComponentLoadOptions cuda_bf16() {
    ComponentLoadOptions o;
    o.dtype = at::kBFloat16;
    o.device = c10::Device(c10::kCUDA, 0);
    return o;
}

TEST(ModelsGpu, TinyUNetBf16MatchesFp32Reference) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    io::SafetensorsFile ref(test::fixtures_dir() / "reference" / "unet_io.safetensors");
    auto get = [&](const char* n) { return ref.get(n).to(c10::Device(c10::kCUDA, 0)); };
    for (bool channels_last : {false, true}) {
        ComponentLoadOptions o = cuda_bf16();
        o.channels_last = channels_last;
        UNet2DConditionModel unet = load_unet(test::fixtures_dir() / "tiny-sdxl" / "unet", o);
        unet->set_gradient_checkpointing(true);
        const at::Tensor out = unet->forward(get("sample"), get("timestep"), get("encoder_hidden_states"),
                                             {get("text_embeds"), get("time_ids")});
        const at::Tensor expected = ref.get("out");
        // bf16 keeps ~3 significant digits through ~40 layers: a few percent of the output range.
        EXPECT_LE(test::max_abs_diff(out.cpu(), expected), 0.05 * expected.abs().max().item<double>())
            << channels_last;
        out.to(at::kFloat).square().mean().backward();
        EXPECT_TRUE(unet->named_parameters()["conv_in.weight"].grad().defined());
    }
}

TEST(ModelsGpu, TinyVAEDecodesOnCuda) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    io::SafetensorsFile ref(test::fixtures_dir() / "reference" / "vae_io.safetensors");
    AutoencoderKL vae = load_autoencoder_kl(test::fixtures_dir() / "tiny-sdxl" / "vae", cuda_bf16());
    torch::NoGradGuard no_grad;
    const at::Tensor out = vae->decode(ref.get("latent").cuda()).cpu();
    const at::Tensor expected = ref.get("decoded");
    EXPECT_LE(test::max_abs_diff(out, expected), 0.05 * expected.abs().max().item<double>());
}

TEST(ModelsGpu, SdpaPicksAFusedKernel) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
    const at::Tensor q = at::randn({1, 10, 4096, 64}, opts);  // SDXL level 1 at 1024x1024
    const at::Tensor kv = at::randn({1, 10, 77, 64}, opts);
    const std::string self = sdpa_backend_name(q, q, q), cross = sdpa_backend_name(q, kv, kv);
    std::cout << "  SDPA self-attention: " << self << ", cross-attention: " << cross << std::endl;
    EXPECT_NE(self, "math");
    EXPECT_NE(cross, "math");
}

// The fused CUDA GEGLU (built where nvcc was found) against the composite path on the same GPU, in
// the dtypes training uses, at an SDXL width (vectorised kernels) and an odd one (scalar kernels).
TEST(ModelsGpu, FusedGegluMatchesComposite) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const at::Device cuda(at::kCUDA, 0);
    ASSERT_TRUE(fused_geglu_available(cuda)) << "built without the CUDA kernels (no nvcc at configure time)";
    torch::manual_seed(3);
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
        for (int64_t d : {int64_t{2560}, int64_t{13}}) {
            const at::Tensor proj = (at::randn({2, 33, 2 * d}) * 3).to(cuda, dtype);
            const at::Tensor up = at::randn({2, 33, d}).to(cuda, dtype);
            at::Tensor a = proj.clone().requires_grad_(true), b = proj.clone().requires_grad_(true);
            const at::Tensor ya = geglu(a), yb = geglu_composite(b);
            ya.backward(up);
            yb.backward(up);
            ASSERT_NE(ya.grad_fn(), nullptr);
            // One extra rounding in the composite: relative to the largest value, about one unit in
            // the last place of the dtype.
            const double rel = dtype == at::kFloat ? 1e-5 : (dtype == at::kHalf ? 2e-3 : 1e-2);
            auto close = [&](const at::Tensor& x, const at::Tensor& y) {
                return test::max_abs_diff(x.cpu(), y.cpu()) <= rel * y.abs().max().item<double>() + 1e-6;
            };
            EXPECT_TRUE(close(ya, yb)) << dtype << " d=" << d;
            EXPECT_TRUE(close(a.grad(), b.grad())) << dtype << " d=" << d;
            // Against float64 on the CPU: the fused path is within bf16/fp16 rounding of the exact value.
            const at::Tensor exact = geglu(proj.cpu().to(at::kDouble));
            EXPECT_LE(test::max_abs_diff(ya.cpu(), exact), rel * exact.abs().max().item<double>() + 1e-6)
                << dtype << " d=" << d;
        }
    }
}

}  // namespace
}  // namespace dtune::models
