// Loading straight into the requested dtype: every parameter of the tiny fixture UNet, VAE and text
// encoders loaded in bf16 equals the file's tensor converted to bf16 (so nothing was left
// uninitialised and nothing went through another dtype), and the strict listing error survives the
// uninitialised construction.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/error.h"
#include "io/safetensors.h"
#include "models/clip/sdxl_text_encoders.h"
#include "models/common/weights.h"
#include "models/unet/unet_2d_condition.h"
#include "models/vae/autoencoder_kl.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_load_parity_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

std::filesystem::path tiny() {
    return test::fixtures_dir() / "tiny-sdxl";
}

// Every parameter and buffer equals the checkpoint tensor of the same name, converted to `dtype`.
void expect_equals_file(const torch::nn::Module& module, const io::WeightSource& file, at::ScalarType dtype,
                        const std::function<std::string(const std::string&)>& to_file_key = {}) {
    std::size_t compared = 0;
    for (const auto& [name, t] : state_dict(module)) {
        const std::string key = to_file_key ? to_file_key(name) : name;
        if (!file.contains(key)) continue;  // e.g. non-persistent buffers
        EXPECT_EQ(t.scalar_type(), dtype) << name;
        EXPECT_TRUE(at::equal(t, file.get(key).to(dtype))) << name;
        ++compared;
    }
    EXPECT_EQ(compared, file.keys().size());
}

TEST(LoadParity, UNetAndVAELoadStraightIntoBf16) {
    ComponentLoadOptions options;
    options.dtype = at::kBFloat16;
    const auto unet = load_unet(tiny() / "unet", options);
    expect_equals_file(*unet, io::WeightSource::open(tiny() / "unet", "diffusion_pytorch_model"),
                       at::kBFloat16);
    const auto vae = load_autoencoder_kl(tiny() / "vae", options);
    expect_equals_file(*vae, io::WeightSource::open(tiny() / "vae", "diffusion_pytorch_model"),
                       at::kBFloat16);
}

TEST(LoadParity, TextEncodersLoadStraightIntoBf16) {
    const TextEncoderLoadOptions options{at::kBFloat16, std::nullopt};
    const auto te2 = load_clip_text_model_with_projection(tiny() / "text_encoder_2", options);
    expect_equals_file(*te2, io::WeightSource::open(tiny() / "text_encoder_2" / "model.safetensors"),
                       at::kBFloat16);
    // transformers 5 saves CLIPTextModel without the "text_model." prefix the module carries.
    const auto te1 = load_clip_text_model(tiny() / "text_encoder", options);
    const auto file = io::WeightSource::open(tiny() / "text_encoder" / "model.safetensors");
    expect_equals_file(*te1, file, at::kBFloat16, [&](const std::string& name) {
        return file.contains(name) ? name : name.substr(std::string("text_model.").size());
    });
}

TEST(LoadParity, MissingTensorIsStillListed) {
    test::TempDir dir;
    const auto src = io::WeightSource::open(tiny() / "unet", "diffusion_pytorch_model");
    io::TensorList tensors;
    for (const auto& k : src.keys())
        if (k != "conv_in.weight") tensors.emplace_back(k, src.get(k));
    io::save_safetensors(dir / "diffusion_pytorch_model.safetensors", tensors);
    std::filesystem::copy_file(tiny() / "unet" / "config.json", dir / "config.json");
    ComponentLoadOptions options;
    options.dtype = at::kBFloat16;
    try {
        load_unet(dir.path(), options);
        FAIL() << "a missing tensor must be an error";
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("missing:\n    conv_in.weight"), std::string::npos) << e.what();
    }
}

}  // namespace
}  // namespace test_load_parity_local
}  // namespace dtune::models
