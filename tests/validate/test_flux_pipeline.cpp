// FluxPipeline against diffusers end to end: tools/ref/gen_flux_pipeline_ref.py ran diffusers'
// FluxPipeline on a tiny random Flux.1 [dev]-shaped pipeline (tests/data/ref/tiny-flux-pipeline plus
// the tiny Flux VAE and the shared tiny SDXL's CLIP text encoder and tokenizer, assembled here into
// one folder) and saved its final latents and image. dtune's pipeline must give the same latents and
// pixels; `dtune sample` on the folder must write that image.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "io/image.h"
#include "io/ldm_keys.h"
#include "io/safetensors.h"
#include "models/clip/sdxl_text_encoders.h"
#include "support/shell.h"
#include "support/test_support.h"
#include "validate/flux_pipeline.h"

namespace dtune::validate {
namespace test_flux_pipeline_local {  // (named: unity builds merge files' anonymous namespaces)
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

// Largest difference, in 8-bit steps, between a written image and a reference [1, 3, H, W] in [0, 1].
int worst_pixel_diff(const io::RgbImage& img, const at::Tensor& reference) {
    const at::Tensor want = reference.to(at::kFloat)[0];  // [3, H, W]
    EXPECT_EQ(img.width, want.size(2));
    EXPECT_EQ(img.height, want.size(1));
    int worst = 0;
    for (int y = 0; y < img.height; ++y)
        for (int x = 0; x < img.width; ++x)
            for (int c = 0; c < 3; ++c) {
                const int got = img.pixels[static_cast<size_t>((y * img.width + x) * 3 + c)];
                const int ref = static_cast<int>(std::lround(want[c][y][x].item<float>() * 255.0f));
                worst = std::max(worst, std::abs(got - ref));
            }
    return worst;
}

// `dtune sample` on the reference request with `extra` options; output to <dir>/out, log to <dir>/log.
test::ShellRun sample(const stdfs::path& dir, const std::string& model, const std::string& extra) {
    stdfs::remove_all(dir / "out");
    return test::run_shell(std::string(DTUNE_BIN) + " sample --model '" + model +
                           "' --prompt 'a red cube on a wooden table' --width 32 --height 48 --steps 3 "
                           "--guidance 3.5 --max_sequence_length 16 --seed 0 --device cpu --output_dir '" +
                           (dir / "out").string() + "' " + extra + " 2>&1");
}

// Every tensor of `from` whose key passes `keep`, with `rename` applied, written to `to`.
stdfs::path rewrite(const stdfs::path& from, const stdfs::path& to,
                    const std::function<bool(const std::string&)>& keep,
                    const std::function<std::string(const std::string&)>& rename = {}) {
    io::TensorList out;
    for (const auto& [key, value] : io::load_safetensors(from))
        if (keep(key)) out.emplace_back(rename ? rename(key) : key, value);
    io::save_safetensors(to, out);
    return to;
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

// Kohya/ComfyUI and Black Forest Labs Flux LoRAs (tools/ref/gen_flux_lora_layouts_ref.py: a random
// LoRA on every linear layer, fused q/k/v and linear1 included): the pipeline gives diffusers'
// output with the LoRA merged into the fused BFL weights, as ComfyUI applies these files. The BFL
// file is also read without ComfyUI's "diffusion_model." prefix.
TEST(FluxPipeline, KohyaAndBlackForestLabsLoRAsGiveTheReferenceImage) {
    test::TempDir dir;
    assemble(dir.path() / "flux");
    const io::SafetensorsFile io(kRef / "flux_lora_io.safetensors");
    const at::Tensor plain = io::SafetensorsFile(kRef / "flux_pipeline_io.safetensors").get("image");
    const stdfs::path bare = rewrite(
        kRef / "tiny-flux-lora-bfl.safetensors", dir.path() / "bfl-bare.safetensors",
        [](const std::string&) { return true; },
        [](const std::string& k) { return k.substr(std::string("diffusion_model.").size()); });
    for (const auto& [layout, file] :
         {std::pair<std::string, stdfs::path>{"kohya", kRef / "tiny-flux-lora-kohya.safetensors"},
          {"bfl", kRef / "tiny-flux-lora-bfl.safetensors"},
          {"bfl", bare}}) {
        SCOPED_TRACE(file.string());
        FluxPipeline pipe = FluxPipeline::load(dir.path() / "flux");
        pipe.load_lora(file);
        const GenerationResult out = pipe.generate(reference_request());
        const at::Tensor latents = io.get(layout + "_latents"), image = io.get(layout + "_image");
        EXPECT_GT((image - plain).abs().max().item<double>(), 0.05);  // the LoRA matters
        EXPECT_LE((out.latents - latents).abs().max().item<double>(),
                  1e-4 * (1 + latents.abs().max().item<double>()));
        EXPECT_LE((out.images - image).abs().max().item<double>(), 1e-4);
    }
}

// diffusers' own loader (FluxPipeline.load_lora_weights) on the part of each file it applies at the
// tiny model's sizes: the double blocks and single_blocks.*.{linear2, modulation}. The BFL part went
// to diffusers under ComfyUI's lora_down / lora_up names (diffusers ignores lora_A / lora_B keys in
// a BFL-layout Flux.1 file); dtune reads it with the BFL names.
TEST(FluxPipeline, KohyaAndBlackForestLabsLoRAsGiveDiffusersLoadLoraWeightsImage) {
    test::TempDir dir;
    assemble(dir.path() / "flux");
    const io::SafetensorsFile io(kRef / "flux_lora_io.safetensors");
    const auto diffusers_applies = [](const std::string& key) {
        const bool single = key.find("single_blocks") != std::string::npos;
        return key.find("double_blocks") != std::string::npos ||
               (single && key.find("linear1") == std::string::npos);
    };
    for (const std::string layout : {"kohya", "bfl"}) {
        SCOPED_TRACE(layout);
        const stdfs::path part = rewrite(kRef / ("tiny-flux-lora-" + layout + ".safetensors"),
                                         dir.path() / (layout + "-part.safetensors"), diffusers_applies);
        FluxPipeline pipe = FluxPipeline::load(dir.path() / "flux");
        pipe.load_lora(part);
        const GenerationResult out = pipe.generate(reference_request());
        EXPECT_LE((out.images - io.get(layout + "_image_diffusers")).abs().max().item<double>(), 1e-4);
    }
}

// `dtune sample --lora` takes a kohya file; `dtune inspect` names each layout; a LoRA that is not a
// Flux one stops with the file, its key and what Flux keys look like.
TEST(FluxPipeline, DtuneSampleAndInspectKnowFluxLoRALayouts) {
    test::TempDir dir;
    assemble(dir.path() / "flux");
    const std::string flux = (dir.path() / "flux").string();
    const auto run =
        sample(dir.path(), flux, "--lora '" + (kRef / "tiny-flux-lora-kohya.safetensors").string() + "'");
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const at::Tensor want = io::SafetensorsFile(kRef / "flux_lora_io.safetensors").get("kohya_image");
    EXPECT_LE(worst_pixel_diff(io::read_image(dir.path() / "out" / "sample_0_0.png"), want), 1);
    for (const auto& [file, layout] :
         {std::pair<std::string, std::string>{"tiny-flux-lora-kohya.safetensors", "kohya/ComfyUI"},
          {"tiny-flux-lora-bfl.safetensors", "Black Forest Labs"},
          {"tiny-flux-lora/pytorch_lora_weights.safetensors", "diffusers/PEFT"}}) {
        const auto inspect =
            test::run_shell(std::string(DTUNE_BIN) + " inspect '" + (kRef / file).string() + "'");
        EXPECT_EQ(inspect.exit_code, 0) << inspect.output;
        EXPECT_TRUE(
            test::contains(inspect.output, "Flux/transformer LoRA adapter, rank 4 (" + layout + " layout)"))
            << inspect.output;
    }
    const stdfs::path sdxl = dir.path() / "sdxl_lora.safetensors";
    io::save_safetensors(
        sdxl, {{"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight", at::zeros({4, 8})},
               {"lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight", at::zeros({8, 4})}});
    const auto foreign = sample(dir.path(), flux, "--lora '" + sdxl.string() + "'");
    EXPECT_EQ(foreign.exit_code, 3) << foreign.output;  // a data error
    EXPECT_TRUE(test::contains(foreign.output, sdxl.string() + " is not a Flux LoRA")) << foreign.output;
    EXPECT_TRUE(
        test::contains(foreign.output, "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight"));
    EXPECT_TRUE(test::contains(foreign.output, "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"));
}

// True classifier-free guidance (tools/ref/gen_flux_true_cfg_ref.py): with a negative prompt and
// true_cfg_scale 4 the pipeline gives diffusers' latents and image; at scale 1 the negative prompt is
// not used (one pass): the plain image, bit for bit.
TEST(FluxPipeline, TrueCfgMatchesDiffusers) {
    test::TempDir dir;
    assemble(dir.path() / "flux");
    FluxPipeline pipe = FluxPipeline::load(dir.path() / "flux");
    FluxRequest r = reference_request();
    r.negative_prompt = std::vector<std::string>{"blurry, low quality"};
    r.true_cfg_scale = 4.0;
    const GenerationResult out = pipe.generate(r);
    const io::SafetensorsFile io(kRef / "flux_true_cfg_io.safetensors");
    const at::Tensor latents = io.get("latents"), image = io.get("image");
    const at::Tensor plain = io::SafetensorsFile(kRef / "flux_pipeline_io.safetensors").get("image");
    EXPECT_GT((image - plain).abs().max().item<double>(), 0.005);  // true CFG matters
    EXPECT_LE((out.latents - latents).abs().max().item<double>(),
              1e-4 * (1 + latents.abs().max().item<double>()));
    EXPECT_LE((out.images - image).abs().max().item<double>(), 1e-4);
    r.true_cfg_scale = 1.0;
    EXPECT_TRUE(at::equal(pipe.generate(r).images, pipe.generate(reference_request()).images));
    r.negative_prompt = std::vector<std::string>{"a", "b"};  // two negatives for one prompt
    r.true_cfg_scale = 4.0;
    EXPECT_THROW(pipe.generate(r), UsageError);
}

// --negative_prompt with --true_cfg_scale writes diffusers' image and records the scale; either
// option alone is refused with the fix, as are the Flux-only options on SDXL.
TEST(FluxPipeline, DtuneSampleTrueCfg) {
    test::TempDir dir;
    assemble(dir.path() / "flux");
    const std::string flux = (dir.path() / "flux").string();
    const auto run = sample(dir.path(), flux, "--negative_prompt 'blurry, low quality' --true_cfg_scale 4");
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const at::Tensor want = io::SafetensorsFile(kRef / "flux_true_cfg_io.safetensors").get("image");
    EXPECT_LE(worst_pixel_diff(io::read_image(dir.path() / "out" / "sample_0_0.png"), want), 1);
    const auto sidecar = nlohmann::json::parse(fs::read_file(dir.path() / "out" / "sample_0_0.json"));
    EXPECT_EQ(sidecar.at("true_cfg_scale"), 4.0);
    EXPECT_EQ(sidecar.at("negative_prompt"), "blurry, low quality");
    const auto negative_only = sample(dir.path(), flux, "--negative_prompt 'blurry'");
    EXPECT_EQ(negative_only.exit_code, 2);
    EXPECT_TRUE(test::contains(negative_only.output, "add --true_cfg_scale > 1")) << negative_only.output;
    const auto scale_only = sample(dir.path(), flux, "--true_cfg_scale 4");
    EXPECT_EQ(scale_only.exit_code, 2);
    EXPECT_TRUE(test::contains(scale_only.output, "needs --negative_prompt")) << scale_only.output;
    const auto sdxl = sample(dir.path(), (test::fixtures_dir() / "tiny-sdxl").string(), "--true_cfg_scale 4");
    EXPECT_EQ(sdxl.exit_code, 2);
    EXPECT_TRUE(test::contains(sdxl.output, "--true_cfg_scale is for Flux pipelines")) << sdxl.output;
}

// CLIP-L and the VAE from single files laid out as ComfyUI's clip_l.safetensors ("text_model." keys)
// and Black Forest Labs' ae.safetensors (ldm keys, no prefix), written from the folder's own weights:
// the same image as the folder; the sidecar records the files; `dtune inspect` names both.
TEST(FluxPipeline, DtuneSampleTakesClipAndVaeSingleFiles) {
    test::TempDir dir;
    assemble(dir.path() / "flux");
    const stdfs::path flux = dir.path() / "flux";
    const stdfs::path clip = rewrite(
        flux / "text_encoder" / "model.safetensors", dir.path() / "clip_l.safetensors",
        [](const std::string&) { return true; }, models::clip_text_key_to_module);
    io::TensorList vae;
    for (auto& kv : io::load_safetensors(flux / "vae" / "diffusion_pytorch_model.safetensors"))
        vae.push_back(kv);
    const std::string ldm = io::ldm_prefix(io::LdmComponent::kVAE);
    io::TensorList ae;
    for (auto& [key, value] : io::diffusers_to_ldm(vae, io::LdmComponent::kVAE))
        ae.emplace_back(key.substr(ldm.size()), value);
    io::save_safetensors(dir.path() / "ae.safetensors", ae);
    const stdfs::path ae_file = dir.path() / "ae.safetensors";

    ASSERT_EQ(sample(dir.path(), flux.string(), "").exit_code, 0);
    const io::RgbImage folder = io::read_image(dir.path() / "out" / "sample_0_0.png");
    const auto run =
        sample(dir.path(), flux.string(),
               "--text_encoder_file '" + clip.string() + "' --vae_file '" + ae_file.string() + "'");
    ASSERT_EQ(run.exit_code, 0) << run.output;
    EXPECT_EQ(io::read_image(dir.path() / "out" / "sample_0_0.png").pixels, folder.pixels);
    const auto sidecar = nlohmann::json::parse(fs::read_file(dir.path() / "out" / "sample_0_0.json"));
    EXPECT_EQ(sidecar.at("text_encoder_file"), clip.string());
    EXPECT_EQ(sidecar.at("vae_file"), ae_file.string());
    // A file that is not there is refused before the model loads.
    const auto missing =
        sample(dir.path(), flux.string(), "--vae_file '" + (dir.path() / "no.safetensors").string() + "'");
    EXPECT_EQ(missing.exit_code, 2);
    EXPECT_TRUE(test::contains(missing.output, "--vae_file")) << missing.output;

    const auto inspect = [&](const stdfs::path& file) {
        const auto r = test::run_shell(std::string(DTUNE_BIN) + " inspect '" + file.string() + "'");
        EXPECT_EQ(r.exit_code, 0) << r.output;
        return r.output;
    };
    EXPECT_TRUE(test::contains(inspect(clip),
                               "CLIP text encoder single file (transformers' keys under "
                               "'text_model.'): 5 layers, 32 wide"))
        << inspect(clip);
    EXPECT_TRUE(test::contains(inspect(ae_file),
                               "VAE single file (ldm layout, no prefix): 16 latent channels, "
                               "no quant convs (Flux.1's VAE"))
        << inspect(ae_file);
}

}  // namespace
}  // namespace test_flux_pipeline_local
}  // namespace dtune::validate
