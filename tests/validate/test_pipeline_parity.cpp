// SDXLPipeline against diffusers' StableDiffusionXLPipeline (fixtures/reference/pipeline_io.*,
// made by fixtures/gen/gen_fixtures.py with the tiny SDXL model): prompt "a photo of a cat",
// negative "blurry", 4 Euler steps, guidance 5.0, 64x64, fixed N(0, 1) init_latents. From the
// folder, from a single file with the folder's configs, and with dtune's built-in tokenizers and
// scheduler.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/ldm_keys.h"
#include "io/safetensors.h"
#include "support/test_support.h"
#include "tiny_single_file.h"
#include "validate/sdxl_pipeline.h"

namespace dtune {
namespace test_pipeline_parity_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
    return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

void check_against_reference(validate::SDXLPipeline& pipe) {
    const auto ref_dir = test::fixtures_dir() / "reference";
    io::SafetensorsFile ref{ref_dir / "pipeline_io.safetensors"};
    const auto settings = nlohmann::json::parse(std::ifstream(ref_dir / "pipeline_io.json"));
    validate::GenerationRequest r;
    r.prompt = {settings.at("prompt").get<std::string>()};
    r.negative_prompt = std::vector<std::string>{settings.at("negative_prompt").get<std::string>()};
    r.steps = settings.at("num_inference_steps").get<int64_t>();
    r.guidance_scale = settings.at("guidance_scale").get<double>();
    r.height = settings.at("height").get<int64_t>();
    r.width = settings.at("width").get<int64_t>();
    r.latents = ref.get("init_latents").clone();
    int64_t calls = 0;
    const auto out = pipe.generate(r, [&](int64_t done, int64_t total) {
        EXPECT_EQ(done, ++calls);
        EXPECT_EQ(total, r.steps);
    });
    EXPECT_EQ(calls, r.steps);

    const at::Tensor want_latents = ref.get("final_latents");
    const at::Tensor want_image = ref.get("image");
    ASSERT_EQ(out.latents.sizes(), want_latents.sizes());
    ASSERT_EQ(out.images.sizes(), want_image.sizes());
    const double d_lat = max_abs_diff(out.latents, want_latents);
    const double d_img = max_abs_diff(out.images, want_image);
    std::cout << "  max abs error latents " << d_lat << ", image " << d_img << std::endl;
    EXPECT_LE(d_lat, 1e-4);
    EXPECT_LE(d_img, 1e-4);
}

TEST(SDXLPipelineParity, MatchesDiffusersLatentsAndImage) {
    auto pipe = validate::SDXLPipeline::load(test::fixtures_dir() / "tiny-sdxl");
    check_against_reference(pipe);
}

TEST(SDXLPipelineParity, SingleFileCheckpointMatchesToo) {
    // The tiny pipeline written as an SDXL single file, loaded back with the folder only for
    // configs, tokenizers and scheduler.
    const auto tiny = test::fixtures_dir() / "tiny-sdxl";
    test::TempDir dir;
    const auto file = test::write_tiny_single_file(tiny, dir / "tiny_sdxl.safetensors");
    auto pipe = validate::SDXLPipeline::load_single_file(file, tiny);
    check_against_reference(pipe);
}

TEST(SDXLPipelineParity, BuiltinTokenizersAndSchedulerMatchToo) {
    // The single file with dtune's built-in tokenizers and scheduler config (SDXL base's; the
    // tiny fixture uses the same ones) and only the tiny model's four component configs: the
    // compiled-in parts must give diffusers' result end to end.
    const auto tiny = test::fixtures_dir() / "tiny-sdxl";
    test::TempDir dir;
    const auto file = test::write_tiny_single_file(tiny, dir / "tiny_sdxl.safetensors");
    auto configs = models::SDXLConfigs::builtin();
    const auto folder = models::SDXLConfigs::from_folder(models::PipelineFolder::open(tiny));
    configs.unet = folder.unet;
    configs.vae = folder.vae;
    configs.text_encoder = folder.text_encoder;
    configs.text_encoder_2 = folder.text_encoder_2;
    auto pipe = validate::SDXLPipeline::load_single_file(file, std::move(configs));
    check_against_reference(pipe);
}

TEST(SDXLPipelineParity, SingleFileOfAnotherArchitectureNeedsItsConfigFolder) {
    test::TempDir dir;
    const auto file =
        test::write_tiny_single_file(test::fixtures_dir() / "tiny-sdxl", dir / "tiny.safetensors");
    try {
        validate::SDXLPipeline::load_single_file(file);  // built-in SDXL base configs
        FAIL() << "the tiny model does not have SDXL base's architecture";
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("--config_folder"), std::string::npos) << e.what();
    }
}

}  // namespace
}  // namespace test_pipeline_parity_local
}  // namespace dtune
