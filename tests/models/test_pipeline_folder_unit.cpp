// PipelineFolder: model_index.json parsing, component paths, errors for missing folders and
// components, and pretrained_vae_model_name_or_path resolution.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>

#include "core/error.h"
#include "models/common/pipeline_folder.h"
#include "support/test_support.h"

namespace dtune::models {
namespace {

template <typename E>
std::string error_of(const std::function<void()>& f) {
    try {
        f();
    } catch (const E& e) {
        return e.what();
    }
    ADD_FAILURE() << "no exception of the expected type";
    return {};
}

}  // namespace

TEST(PipelineFolderUnit, ResolvesComponentsOfTheFixture) {
    const auto root = test::fixtures_dir() / "tiny-sdxl";
    const PipelineFolder p = PipelineFolder::open(root);
    EXPECT_EQ(p.class_name(), "StableDiffusionXLPipeline");
    for (const char* name :
         {"unet", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"})
        EXPECT_EQ(p.component(name).path, root / name) << name;
    EXPECT_EQ(p.component("text_encoder_2").class_name, "CLIPTextModelWithProjection");
    EXPECT_FALSE(p.has("image_encoder"));  // [null, null]
    EXPECT_TRUE(p.force_zeros_for_empty_prompt());
    EXPECT_EQ(p.vae_path(), root / "vae");
}

TEST(PipelineFolderUnit, MissingFolderAndComponentErrors) {
    test::TempDir dir;
    EXPECT_NE(error_of<DataError>([&] { PipelineFolder::open(dir / "absent"); }).find("absent"),
              std::string::npos);
    EXPECT_NE(error_of<DataError>([&] { PipelineFolder::open(dir.path()); }).find("model_index.json"),
              std::string::npos);
    test::write_bytes(
        dir / "model_index.json",
        R"({"_class_name": "StableDiffusionXLPipeline", "unet": ["diffusers", "UNet2DConditionModel"],)"
        R"( "vae": ["diffusers", "AutoencoderKL"], "image_encoder": [null, null],)"
        R"( "force_zeros_for_empty_prompt": false})");
    std::filesystem::create_directory(dir / "vae");
    const PipelineFolder p = PipelineFolder::open(dir.path());
    EXPECT_FALSE(p.force_zeros_for_empty_prompt());
    const std::string missing = error_of<DataError>([&] { p.component("unet"); });
    EXPECT_NE(missing.find((dir / "unet").string()), std::string::npos) << missing;
    const std::string unlisted = error_of<DataError>([&] { p.component("text_encoder_2"); });
    EXPECT_NE(unlisted.find("text_encoder_2"), std::string::npos) << unlisted;
    EXPECT_NO_THROW(p.component("vae"));
}

TEST(PipelineFolderUnit, VaeOverrideResolution) {
    test::TempDir dir;
    std::filesystem::create_directories(dir / "fixvae");
    test::write_bytes(dir / "fixvae" / "config.json", "{}");
    std::filesystem::create_directories(dir / "pipe" / "vae");
    test::write_bytes(dir / "pipe" / "vae" / "config.json", "{}");
    test::write_bytes(dir / "vae.safetensors", "x");
    EXPECT_EQ(resolve_vae_path(dir / "fixvae"), dir / "fixvae");
    EXPECT_EQ(resolve_vae_path(dir / "pipe"), dir / "pipe" / "vae");
    EXPECT_EQ(resolve_vae_path(dir / "vae.safetensors"), dir / "vae.safetensors");
    const std::string hub = error_of<DataError>([] { resolve_vae_path("madebyollin/sdxl-vae-fp16-fix"); });
    EXPECT_NE(hub.find("download"), std::string::npos) << hub;
    PipelineFolder p = PipelineFolder::open(test::fixtures_dir() / "tiny-sdxl");
    p.set_vae_override(dir / "fixvae");
    EXPECT_EQ(p.vae_path(), dir / "fixvae");
}

TEST(PipelineFolderUnit, ModelFolderWithoutVaeIsNotCalledAHubId) {
    // Issue #25: a relative "sdxl-base/vae" whose sdxl-base/ exists but has no vae/ was called a
    // Hugging Face hub id with a download suggestion.
    test::TempDir dir;
    std::filesystem::create_directories(dir / "sdxl-base" / "unet");
    const auto cwd = std::filesystem::current_path();
    std::filesystem::current_path(dir.path());
    const std::string m = error_of<DataError>([] { resolve_vae_path("sdxl-base/vae"); });
    std::filesystem::current_path(cwd);
    EXPECT_NE(m.find("the folder sdxl-base has no vae/ folder"), std::string::npos) << m;
    EXPECT_EQ(m.find("hub id"), std::string::npos) << m;
    EXPECT_EQ(m.find("huggingface-cli"), std::string::npos) << m;
}

}  // namespace dtune::models
