// The single files people download for Flux's other components, written from the tiny fixtures with
// the keys laid out as the real files are:
//   CLIP-L: ComfyUI's clip_l.safetensors holds transformers' CLIPTextModel keys under "text_model."
//     (ComfyUI's saved CLIPs and all-in-one checkpoints put "transformer." / "clip_l.transformer." /
//     "text_encoders.clip_l.transformer." before that); extra text_projection / logit_scale /
//     position_ids tensors are not CLIPTextModel's;
//   VAE: Black Forest Labs' ae.safetensors is the original ldm layout without any prefix
//     (encoder.down.N.block.M, mid.attn_1.q as 1x1 convs, decoder.up.N, no quant convs, 16 latent
//     channels); ComfyUI's Flux checkpoints hold it under "vae.".
// Each must load bit-equal to the folder (same parameters, same outputs); files of the wrong kind are
// refused naming the file and the fix.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <set>

#include "core/error.h"
#include "io/ldm_keys.h"
#include "model_test_util.h"
#include "models/clip/sdxl_text_encoders.h"
#include "models/vae/autoencoder_kl.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_flux_single_files_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

namespace stdfs = std::filesystem;
const stdfs::path kRef = stdfs::path(DTUNE_TEST_DATA_DIR) / "ref";

void expect_same_parameters(torch::nn::Module& a, torch::nn::Module& b) {
    const auto pa = a.named_parameters(), pb = b.named_parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (const auto& p : pa) {
        const at::Tensor* other = pb.find(p.key());
        ASSERT_NE(other, nullptr) << p.key();
        EXPECT_TRUE(at::equal(p.value(), *other)) << p.key();
    }
}

// The shared tiny SDXL's CLIP text encoder (transformers 5 saves it without "text_model.").
stdfs::path clip_folder() {
    return test::fixtures_dir() / "tiny-sdxl" / "text_encoder";
}

io::TensorList clip_tensors(const std::string& prefix, c10::ScalarType dtype = at::kFloat) {
    io::TensorList out;
    for (const auto& [key, value] : io::load_safetensors(clip_folder() / "model.safetensors"))
        out.emplace_back(prefix + clip_text_key_to_module(key), value.to(dtype));
    return out;
}

at::Tensor pooled(CLIPTextModel& model) {
    torch::NoGradGuard no_grad;
    const at::Tensor ids = at::tensor({49406, 320, 1125, 539, 49407, 49407, 49407}, at::kLong).unsqueeze(0);
    return model->forward(ids, false).pooler_output;
}

TEST(FluxSingleFiles, ClipTextEncoderFileLoadsAsTheFolder) {
    test::TempDir dir;
    CLIPTextModel folder = load_clip_text_model(clip_folder());
    const at::Tensor want = pooled(folder);
    // ComfyUI's clip_l.safetensors (with the extra tensors such files carry), its saved CLIPs and a
    // Flux all-in-one checkpoint holding T5 and the transformer too, and the transformers 5 form.
    io::TensorList comfy = clip_tensors("");
    comfy.emplace_back("text_projection.weight", at::eye(32));
    comfy.emplace_back("logit_scale", at::scalar_tensor(4.6));
    comfy.emplace_back("text_model.embeddings.position_ids", at::arange(77, at::kLong).unsqueeze(0));
    io::TensorList all_in_one = clip_tensors("text_encoders.clip_l.transformer.");
    all_in_one.emplace_back("text_encoders.t5xxl.transformer.shared.weight", at::zeros({8, 4}));
    all_in_one.emplace_back("model.diffusion_model.img_in.weight", at::zeros({4, 4}));
    io::TensorList bare;
    for (const auto& [key, value] : io::load_safetensors(clip_folder() / "model.safetensors"))
        bare.emplace_back(key, value);
    const std::pair<const char*, io::TensorList> files[] = {
        {"clip_l", comfy},
        {"clip_l_transformer", clip_tensors("transformer.")},
        {"all_in_one", all_in_one},
        {"bare", bare}};
    for (const auto& [name, tensors] : files) {
        SCOPED_TRACE(name);
        const stdfs::path file = dir.path() / (std::string(name) + ".safetensors");
        io::save_safetensors(file, tensors);
        TextEncoderLoadOptions o;
        o.single_file = file;
        CLIPTextModel model = load_clip_text_model(clip_folder(), o);
        expect_same_parameters(*model, *folder);
        EXPECT_TRUE(at::equal(pooled(model), want));
    }
    // ComfyUI ships clip_l in fp16 too: converted to the load dtype, close to the float32 one.
    io::save_safetensors(dir.path() / "clip_l_fp16.safetensors", clip_tensors("", at::kHalf));
    TextEncoderLoadOptions half;
    half.single_file = dir.path() / "clip_l_fp16.safetensors";
    CLIPTextModel model = load_clip_text_model(clip_folder(), half);
    EXPECT_LE(test::max_abs_diff(pooled(model), want), 1e-2 * want.abs().max().item<double>());
}

