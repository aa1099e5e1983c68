// validation_preview for Flux: the pipeline hands every sampler step's latents (unpacked, still
// shifted and scaled) to the preview, and a taef1-shaped AutoencoderTiny turns them into the PNG
// SimpleTuner's ImageTAEDecoder makes. tools/ref/gen_taef1_ref.py recorded both with diffusers'
// FluxPipeline callback on the tiny Flux pipeline (tiny_flux_pipeline.REQUEST) and a tiny random
// taef1 (tests/data/ref/tiny-taef1). The preview decoder is the family's: taef1 for Flux, taesdxl
// for SDXL.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>

#include "core/fs.h"
#include "family/flux/flux_family.h"
#include "family/sdxl/sdxl_family.h"
#include "io/safetensors.h"
#include "models/vae/autoencoder_tiny.h"
#include "report/validation.h"
#include "support/test_support.h"
#include "validate/flux_pipeline.h"

namespace dtune::report {
namespace test_flux_preview_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

namespace stdfs = std::filesystem;
const stdfs::path kRef = stdfs::path(DTUNE_TEST_DATA_DIR) / "ref";

TEST(FluxPreview, StepLatentsThroughTaef1GiveSimpleTunersPreviews) {
    test::TempDir dir;
    const auto folder = dir / "flux";
    stdfs::copy(kRef / "tiny-flux-pipeline", folder, stdfs::copy_options::recursive);
    stdfs::copy(kRef / "tiny-flux-vae", folder / "vae", stdfs::copy_options::recursive);
    for (const char* part : {"text_encoder", "tokenizer"})
        stdfs::copy(test::fixtures_dir() / "tiny-sdxl" / part, folder / part, stdfs::copy_options::recursive);
    validate::FluxPipeline pipe = validate::FluxPipeline::load(folder);
    validate::FluxRequest r;  // tools/ref/tiny_flux_pipeline.REQUEST
    r.prompt = {"a red cube on a wooden table"};
    r.height = 48;
    r.width = 32;
    r.steps = 3;
    r.guidance_scale = 3.5;
    r.max_sequence_length = 16;
    r.seed = 0;
    r.decode = false;
    std::vector<validate::StepLatents> steps;
    r.on_latents = [&](const validate::StepLatents& s) {
        steps.push_back({s.step, s.total_steps, s.timestep, s.latents.clone()});
    };
    pipe.generate(r);
    ASSERT_EQ(steps.size(), 3u);

    models::AutoencoderTiny taef1 = models::load_autoencoder_tiny(kRef / "tiny-taef1");
    const io::SafetensorsFile ref(kRef / "taef1_io.safetensors");
    for (int i = 0; i < 3; ++i) {
        const std::string name = "step" + std::to_string(i + 1);
        EXPECT_EQ(steps[i].step, i);
        EXPECT_EQ(steps[i].total_steps, 3);
        const at::Tensor want = ref.get(name + "_latents").to(at::kFloat);
        ASSERT_EQ(steps[i].latents.sizes(), want.sizes()) << name;
        EXPECT_EQ(steps[i].latents.scalar_type(), at::kFloat);
        EXPECT_LE((steps[i].latents - want).abs().max().item<double>(),
                  1e-4 * (1 + want.abs().max().item<double>()))
            << name;
        at::Tensor decoded;
        {
            torch::NoGradGuard g;
            decoded = taef1->decode(steps[i].latents);
        }
        const io::RgbImage img = preview_image(decoded);
        const at::Tensor png = ref.get(name + "_preview");  // [3, H, W] uint8
        ASSERT_EQ(img.width, png.size(2));
        ASSERT_EQ(img.height, png.size(1));
        const at::Tensor got =
            at::from_blob(const_cast<uint8_t*>(img.pixels.data()), {img.height, img.width, 3}, at::kByte)
                .permute({2, 0, 1})
                .to(at::kInt);
        // Truncation to uint8 may flip a value sitting on an integer by one step.
        EXPECT_LE((got - png.to(at::kInt)).abs().max().item<int>(), 1) << name;
    }
}

TEST(FluxPreview, PreviewDecoderIsTheFamilys) {
    test::TempDir home;
    const char* old_home = std::getenv("HOME");
    const std::string saved = old_home ? old_home : "";
    setenv("HOME", home.path().c_str(), 1);
    unsetenv("HF_HOME");
    unsetenv("HF_HUB_CACHE");
    std::string why;
    EXPECT_FALSE(find_preview_model("", family::flux_family(), why).has_value());
    EXPECT_NE(why.find("madebyollin/taef1"), std::string::npos) << why;
    EXPECT_FALSE(find_preview_model("", family::sdxl_family(), why).has_value());
    EXPECT_NE(why.find("madebyollin/taesdxl"), std::string::npos) << why;
    for (const char* repo : {"models--madebyollin--taef1", "models--madebyollin--taesdxl"}) {
        const auto snap = home / ".cache" / "huggingface" / "hub" / repo / "snapshots" / "abc";
        stdfs::create_directories(snap);
        fs::write_file_atomic(snap / "config.json", "{}");
    }
    EXPECT_EQ(find_preview_model("", family::flux_family(), why)->parent_path().parent_path().filename(),
              "models--madebyollin--taef1");
    EXPECT_EQ(find_preview_model("", family::sdxl_family(), why)->parent_path().parent_path().filename(),
              "models--madebyollin--taesdxl");
    // A configured folder wins over the family's.
    EXPECT_EQ(*find_preview_model((kRef / "tiny-taef1").string(), family::sdxl_family(), why),
              kRef / "tiny-taef1");
    setenv("HOME", saved.c_str(), 1);
}

}  // namespace
}  // namespace test_flux_preview_local
}  // namespace dtune::report
