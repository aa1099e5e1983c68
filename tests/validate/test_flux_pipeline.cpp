// FluxPipeline against diffusers end to end: tools/ref/gen_flux_pipeline_ref.py ran diffusers'
// FluxPipeline on a tiny random Flux.1 [dev]-shaped pipeline (tests/data/ref/tiny-flux-pipeline plus
// the tiny Flux VAE and the shared tiny SDXL's CLIP text encoder and tokenizer, assembled here into
// one folder) and saved its final latents and image. dtune's pipeline must give the same latents and
// pixels; `dtune sample` on the folder must write that image.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "io/image.h"
#include "io/safetensors.h"
#include "support/shell.h"
#include "support/test_support.h"
#include "validate/flux_pipeline.h"

namespace dtune::validate {
namespace {

namespace stdfs = std::filesystem;
const stdfs::path kRef = stdfs::path(DTUNE_TEST_DATA_DIR) / "ref";

// The tiny Flux folder with its shared parts copied in.
void assemble(const stdfs::path& dir) {
    stdfs::copy(kRef / "tiny-flux-pipeline", dir, stdfs::copy_options::recursive);
    stdfs::copy(kRef / "tiny-flux-vae", dir / "vae", stdfs::copy_options::recursive);
    for (const char* part : {"text_encoder", "tokenizer"})
        stdfs::copy(test::fixtures_dir() / "tiny-sdxl" / part, dir / part, stdfs::copy_options::recursive);
}

FluxRequest reference_request() {
    FluxRequest r;
    r.prompt = {"a red cube on a wooden table"};
    r.height = 48;
    r.width = 32;
    r.steps = 3;
    r.guidance_scale = 3.5;
    r.max_sequence_length = 16;
    r.seed = 0;
    return r;
}

TEST(FluxPipeline, MatchesDiffusersLatentsAndImage) {
    test::TempDir dir;
    assemble(dir.path() / "flux");
    FluxPipeline pipe = FluxPipeline::load(dir.path() / "flux");
    const GenerationResult out = pipe.generate(reference_request());
    const io::SafetensorsFile io(kRef / "flux_pipeline_io.safetensors");
    const at::Tensor latents = io.get("latents").to(at::kFloat), image = io.get("image").to(at::kFloat);
    ASSERT_EQ(out.latents.sizes(), latents.sizes());
    EXPECT_LE((out.latents - latents).abs().max().item<double>(),
              1e-4 * (1 + latents.abs().max().item<double>()));
    ASSERT_EQ(out.images.sizes(), image.sizes());
    EXPECT_LE((out.images - image).abs().max().item<double>(), 1e-4);
}

TEST(FluxPipeline, FreedTextEncodersGiveTheSameImageOnce) {
    test::TempDir dir;
    assemble(dir.path() / "flux");
    FluxPipeline pipe = FluxPipeline::load(dir.path() / "flux");
    FluxRequest r = reference_request();
    r.free_text_encoders = true;
    const GenerationResult out = pipe.generate(r);
    const io::SafetensorsFile io(kRef / "flux_pipeline_io.safetensors");
    EXPECT_LE((out.images - io.get("image").to(at::kFloat)).abs().max().item<double>(), 1e-4);
    EXPECT_THROW(pipe.generate(r), UsageError);
}

// A PEFT LoRA saved by FluxPipeline.save_lora_weights ("transformer."-prefixed keys, alpha in the
// adapter metadata) gives diffusers' load_lora_weights image, in process and through --lora.
TEST(FluxPipeline, DiffusersLoRAGivesDiffusersImage) {
    test::TempDir dir;
    assemble(dir.path() / "flux");
    const stdfs::path lora = kRef / "tiny-flux-lora" / "pytorch_lora_weights.safetensors";
    FluxPipeline pipe = FluxPipeline::load(dir.path() / "flux");
    pipe.load_lora(lora);
    const GenerationResult out = pipe.generate(reference_request());
    const io::SafetensorsFile io(kRef / "flux_pipeline_io.safetensors");
    const at::Tensor want = io.get("image_lora").to(at::kFloat);
    EXPECT_GT((want - io.get("image").to(at::kFloat)).abs().max().item<double>(), 0.02);  // the LoRA matters
    EXPECT_LE((out.images - want).abs().max().item<double>(), 1e-4);
    EXPECT_THROW(pipe.load_lora(lora), UsageError);  // one LoRA per pipeline
}

TEST(FluxPipeline, RefusesBadRequestsNamingTheFix) {
    test::TempDir dir;
    assemble(dir.path() / "flux");
    FluxPipeline pipe = FluxPipeline::load(dir.path() / "flux");
    FluxRequest r = reference_request();
    r.width = 40;  // not a multiple of 16
    EXPECT_THROW(pipe.generate(r), UsageError);
    r = reference_request();
    r.prompt.clear();
    EXPECT_THROW(pipe.generate(r), UsageError);
}

TEST(FluxPipeline, DtuneSampleWritesTheReferenceImage) {
    test::TempDir dir;
    assemble(dir.path() / "flux");
    const std::string cmd = std::string(DTUNE_BIN) + " sample --model '" + (dir.path() / "flux").string() +
                            "' --prompt 'a red cube on a wooden table' --width 32 --height 48 --steps 3 "
                            "--guidance 3.5 --max_sequence_length 16 --seed 0 --device cpu --output_dir '" +
                            (dir.path() / "out").string() + "' >/dev/null 2>'" +
                            (dir.path() / "log").string() + "'";
    ASSERT_EQ(test::run_status(cmd), 0) << fs::read_file(dir.path() / "log");
    const io::RgbImage img = io::read_image(dir.path() / "out" / "sample_0_0.png");
    const io::SafetensorsFile io(kRef / "flux_pipeline_io.safetensors");
    const at::Tensor want = io.get("image").to(at::kFloat)[0];  // [3, 48, 32] in [0, 1]
    ASSERT_EQ(img.width, 32);
    ASSERT_EQ(img.height, 48);
    int worst = 0;
    for (int y = 0; y < img.height; ++y)
        for (int x = 0; x < img.width; ++x)
            for (int c = 0; c < 3; ++c) {
                const int got = img.pixels[static_cast<size_t>((y * img.width + x) * 3 + c)];
                const int ref = static_cast<int>(std::lround(want[c][y][x].item<float>() * 255.0f));
                worst = std::max(worst, std::abs(got - ref));
            }
    EXPECT_LE(worst, 1);
}

// A transformer single file in Black Forest Labs' layout with --config_folder (the rest of the
// pipeline, and the transformer's config) gives the folder's image; without --config_folder the
// error says what to pass.
TEST(FluxPipeline, DtuneSampleTakesABlackForestLabsSingleFile) {
    test::TempDir dir;
    assemble(dir.path() / "flux");
    const std::string file = (kRef / "tiny-flux-pipeline-transformer-bfl.safetensors").string();
    const std::string common =
        " --prompt 'a red cube on a wooden table' --width 32 --height 48 --steps 3 "
        "--guidance 3.5 --max_sequence_length 16 --seed 0 --device cpu --output_dir '" +
        (dir.path() / "out").string() + "' >/dev/null 2>>'" + (dir.path() / "log").string() + "'";
    ASSERT_EQ(test::run_status(std::string(DTUNE_BIN) + " sample --model '" + file + "' --config_folder '" +
                               (dir.path() / "flux").string() + "'" + common),
              0)
        << fs::read_file(dir.path() / "log");
    const io::RgbImage a = io::read_image(dir.path() / "out" / "sample_0_0.png");
    stdfs::remove_all(dir.path() / "out");
    ASSERT_EQ(test::run_status(std::string(DTUNE_BIN) + " sample --model '" + (dir.path() / "flux").string() +
                               "'" + common),
              0);
    const io::RgbImage b = io::read_image(dir.path() / "out" / "sample_0_0.png");
    EXPECT_EQ(a.pixels, b.pixels);
    // T5 from a single file (here the folder's own weights) gives the same image.
    stdfs::remove_all(dir.path() / "out");
    ASSERT_EQ(test::run_status(std::string(DTUNE_BIN) + " sample --model '" + file + "' --config_folder '" +
                               (dir.path() / "flux").string() + "' --text_encoder_2_file '" +
                               (dir.path() / "flux" / "text_encoder_2" / "model.safetensors").string() + "'" +
                               common),
              0)
        << fs::read_file(dir.path() / "log");
    EXPECT_EQ(io::read_image(dir.path() / "out" / "sample_0_0.png").pixels, b.pixels);
    EXPECT_EQ(test::run_status(std::string(DTUNE_BIN) + " sample --model '" + file + "'" + common), 2);
    EXPECT_NE(fs::read_file(dir.path() / "log").find("pass --config_folder with a diffusers Flux folder"),
              std::string::npos);
}

// `dtune inspect` names a Flux transformer single file (and what it holds) and a Flux LoRA.
TEST(FluxPipeline, DtuneInspectKnowsFluxFiles) {
    test::TempDir dir;
    const auto inspect = [&](const stdfs::path& file) {
        const auto out = dir.path() / "inspect.txt";
        EXPECT_EQ(test::run_status(std::string(DTUNE_BIN) + " inspect '" + file.string() + "' >'" +
                                   out.string() + "' 2>&1"),
                  0);
        return fs::read_file(out);
    };
    const std::string fp8 = inspect(kRef / "tiny-flux-dev-comfy-fp8.safetensors");
    EXPECT_NE(
        fp8.find("Flux.1 transformer single file (Black Forest Labs' layout): [dev] (guidance embedding), "
                 "2 double + 2 single blocks"),
        std::string::npos)
        << fp8;
    EXPECT_NE(fp8.find("F8_E4M3"), std::string::npos) << fp8;
    const std::string lora = inspect(kRef / "tiny-flux-lora" / "pytorch_lora_weights.safetensors");
    EXPECT_NE(lora.find("Flux/transformer LoRA adapter, rank 4"), std::string::npos) << lora;
}

// Without --steps and --guidance a [dev] folder samples with FluxPipeline's 28 steps at 3.5 (the
// sidecar records what ran); SDXL's defaults (30 steps, CFG 5) do not carry over.
TEST(FluxPipeline, DtuneSampleTakesFluxDefaults) {
    test::TempDir dir;
    assemble(dir.path() / "flux");
    const std::string cmd = std::string(DTUNE_BIN) + " sample --model '" + (dir.path() / "flux").string() +
                            "' --prompt 'a cube' --width 32 --height 32 --max_sequence_length 8 --device cpu "
                            "--output_dir '" +
                            (dir.path() / "out").string() + "' >/dev/null 2>'" +
                            (dir.path() / "log").string() + "'";
    ASSERT_EQ(test::run_status(cmd), 0) << fs::read_file(dir.path() / "log");
    const auto sidecar = nlohmann::json::parse(fs::read_file(dir.path() / "out" / "sample_0_0.json"));
    EXPECT_EQ(sidecar.at("steps"), 28);
    EXPECT_EQ(sidecar.at("guidance"), 3.5);
    EXPECT_FALSE(sidecar.contains("vae_tiling"));
    // --vae_tiling reaches the decoder (an image smaller than one tile decodes as one tile: the same).
    const io::RgbImage plain = io::read_image(dir.path() / "out" / "sample_0_0.png");
    ASSERT_EQ(test::run_status(cmd + " --vae_tiling"), 0) << fs::read_file(dir.path() / "log");
    EXPECT_EQ(io::read_image(dir.path() / "out" / "sample_0_0.png").pixels, plain.pixels);
    EXPECT_EQ(nlohmann::json::parse(fs::read_file(dir.path() / "out" / "sample_0_0.json")).at("vae_tiling"),
              true);
}

}  // namespace
}  // namespace dtune::validate
