// `dtune train` on a second model family, end to end on the CPU: the tiny Flux.1 [dev] pipeline
// (tests/data/ref/tiny-flux-pipeline + the tiny Flux VAE + the shared tiny CLIP), chosen by
// model_family flux or by the folder's model_index.json alone. The family layer carries
// everything: 16-channel latents, T5 + CLIP text-cache entries (attention mask included), the
// flow-matching step, LoRA on the transformer with diffusers' "transformer." keys, a full
// fine-tune's transformer/ export (with gradient checkpointing), validation images through
// FluxPipeline, and exact resume.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <set>

#include "core/fs.h"
#include "io/image.h"
#include "io/safetensors.h"
#include "support/shell.h"
#include "support/test_support.h"

namespace dtune {
namespace {

namespace stdfs = std::filesystem;
using test::run_status;

const stdfs::path kRef = stdfs::path(DTUNE_TEST_DATA_DIR) / "ref";

struct FluxWorkspace {
    test::TempDir dir;
    stdfs::path model = dir / "tiny-flux";
    stdfs::path config = dir / "config.json";

    explicit FluxWorkspace(bool name_the_family = true) {
        stdfs::copy(kRef / "tiny-flux-pipeline", model, stdfs::copy_options::recursive);
        stdfs::copy(kRef / "tiny-flux-vae", model / "vae", stdfs::copy_options::recursive);
        for (const char* part : {"text_encoder", "tokenizer"})
            stdfs::copy(test::fixtures_dir() / "tiny-sdxl" / part, model / part,
                        stdfs::copy_options::recursive);
        const auto images = dir / "images";
        stdfs::create_directories(images);
        for (int i = 0; i < 4; ++i) {
            io::RgbImage img(64, 64);
            for (size_t p = 0; p < img.pixels.size(); ++p)
                img.pixels[p] = static_cast<uint8_t>((p * 11 + i * 29) % 256);
            io::write_image(images / ("a flux photo " + std::to_string(i) + ".png"), img);
        }
        const nlohmann::json backends =
            nlohmann::json::array({{{"id", "tiny"},
                                    {"type", "local"},
                                    {"instance_data_dir", images.string()},
                                    {"resolution", 64},
                                    {"resolution_type", "pixel"},
                                    {"caption_strategy", "filename"},
                                    {"cache_dir_vae", (dir / "cache_vae").string()}},
                                   {{"id", "text"},
                                    {"type", "local"},
                                    {"dataset_type", "text_embeds"},
                                    {"default", true},
                                    {"cache_dir", (dir / "cache_text").string()}}});
        fs::write_file_atomic(dir / "multidatabackend.json", backends.dump(2));
        nlohmann::json cfg = {{"pretrained_model_name_or_path", model.string()},
                              {"data_backend_config", (dir / "multidatabackend.json").string()},
                              {"train_batch_size", 2},
                              {"checkpointing_steps", 1},
                              {"learning_rate", 1e-3},
                              {"optimizer", "torch-adamw"},
                              {"mixed_precision", "no"},
                              {"gradient_checkpointing", false},
                              {"seed", 11},
                              {"deterministic", true},
                              {"device", "cpu"}};
        if (name_the_family) cfg["model_family"] = "flux";
        fs::write_file_atomic(config, cfg.dump(2));
    }

