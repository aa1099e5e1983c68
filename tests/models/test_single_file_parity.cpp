// UNet and VAE loaded from a single-file SDXL checkpoint (ldm key layout) must equal the same
// weights loaded from the diffusers folder, and reproduce the fixtures' reference outputs.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "core/error.h"
#include "io/ldm_keys.h"
#include "io/safetensors.h"
#include "models/unet/unet_2d_condition.h"
#include "models/vae/autoencoder_kl.h"
#include "support/test_support.h"

namespace dtune::models {
namespace {

// The tiny fixture's UNet and VAE written as one ldm-layout file (our own diffusers -> ldm map).
std::filesystem::path write_single_file(const test::TempDir& dir, bool drop_one_unet_key = false) {
    const auto root = test::fixtures_dir() / "tiny-sdxl";
    io::TensorList single;
    for (const auto& [component, folder] :
         {std::pair{io::LdmComponent::kUNet, "unet"}, std::pair{io::LdmComponent::kVAE, "vae"}}) {
        const auto source = io::WeightSource::open(root / folder, "diffusion_pytorch_model");
        io::TensorList tensors;
        for (const auto& k : source.keys()) tensors.emplace_back(k, source.get(k));
        io::LdmLayout layout;
        layout.unet_layers_per_block = 2;  // tiny-sdxl/unet/config.json
        layout.vae_num_blocks = 4;         // tiny-sdxl/vae/config.json
        auto mapped = io::diffusers_to_ldm(tensors, component, layout);
        if (drop_one_unet_key && component == io::LdmComponent::kUNet) mapped.pop_back();
        for (auto& kv : mapped) single.push_back(std::move(kv));
    }
    const auto path = dir / "tiny_sdxl_single.safetensors";
    io::save_safetensors(path, single);
    return path;
}

}  // namespace

TEST(SingleFile, UNetMatchesFolderAndReference) {
    test::TempDir dir;
    const auto root = test::fixtures_dir() / "tiny-sdxl";
    ComponentLoadOptions options;
    options.single_file = write_single_file(dir);
    UNet2DConditionModel from_file = load_unet(root / "unet", options);
    UNet2DConditionModel from_folder = load_unet(root / "unet");
    const auto ref = io::SafetensorsFile(test::fixtures_dir() / "reference/unet_io.safetensors");
    at::NoGradGuard no_grad;
    UNetAddedCond added{ref.get("text_embeds"), ref.get("time_ids")};
    const at::Tensor a =
        from_file->forward(ref.get("sample"), ref.get("timestep"), ref.get("encoder_hidden_states"), added);
    const at::Tensor b =
        from_folder->forward(ref.get("sample"), ref.get("timestep"), ref.get("encoder_hidden_states"), added);
    EXPECT_TRUE(at::equal(a, b));
    EXPECT_LE((a - ref.get("out")).abs().max().item<double>(), 1e-4);
}

TEST(SingleFile, VAEMatchesFolder) {
    test::TempDir dir;
    const auto root = test::fixtures_dir() / "tiny-sdxl";
    ComponentLoadOptions options;
    options.single_file = write_single_file(dir);
    AutoencoderKL from_file = load_autoencoder_kl(root / "vae", options);
    AutoencoderKL from_folder = load_autoencoder_kl(root / "vae");
    const auto ref = io::SafetensorsFile(test::fixtures_dir() / "reference/vae_io.safetensors");
    at::NoGradGuard no_grad;
    EXPECT_TRUE(at::equal(from_file->decode(ref.get("latent")), from_folder->decode(ref.get("latent"))));
    EXPECT_LE((from_file->decode(ref.get("latent")) - ref.get("decoded")).abs().max().item<double>(), 1e-4);
}

TEST(SingleFile, MissingTensorIsListed) {
    test::TempDir dir;
    ComponentLoadOptions options;
    options.single_file = write_single_file(dir, /*drop_one_unet_key=*/true);
    try {
        load_unet(test::fixtures_dir() / "tiny-sdxl/unet", options);
        FAIL() << "a single file missing a UNet tensor loaded";
    } catch (const DataError& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("missing:"), std::string::npos) << msg;
        EXPECT_NE(msg.find("tiny_sdxl_single.safetensors"), std::string::npos) << msg;
    }
}

}  // namespace dtune::models