TEST(FluxSingleFiles, ClipFileOfTheWrongKindIsRefused) {
    test::TempDir dir;
    const auto refused = [&](const io::TensorList& tensors, const std::string& needle) {
        const stdfs::path file = dir.path() / "te.safetensors";
        io::save_safetensors(file, tensors);
        TextEncoderLoadOptions o;
        o.single_file = file;
        try {
            load_clip_text_model(clip_folder(), o);
            ADD_FAILURE() << "accepted " << needle;
        } catch (const DataError& e) {
            EXPECT_NE(std::string(e.what()).find(file.string()), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
        }
    };
    // A T5 file (what --text_encoder_2_file takes), two CLIPs none of which is clip_l, a stray key.
    refused({{"encoder.block.0.layer.0.SelfAttention.q.weight", at::zeros({4, 4})}}, "clip_l.safetensors");
    io::TensorList two = clip_tensors("a.");
    for (auto& kv : clip_tensors("b.")) two.push_back(kv);
    refused(two, "several CLIP text encoders");
    io::TensorList stray = clip_tensors("");
    stray.emplace_back("text_model.unknown.weight", at::zeros({2}));
    refused(stray, "text_model.unknown.weight");
}

// The tiny Flux VAE written as Black Forest Labs' ae.safetensors: diffusers_to_ldm's names without
// the checkpoint prefix.
io::TensorList ae_tensors(const std::string& prefix) {
    io::TensorList diffusers;
    for (auto& kv : io::load_safetensors(kRef / "tiny-flux-vae" / "diffusion_pytorch_model.safetensors"))
        diffusers.push_back(kv);
    io::TensorList out;
    const std::string ldm = io::ldm_prefix(io::LdmComponent::kVAE);
    for (auto& [key, value] : io::diffusers_to_ldm(diffusers, io::LdmComponent::kVAE))
        out.emplace_back(prefix + key.substr(ldm.size()), value);
    return out;
}

at::Tensor decoded(AutoencoderKL& vae) {
    torch::NoGradGuard no_grad;
    at::Generator gen = at::detail::createCPUGenerator(3);
    return vae->decode(at::randn({1, 16, 4, 3}, gen));
}

TEST(FluxSingleFiles, BlackForestLabsAeFileLoadsAsTheFolder) {
    const io::TensorList ae = ae_tensors("");
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const auto& [key, value] : ae) shapes[key] = value.sizes().vec();
    // Names and shapes as in flux1's ae.safetensors.
    EXPECT_EQ(shapes.at("encoder.mid.attn_1.q.weight").size(), 4u);  // 1x1 conv
    EXPECT_EQ(shapes.at("encoder.conv_out.weight").at(0), 32);       // mean and logvar of 16 channels
    EXPECT_EQ(shapes.at("decoder.conv_in.weight").at(1), 16);
    EXPECT_TRUE(shapes.count("encoder.down.0.downsample.conv.weight"));
    EXPECT_FALSE(shapes.count("encoder.down.3.downsample.conv.weight"));
    EXPECT_TRUE(shapes.count("decoder.up.3.upsample.conv.weight"));
    EXPECT_FALSE(shapes.count("decoder.up.0.upsample.conv.weight"));
    EXPECT_TRUE(shapes.count("decoder.up.0.block.0.conv1.weight"));
    for (const auto& [key, shape] : shapes) EXPECT_EQ(key.find("quant_conv"), std::string::npos) << key;

    test::TempDir dir;
    AutoencoderKL folder = load_autoencoder_kl(kRef / "tiny-flux-vae");
    const at::Tensor want = decoded(folder);
    // ae.safetensors, the same under ComfyUI's checkpoint prefix, and a diffusers-layout file.
    io::save_safetensors(dir.path() / "ae.safetensors", ae);
    io::save_safetensors(dir.path() / "comfy.safetensors", ae_tensors("vae."));
    for (const stdfs::path& file : {dir.path() / "ae.safetensors", dir.path() / "comfy.safetensors",
                                    kRef / "tiny-flux-vae" / "diffusion_pytorch_model.safetensors"}) {
        SCOPED_TRACE(file.string());
        ComponentLoadOptions o;
        o.single_file = file;
        AutoencoderKL vae = load_autoencoder_kl(kRef / "tiny-flux-vae", o);
        expect_same_parameters(*vae, *folder);
        EXPECT_TRUE(at::equal(decoded(vae), want));
    }
}

// An SD/SDXL VAE (4 latent channels) with Flux's config: the error says which VAE to pass.
TEST(FluxSingleFiles, VaeFileWithOtherLatentChannelsIsRefused) {
    test::TempDir dir;
    io::TensorList sdxl;
    for (auto& kv : io::load_safetensors(test::fixtures_dir() / "tiny-sdxl" / "vae" /
                                         "diffusion_pytorch_model.safetensors"))
        sdxl.push_back(kv);
    const std::string ldm = io::ldm_prefix(io::LdmComponent::kVAE);
    io::TensorList bare;
    for (auto& [key, value] : io::diffusers_to_ldm(sdxl, io::LdmComponent::kVAE))
        bare.emplace_back(key.substr(ldm.size()), value);
    io::save_safetensors(dir.path() / "sdxl_vae.safetensors", bare);
    ComponentLoadOptions o;
    o.single_file = dir.path() / "sdxl_vae.safetensors";
    try {
        load_autoencoder_kl(kRef / "tiny-flux-vae", o);
        FAIL() << "a 4-channel VAE loaded with Flux's 16-channel config";
    } catch (const DataError& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("sdxl_vae.safetensors"), std::string::npos) << msg;
        EXPECT_NE(msg.find("decodes 4 latent channels"), std::string::npos) << msg;
    }
    EXPECT_EQ(io::ldm_vae_prefix({"first_stage_model.decoder.mid.block_1.conv1.weight"}),
              "first_stage_model.");
    EXPECT_EQ(io::ldm_vae_prefix({"decoder.mid_block.resnets.0.conv1.weight"}), std::nullopt);  // diffusers'
}

}  // namespace
}  // namespace test_flux_single_files_unit_local
}  // namespace dtune::models