    std::string command(const std::string& out, const std::string& extra) const {
        return "'" + std::string(DTUNE_BIN) + "' train --config '" + config.string() + "' --output_dir '" +
               (dir / out).string() + "' " + extra + " 2>>'" + (dir / "log.txt").string() + "'";
    }
    std::string log() const { return fs::read_file(dir / "log.txt"); }
};

std::map<std::string, at::Tensor> tensors_of(const stdfs::path& file) {
    std::map<std::string, at::Tensor> out;
    for (auto& [name, t] : io::load_safetensors(file)) out[name] = t;
    return out;
}

TEST(FluxTrainCli, LoRATrainsTheTransformerAndResumesExactly) {
    FluxWorkspace w;
    const std::string lora = "--model_type lora --lora_rank 4 ";
    ASSERT_EQ(run_status(w.command("straight", lora + "--max_train_steps 2")), 0) << w.log();
    ASSERT_EQ(run_status(w.command("split", lora + "--max_train_steps 1")), 0) << w.log();
    ASSERT_EQ(run_status(w.command("split", lora + "--max_train_steps 2")), 0) << w.log();
    const std::string log = w.log();
    EXPECT_NE(log.find("loaded the Flux transformer of"), std::string::npos) << log;
    EXPECT_NE(log.find("resumed from"), std::string::npos) << log;

    const auto straight = tensors_of(w.dir / "straight" / "pytorch_lora_weights.safetensors");
    const auto split = tensors_of(w.dir / "split" / "pytorch_lora_weights.safetensors");
    ASSERT_FALSE(straight.empty());
    ASSERT_EQ(straight.size(), split.size());
    std::set<std::string> modules;
    bool trained = false;
    for (const auto& [name, t] : straight) {
        EXPECT_EQ(name.rfind("transformer.", 0), 0u) << name;  // diffusers' FluxPipeline prefix
        EXPECT_TRUE(at::equal(t, split.at(name))) << name << ": resume is not exact";
        if (name.find(".lora_B.weight") != std::string::npos && t.abs().max().item<double>() > 0)
            trained = true;
        modules.insert(name.substr(0, name.find(".lora_")));
    }
    EXPECT_TRUE(trained) << "the up factors start at zero and must have moved";
    // SimpleTuner's flux_lora_target "all": both streams' attention projections.
    EXPECT_TRUE(modules.count("transformer.transformer_blocks.0.attn.add_k_proj")) << *modules.begin();
    EXPECT_TRUE(modules.count("transformer.single_transformer_blocks.0.attn.to_q"));

    // The caches hold Flux's shapes: one text entry per caption plus the empty caption, each with the
    // T5 mask; latents with 16 channels.
    int64_t text_entries = 0, latent_entries = 0;
    for (const auto& e : stdfs::recursive_directory_iterator(w.dir / "cache_text"))
        if (e.path().extension() == ".safetensors") ++text_entries;
    for (const auto& e : stdfs::recursive_directory_iterator(w.dir / "cache_vae"))
        if (e.path().extension() == ".safetensors") ++latent_entries;
    EXPECT_EQ(text_entries, 5);
    EXPECT_EQ(latent_entries, 4);
}

TEST(FluxTrainCli, FamilyFromModelIndexFullFineTuneExportsAndValidates) {
    FluxWorkspace w(/*name_the_family=*/false);
    const std::string args =
        "--model_type full --max_train_steps 1 --gradient_checkpointing true --validation_prompt 'a red "
        "cube' "
        "--validation_num_inference_steps 2 --validation_resolution 64x64 --validation_step_interval 1";
    ASSERT_EQ(run_status(w.command("full", args)), 0) << w.log();
    const auto out = w.dir / "full";
    const auto resolved = nlohmann::json::parse(fs::read_file(out / "config.resolved.json"));
    EXPECT_EQ(resolved.at("model_family"), "flux");
    const auto trained = tensors_of(out / "pipeline" / "transformer" / "diffusion_pytorch_model.safetensors");
    const auto base = tensors_of(w.model / "transformer" / "diffusion_pytorch_model.safetensors");
    ASSERT_EQ(trained.size(), base.size());
    bool moved = false;
    for (const auto& [name, t] : trained) moved = moved || !at::equal(t, base.at(name).to(t.scalar_type()));
    EXPECT_TRUE(moved) << "a full fine-tune must change the transformer";
    for (const char* part :
         {"model_index.json", "vae/config.json", "text_encoder_2/config.json", "tokenizer_2"})
        EXPECT_TRUE(stdfs::exists(out / "pipeline" / part)) << part;
    EXPECT_TRUE(stdfs::exists(out / "checkpoint-1" / "transformer" / "diffusion_pytorch_model.safetensors"));
    int64_t images = 0;
    for (const auto& e : stdfs::directory_iterator(out / "validation_images"))
        if (e.path().extension() == ".png") ++images;
    EXPECT_GE(images, 1) << w.log();
}

TEST(FluxTrainCli, FamilyDisagreeingWithTheFolderIsRefused) {
    FluxWorkspace w;
    const int status = run_status(w.command("sdxl", "--model_family sdxl --max_train_steps 1"));
    EXPECT_EQ(status, 2) << w.log();
    EXPECT_NE(w.log().find("is a flux pipeline"), std::string::npos) << w.log();
}

// kohya keys are written for SDXL's UNet only: a Flux LoRA asked for in lora_format comfyui stops
// with the fix instead of writing a file nothing loads.
TEST(FluxTrainCli, ComfyUILoRAFormatIsRefusedWithTheFix) {
    FluxWorkspace w;
    const int status =
        run_status(w.command("comfy", "--model_type lora --lora_format comfyui --max_train_steps 1"));
    EXPECT_EQ(status, 2) << w.log();
    EXPECT_NE(w.log().find("set lora_format diffusers"), std::string::npos) << w.log();
    EXPECT_FALSE(stdfs::exists(w.dir / "comfy" / "pytorch_lora_weights.safetensors"));
}

}  // namespace
}  // namespace dtune
