// `dtune train` on a second model family, end to end on the CPU: the tiny Flux.1 [dev] pipeline
// (tests/data/ref/tiny-flux-pipeline + the tiny Flux VAE + the shared tiny CLIP), chosen by
// model_family flux or by the folder's model_index.json alone. The family layer carries
// everything: 16-channel latents, T5 + CLIP text-cache entries (attention mask included), the
// flow-matching step, LoRA on the transformer with diffusers' "transformer." keys, a full
// fine-tune's transformer/ export (with gradient checkpointing), validation images through
// FluxPipeline, and exact resume.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <set>
#include <sstream>

#include "core/fs.h"
#include "io/image.h"
#include "io/safetensors.h"
#include "support/http_listener.h"
#include "support/shell.h"
#include "support/test_support.h"
#include "support/tiny_flux_data.h"

namespace dtune {
namespace test_flux_train_cli_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

namespace stdfs = std::filesystem;
using test::run_status;

const stdfs::path kRef = stdfs::path(DTUNE_TEST_DATA_DIR) / "ref";

struct FluxWorkspace {
    test::TempDir dir;
    stdfs::path model = dir / "tiny-flux";
    stdfs::path config = dir / "config.json";

    explicit FluxWorkspace(bool name_the_family = true) {
        const test::TinyFluxData data = test::write_tiny_flux_data(dir.path(), kRef);
        nlohmann::json cfg = {{"pretrained_model_name_or_path", data.model.string()},
                              {"data_backend_config", data.backends.string()},
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
    // The text encoders load for the run that builds the text cache, and never for the two runs
    // that find it complete.
    size_t text_loads = 0;
    for (size_t at = log.find("loading the Flux text encoders"); at != std::string::npos;
         at = log.find("loading the Flux text encoders", at + 1))
        ++text_loads;
    EXPECT_EQ(text_loads, 1u) << log;

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

// Flux's kernel switches are read when the transformer loads: a bad value ends the run with exit 2
// naming the variable and its choices (on a CPU run too, where the kernels never apply).
TEST(FluxTrainCli, BadKernelSwitchesAreUsageErrorsAtLoad) {
    FluxWorkspace w;
    const std::string lora = "--model_type lora --lora_rank 4 --max_train_steps 1";
    const std::pair<const char*, const char*> cases[] = {
        {"DTUNE_FUSED_QK_NORM_ROPE", "q/k norm, concatenation and rotary embedding as one kernel"},
        {"DTUNE_FUSED_CONCAT_GELU", "attention output and MLP GELU concatenated by one kernel"},
        {"DTUNE_FUSED_GATED_RESIDUAL", "x + gate · y by dtune's vectorised kernels"},
        {"DTUNE_FUSED_GELU_GEMM", "the MLP GELU in the GEMM epilogues (cuBLASLt)"},
        {"DTUNE_FUSED_LINEAR_EPILOGUE",
         "a Linear's bias and the sum with the LoRA terms in cuBLASLt's epilogue"}};
    int run = 0;
    for (const auto& [name, meaning] : cases) {
        // One variable per process: each switch is read once, and the first bad one ends the load.
        const std::string out = "bad" + std::to_string(run++);
        EXPECT_EQ(run_status(std::string(name) + "=maybe " + w.command(out, lora)), 2) << name << w.log();
        EXPECT_NE(w.log().find(std::string(name) + "=maybe is not a choice: use 1 (" + meaning),
                  std::string::npos)
            << w.log();
        EXPECT_FALSE(stdfs::exists(w.dir / out / "pytorch_lora_weights.safetensors")) << name;
    }
}

// `dtune sample` of the run's model with `lora`; the image's pixels.
std::vector<uint8_t> sample_with(const FluxWorkspace& w, const stdfs::path& lora, const std::string& out) {
    const std::string cmd =
        std::string(DTUNE_BIN) + " sample --model '" + w.model.string() +
        "' --prompt 'a flux photo' --width 32 --height 32 --steps 2 --seed 3 --device cpu " +
        (lora.empty() ? std::string() : "--lora '" + lora.string() + "' ") + "--output_dir '" +
        (w.dir / out).string() + "' >/dev/null 2>>'" + (w.dir / "log.txt").string() + "'";
    EXPECT_EQ(run_status(cmd), 0) << w.log();
    return io::read_image(w.dir / out / "sample_3_0.png").pixels;  // sample_<seed>_<i>
}

// export_single_file on a Flux full fine-tune writes the transformer in Black Forest Labs' layout
// (flux1-dev.safetensors' keys): `dtune sample` of that file with the exported folder's config gives
// the folder's own image, bit for bit; the fused layers hold q, k, v stacked; a LoRA run refuses it.
TEST(FluxTrainCli, ExportSingleFileWritesTheBlackForestLabsLayout) {
    FluxWorkspace w;
    ASSERT_EQ(
        run_status(w.command("full", "--model_type full --max_train_steps 1 --export_single_file true")), 0)
        << w.log();
    const auto out = w.dir / "full";
    const auto file = out / "flux_transformer.safetensors";
    ASSERT_TRUE(stdfs::exists(file)) << w.log();
    const auto bfl = tensors_of(file);
    const auto diffusers =
        tensors_of(out / "pipeline" / "transformer" / "diffusion_pytorch_model.safetensors");
    ASSERT_TRUE(bfl.count("double_blocks.0.img_attn.qkv.weight"));
    EXPECT_TRUE(at::equal(bfl.at("double_blocks.0.img_attn.qkv.weight"),
                          at::cat({diffusers.at("transformer_blocks.0.attn.to_q.weight"),
                                   diffusers.at("transformer_blocks.0.attn.to_k.weight"),
                                   diffusers.at("transformer_blocks.0.attn.to_v.weight")})));
    const auto halves = diffusers.at("norm_out.linear.weight").chunk(2, 0);
    EXPECT_TRUE(at::equal(bfl.at("final_layer.adaLN_modulation.1.weight"), at::cat({halves[1], halves[0]})));
    for (const auto& [name, t] : bfl) EXPECT_EQ(name.find("transformer_blocks"), std::string::npos) << name;

    const auto sample = [&](const std::string& model, const std::string& extra, const std::string& dir) {
        const std::string cmd =
            std::string(DTUNE_BIN) + " sample --model '" + model + "' " + extra +
            " --prompt 'a flux photo' --width 32 --height 32 --steps 2 --seed 3 --device cpu "
            "--output_dir '" +
            (w.dir / dir).string() + "' >/dev/null 2>>'" + (w.dir / "log.txt").string() + "'";
        EXPECT_EQ(run_status(cmd), 0) << w.log();
        return io::read_image(w.dir / dir / "sample_3_0.png").pixels;
    };
    const auto from_folder = sample((out / "pipeline").string(), "", "s_folder");
    const auto from_file =
        sample(file.string(), "--config_folder '" + (out / "pipeline").string() + "'", "s_file");
    EXPECT_EQ(from_folder, from_file) << "the single file must load to the exported transformer";
    EXPECT_NE(
        run_status(w.command("lora", "--model_type lora --max_train_steps 1 --export_single_file true")), 0);
    EXPECT_NE(w.log().find("export_single_file writes the fully fine-tuned model"), std::string::npos)
        << w.log();
}

// lora_format comfyui for Flux is SimpleTuner's: the diffusers file's "transformer." PEFT keys, the
// same factors, plus a float32 `.alpha` per module (ComfyUI maps transformer.<diffusers module> onto
// the slices of its fused weights, so each projection applies exactly). dtune reads it back to the
// diffusers file's LoRA (the same image from `dtune sample --lora`; a changed alpha changes it), and
// a run resumes exactly from it.
TEST(FluxTrainCli, ComfyUILoRAIsTheDiffusersLayoutWithAlphasAndReadsBackTheSame) {
    FluxWorkspace w;
    const std::string lora = "--model_type lora --lora_rank 4 --lora_alpha 8 --learning_rate 0.05 ";
    ASSERT_EQ(run_status(w.command("diffusers", lora + "--max_train_steps 2")), 0) << w.log();
    ASSERT_EQ(run_status(w.command("comfy", lora + "--lora_format comfyui --max_train_steps 2")), 0)
        << w.log();
    ASSERT_EQ(run_status(w.command("split", lora + "--lora_format comfyui --max_train_steps 1")), 0)
        << w.log();
    ASSERT_EQ(run_status(w.command("split", lora + "--lora_format comfyui --max_train_steps 2")), 0)
        << w.log();
    const auto diffusers_file = w.dir / "diffusers" / "pytorch_lora_weights.safetensors";
    const auto comfy_file = w.dir / "comfy" / "pytorch_lora_weights.safetensors";
    const auto diffusers = tensors_of(diffusers_file);
    const auto comfy = tensors_of(comfy_file);
    const auto split = tensors_of(w.dir / "split" / "pytorch_lora_weights.safetensors");
    int64_t modules = 0;
    for (const auto& [name, t] : diffusers) {
        ASSERT_TRUE(comfy.count(name)) << name << " is missing from the comfyui file";
        EXPECT_TRUE(at::equal(t, comfy.at(name))) << name;
        if (!name.ends_with(".lora_A.weight")) continue;
        ++modules;
        const std::string alpha = name.substr(0, name.size() - 14) + ".alpha";
        ASSERT_TRUE(comfy.count(alpha)) << alpha;
        EXPECT_EQ(comfy.at(alpha).scalar_type(), at::kFloat);
        EXPECT_EQ(comfy.at(alpha).item<double>(), 8.0) << alpha;
    }
    EXPECT_GT(modules, 0);
    EXPECT_EQ(comfy.size(), diffusers.size() + static_cast<size_t>(modules)) << "only factors and alphas";
    ASSERT_EQ(split.size(), comfy.size());
    for (const auto& [name, t] : comfy) {
        EXPECT_EQ(name.rfind("transformer.", 0), 0u) << name;
        EXPECT_TRUE(at::equal(t, split.at(name))) << name << ": resume from a comfyui file is not exact";
    }

    const auto base = sample_with(w, {}, "sample_base");
    const auto with_diffusers = sample_with(w, diffusers_file, "sample_diffusers");
    EXPECT_NE(with_diffusers, base)
        << "the trained LoRA must change the image for this test to mean anything";
    EXPECT_EQ(sample_with(w, comfy_file, "sample_comfy"), with_diffusers);
    // The alphas are read: halving them (scale 1 instead of 2) gives another image.
    io::TensorList halved;
    for (const auto& [name, t] : comfy) halved.emplace_back(name, name.ends_with(".alpha") ? t / 2 : t);
    io::save_safetensors(w.dir / "halved.safetensors", halved);
    EXPECT_NE(sample_with(w, w.dir / "halved.safetensors", "sample_halved"), with_diffusers);
}

std::vector<nlohmann::json> jsonl_rows(const stdfs::path& file) {
    std::vector<nlohmann::json> rows;
    std::istringstream lines(fs::read_file(file));
    for (std::string line; std::getline(lines, line);)
        if (!line.empty()) rows.push_back(nlohmann::json::parse(line));
    return rows;
}

// The tiny CLIPModel folder of tests/report/test_clip_score.cpp: the fixture's CLIP text tower, the
// reference vision tower, config and tokenizer.
stdfs::path assemble_tiny_clip(const stdfs::path& dir) {
    const auto out = dir / "tiny-clip";
    stdfs::create_directories(out);
    const auto fixture = test::fixtures_dir() / "tiny-sdxl";
    io::TensorList tensors;
    const io::SafetensorsFile text(fixture / "text_encoder" / "model.safetensors");
    for (const auto& k : text.keys())
        if (!k.ends_with("position_ids"))
            tensors.emplace_back(k.rfind("text_model.", 0) == 0 ? k : "text_model." + k, text.get(k).clone());
    const io::SafetensorsFile vision(kRef / "tiny-clip-vision.safetensors");
    for (const auto& k : vision.keys()) tensors.emplace_back(k, vision.get(k).clone());
    io::save_safetensors(out / "model.safetensors", tensors);
    stdfs::copy_file(kRef / "tiny-clip-config.json", out / "config.json");
    for (const auto& e : stdfs::directory_iterator(fixture / "tokenizer"))
        stdfs::copy_file(e.path(), out / e.path().filename());
    return out;
}

// A Flux run with a dataset_type eval dataset and evaluation_type clip: eval loss at fixed sigmas
// (report/eval_loss.h) after every step, the same numbers in a second identical run, charted in
// report.html; CLIP scores of the validation images in metrics.jsonl. Only images and prompts reach
// the CLIP scorer, so nothing in it is SDXL's.
TEST(FluxTrainCli, EvalLossAtFixedSigmasAndClipScoresAreLogged) {
    FluxWorkspace w;
    const auto eval = w.dir / "eval";
    stdfs::create_directories(eval);
    for (int i = 0; i < 2; ++i) {
        io::RgbImage img(64, 64);
        for (size_t p = 0; p < img.pixels.size(); ++p)
            img.pixels[p] = static_cast<uint8_t>((p * 7 + i * 53) % 256);
        io::write_image(eval / ("a held out photo " + std::to_string(i) + ".png"), img);
    }
    auto backends = nlohmann::json::parse(fs::read_file(w.dir / "multidatabackend.json"));
    backends.push_back({{"id", "holdout"},
                        {"type", "local"},
                        {"dataset_type", "eval"},
                        {"instance_data_dir", eval.string()},
                        {"resolution", 64},
                        {"resolution_type", "pixel"},
                        {"caption_strategy", "filename"}});
    fs::write_file_atomic(w.dir / "multidatabackend.json", backends.dump(2));
    const auto clip = assemble_tiny_clip(w.dir.path());
    const std::string args =
        "--model_type lora --lora_rank 4 --max_train_steps 2 --eval_steps_interval 1 --eval_timesteps 3 "
        "--validation_prompt 'a red cube' --validation_num_inference_steps 2 --validation_resolution 64x64 "
        "--validation_step_interval 2 --evaluation_type clip --pretrained_evaluation_model_name_or_path '" +
        clip.string() + "'";
    ASSERT_EQ(run_status(w.command("a", args)), 0) << w.log();
    ASSERT_EQ(run_status(w.command("b", args)), 0) << w.log();
    const auto a = jsonl_rows(w.dir / "a" / "eval.jsonl"), b = jsonl_rows(w.dir / "b" / "eval.jsonl");
    ASSERT_EQ(a.size(), 2u) << w.log();
    ASSERT_EQ(b.size(), 2u);
    for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i].at("step").get<int64_t>(), static_cast<int64_t>(i + 1));
        EXPECT_EQ(a[i].at("images").get<int64_t>(), 2);
        const double loss = a[i].at("eval_loss").get<double>();
        EXPECT_TRUE(std::isfinite(loss) && loss > 0) << loss;
        EXPECT_EQ(loss, b[i].at("eval_loss").get<double>())
            << "fixed sigmas and noise: the same run, the same loss";
    }
    EXPECT_NE(a[0].at("eval_loss").get<double>(), a[1].at("eval_loss").get<double>())
        << "the LoRA trained between the two evaluations";
    EXPECT_NE(fs::read_file(w.dir / "a" / "report.html").find("eval-loss-chart"), std::string::npos);
    int clip_rows = 0;
    for (const auto& row : jsonl_rows(w.dir / "a" / "metrics.jsonl"))
        if (row.contains("clip/mean")) {
            ++clip_rows;
            const double score = row.at("clip/mean").get<double>();
            EXPECT_TRUE(score >= 0 && score <= 100) << score;
        }
    EXPECT_EQ(clip_rows, 2) << "validation at steps 0 (benchmark) and 2 each log one CLIP row";
}

// validation_preview on a Flux run: every sampler step's latents reach the webhook decoded by a
// taef1-shaped tiny autoencoder (16 channels); a 4-channel (taesdxl-shaped) one is refused at load
// with the decoder Flux needs named, and the run goes on without previews.
TEST(FluxTrainCli, ValidationPreviewsDecodeWithTaef1) {
    for (const char* decoder : {"tiny-taef1", "tiny-taesd"}) {
        FluxWorkspace w;
        test::HttpListener listener;
        auto cfg = nlohmann::json::parse(fs::read_file(w.config));
        cfg["webhook_config"] =
            nlohmann::json{{"webhook_type", "raw"}, {"callback_url", listener.url("/hook")}};
        cfg["validation_preview"] = true;
        cfg["validation_preview_steps"] = 1;
        cfg["validation_preview_model"] = (kRef / decoder).string();
        cfg["validation_prompt"] = "a red cube";
        cfg["validation_num_inference_steps"] = 2;
        cfg["validation_resolution"] = "64x64";
        cfg["validation_step_interval"] = 1;
        fs::write_file_atomic(w.config, cfg.dump(2));
        ASSERT_EQ(run_status(w.command("out", "--model_type lora --lora_rank 4 --max_train_steps 1")), 0)
            << w.log();
        std::vector<int64_t> steps;
        for (const auto& r : listener.requests()) {
            const auto body = nlohmann::json::parse(r.body);
            if (body.value("type", "") != "validation.image") continue;
            steps.push_back(body.at("data").at("step").get<int64_t>());
            EXPECT_EQ(body.at("data").at("resolution"), nlohmann::json::array({64, 64}));
            EXPECT_FALSE(body.at("images").at(0).get<std::string>().empty());
        }
        if (std::string(decoder) == "tiny-taef1") {
            // Validation at steps 0 and 1, a preview after each of the two sampler steps.
            EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 1, 2})) << w.log();
        } else {
            EXPECT_TRUE(steps.empty());
            EXPECT_NE(w.log().find("madebyollin/taef1"), std::string::npos) << w.log();
        }
    }
}

// ---- SimpleTuner's Flux / flow-matching keys (issue #23) ------------------------------------------

// Every image of a validation_images folder, by file name.
std::map<std::string, std::vector<uint8_t>> validation_pixels(const stdfs::path& dir) {
    std::map<std::string, std::vector<uint8_t>> out;
    for (const auto& e : stdfs::directory_iterator(dir / "validation_images"))
        if (e.path().extension() == ".png")
            out[e.path().filename().string()] = io::read_image(e.path()).pixels;
    return out;
}

// SimpleTuner's simpletuner/examples/flux.peft-lora/config.json (bghira/SimpleTuner bc8e6ab) with only
// pretrained_model_name_or_path, data_backend_config and output_dir pointed at the test's files. On the
// command line: 2 steps instead of 100, and 64x64 validation images instead of 1024x1024, for time.
TEST(FluxTrainCli, SimpleTunersFluxPeftLoraExampleRuns) {
    FluxWorkspace w;
    const nlohmann::json example = {
        {"base_model_precision", "int8-quanto"},
        {"checkpoint_step_interval", 10},
        {"controlnet", false},
        {"data_backend_config", (w.dir / "multidatabackend.json").string()},
        {"disable_bucket_pruning", true},
        {"flow_schedule_shift", 3},
        {"fuse_qkv_projections", false},
        {"grad_clip_method", "value"},
        {"gradient_checkpointing", true},
        {"hub_model_id", "simpletuner-example-flux-peft-lora"},
        {"learning_rate", 1e-4},
        {"lora_alpha", 16},
        {"lora_rank", 16},
        {"lora_type", "standard"},
        {"lr_scheduler", "constant"},
        {"max_train_steps", 100},
        {"mixed_precision", "bf16"},
        {"model_family", "flux"},
        {"model_type", "lora"},
        {"num_eval_images", 25},
        {"num_train_epochs", 0},
        {"optimizer", "adamw_bf16"},
        {"output_dir", (w.dir / "example").string()},
        {"pretrained_model_name_or_path", w.model.string()},
        {"push_checkpoints_to_hub", false},
        {"push_to_hub", false},
        {"quantize_via", "cpu"},
        {"report_to", "none"},
        {"seed", 42},
        {"tracker_project_name", "lora-training"},
        {"tracker_run_name", "example-training-run"},
        {"train_batch_size", 1},
        {"use_ema", false},
        {"vae_batch_size", 1},
        {"validation_disable_unconditional", true},
        {"validation_guidance", 4.0},
        {"validation_guidance_rescale", 0.0},
        {"validation_negative_prompt", "ugly, cropped, blurry, low-quality, mediocre average"},
        {"validation_num_inference_steps", 16},
        {"validation_prompt", "🟫 is holding a sign that says hello world from flux"},
        {"validation_prompt_library", false},
        {"validation_resolution", "1024x1024"},
        {"validation_seed", 42},
        {"validation_steps", 50}};
    const auto config = w.dir / "example.json";
    fs::write_file_atomic(config, example.dump(2));
    const std::string cmd = "'" + std::string(DTUNE_BIN) + "' train --config '" + config.string() +
                            "' --max_train_steps 2 --validation_resolution 64x64 --device cpu 2>>'" +
                            (w.dir / "log.txt").string() + "'";
    ASSERT_EQ(run_status(cmd), 0) << w.log();
    const auto out = w.dir / "example";
    const auto lora = tensors_of(out / "pytorch_lora_weights.safetensors");
    std::set<std::string> modules;
    for (const auto& [name, t] : lora) {
        if (name.ends_with(".lora_A.weight")) {
            EXPECT_EQ(t.size(0), 16) << name;  // lora_rank 16
        }
        modules.insert(name.substr(0, name.find(".lora_")));
    }
    // flux_lora_target's default "all": both streams' attention projections.
    EXPECT_TRUE(modules.count("transformer.transformer_blocks.0.attn.to_add_out")) << *modules.begin();
    EXPECT_TRUE(modules.count("transformer.single_transformer_blocks.0.attn.to_k"));
    EXPECT_FALSE(modules.count("transformer.transformer_blocks.0.ff.net.2"));
    const std::string log = w.log();
    EXPECT_NE(log.find("int8-quanto"), std::string::npos) << log;  // the quantised frozen base
    EXPECT_NE(log.find("shift 3"), std::string::npos) << log;
    const auto resolved = nlohmann::json::parse(fs::read_file(out / "config.resolved.json"));
    EXPECT_EQ(resolved.at("quantize_via"), "cpu");
    EXPECT_EQ(resolved.at("disable_bucket_pruning"), true);
    EXPECT_EQ(resolved.at("tokenizer_max_length"), 512);
    // validation_steps 50: the base model's images at step 0 and the final ones, one each.
    EXPECT_EQ(validation_pixels(out).size(), 2u) << log;
}

// Each key changes what a 2-step LoRA run trains (the LoRA differs from the defaults' run), except
// fuse_qkv_projections, which computes the same products (LoRA layers keep their own q/k/v adapters),
// and a default written out, which changes nothing.
TEST(FluxTrainCli, FlowAndFluxKeysChangeWhatIsTrained) {
    FluxWorkspace w;
    const std::string lora = "--model_type lora --lora_rank 4 --max_train_steps 2 ";
    const auto run = [&](const std::string& name, const std::string& keys) {
        EXPECT_EQ(run_status(w.command(name, lora + keys)), 0) << name << "\n" << w.log();
        return tensors_of(w.dir / name / "pytorch_lora_weights.safetensors");
    };
    const auto max_diff = [](const std::map<std::string, at::Tensor>& a,
                             const std::map<std::string, at::Tensor>& b) {
        double d = 0;
        for (const auto& [name, t] : a) d = std::max(d, (t - b.at(name)).abs().max().item<double>());
        return d;
    };
    const auto base = run("base", "");
    EXPECT_EQ(max_diff(run("explicit_defaults", "--flux_guidance_value 1.0 --flow_schedule_shift 3"), base),
              0.0);
    EXPECT_LE(max_diff(run("fused", "--fused_qkv_projections true"), base), 1e-5);  // SimpleTuner's alias
    for (const std::string keys :
         {"--flux_guidance_mode random-range --flux_guidance_min 1 --flux_guidance_max 6",
          "--flux_guidance_value 3.5",
          "--flow_use_beta_schedule true --flow_beta_schedule_alpha 0.5 --flow_beta_schedule_beta 4",
          "--flow_use_uniform_schedule true", "--flux_fast_schedule true", "--flow_schedule_auto_shift true",
          "--flux_attention_masked_training true", "--flux_lora_target context+ffs"}) {
        const auto trained = run("variant", keys);
        if (keys.find("flux_lora_target") != std::string::npos) {
            EXPECT_TRUE(trained.count("transformer.transformer_blocks.0.ff_context.net.2.lora_A.weight"));
            EXPECT_FALSE(trained.count("transformer.transformer_blocks.0.attn.to_q.lora_A.weight"));
        } else {
            EXPECT_GT(max_diff(trained, base), 1e-7) << keys << " trained what the defaults train";
        }
        stdfs::remove_all(w.dir / "variant");
    }
}

// Bad values stop before anything loads, with exit code 2 and a message naming the key and what to do.
TEST(FluxTrainCli, InvalidFluxKeysExitTwoNamingTheKeyAndChoices) {
    FluxWorkspace w;
    const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
        {"--flux_guidance_mode sometimes", {"flux_guidance_mode", "constant,random-range"}},
        {"--flux_lora_target controlnet", {"flux_lora_target", "all+ffs+embedder", "ai-toolkit", "nano"}},
        {"--prediction_type epsilon", {"prediction_type", "flow_matching"}},
        {"--model_family sdxl --prediction_type flow_matching", {"prediction_type", "SDXL"}},
        {"--model_flavour kontext", {"model_flavour", "schnell"}},
        {"--model_flavour base-1.0", {"model_flavour", "dev, krea or schnell"}},
        {"--model_flavour schnell", {"model_flavour", "flux_fast_schedule"}},
        {"--model_flavour schnell --flux_fast_schedule true --model_type lora", {"disable_assistant_lora"}},
        {"--quantize_via pipeline", {"quantize_via", "accelerator,cpu"}},
        {"--flow_beta_schedule_alpha 0", {"flow_beta_schedule_alpha", "greater than 0"}},
        {"--flux_guidance_max -1", {"flux_guidance_max", "at least 0"}},
        {"--validation_guidance_real 0.5", {"validation_guidance_real"}},
    };
    for (const auto& [args, words] : cases) {
        SCOPED_TRACE(args);
        stdfs::remove(w.dir / "log.txt");
        EXPECT_EQ(run_status(w.command("bad", args + " --max_train_steps 1")), 2) << w.log();
        const std::string log = w.log();
        for (const auto& word : words) EXPECT_NE(log.find(word), std::string::npos) << word << "\n" << log;
        EXPECT_FALSE(stdfs::exists(w.dir / "bad" / "checkpoint-1"));
    }
}

// model_flavour schnell (SimpleTuner: fast schedule, 256 T5 tokens): the text cache holds 256-token
// entries, tokenizer_max_length is ignored with a warning and resolved to 256; a dev run's cache is 512.
TEST(FluxTrainCli, SchnellFlavourEncodes256TokensAndTrainsOnTheFastSchedule) {
    FluxWorkspace w;
    const std::string args = "--model_type full --max_train_steps 1 --compress_disk_cache false ";
    ASSERT_EQ(run_status(w.command("schnell", args + "--model_flavour schnell --flux_fast_schedule true "
                                                     "--tokenizer_max_length 300")),
              0)
        << w.log();
    const std::string log = w.log();
    EXPECT_NE(log.find("tokenizer_max_length 300 is ignored"), std::string::npos) << log;
    EXPECT_NE(log.find("flux_fast_schedule"), std::string::npos) << log;
    const auto resolved = nlohmann::json::parse(fs::read_file(w.dir / "schnell" / "config.resolved.json"));
    EXPECT_EQ(resolved.at("tokenizer_max_length"), 256);
    const auto lengths = [&] {  // T5 length -> text cache entries
        std::map<int64_t, int> out;
        for (const auto& e : stdfs::recursive_directory_iterator(w.dir / "cache_text"))
            if (e.path().extension() == ".safetensors")
                ++out[io::SafetensorsFile(e.path()).get("attention_mask").size(-1)];
        return out;
    };
    EXPECT_EQ(lengths(), (std::map<int64_t, int>{{256, 5}}));  // 4 captions and the empty one
    // Another T5 length is another text cache identity: a dev run encodes its own 512-token entries.
    ASSERT_EQ(run_status(w.command("dev", args)), 0) << w.log();
    EXPECT_EQ(lengths(), (std::map<int64_t, int>{{256, 5}, {512, 5}}));
}

// validation_guidance_real > 1: true CFG with the negative prompt in the validation images, from sampler
// step validation_no_cfg_until_timestep on (a start past the last step gives the plain image back); a
// run with flux_attention_masked_training validates with the mask too. Compared on the base model's
// images of step 0, which training cannot have changed.
TEST(FluxTrainCli, ValidationGuidanceRealIsTrueCfgFromTheGivenStep) {
    FluxWorkspace w;
    const std::string args =
        "--model_type lora --lora_rank 4 --max_train_steps 1 --validation_prompt 'a red cube' "
        "--validation_negative_prompt 'a blue ball' --validation_num_inference_steps 3 "
        "--validation_resolution 64x64 --validation_step_interval 1 ";
    const auto image = [&](const std::string& name, const std::string& keys) {
        EXPECT_EQ(run_status(w.command(name, args + keys)), 0) << w.log();
        const auto images = validation_pixels(w.dir / name);
        const auto it = images.find("step_0_validation_0_64x64.png");
        EXPECT_TRUE(it != images.end()) << w.log();
        return it == images.end() ? std::vector<uint8_t>{} : it->second;
    };
    const auto plain = image("plain", "");
    const auto cfg = image("cfg", "--validation_guidance_real 4 --validation_no_cfg_until_timestep 0");
    const auto late = image("late", "--validation_guidance_real 4 --validation_no_cfg_until_timestep 3");
    const auto masked = image("masked", "--flux_attention_masked_training true");
    EXPECT_NE(cfg, plain);
    EXPECT_EQ(late, plain) << "true CFG must not start before validation_no_cfg_until_timestep";
    EXPECT_NE(masked, plain) << "a run trained with masked attention validates with it";
}

// use_dora on Flux: every adapted projection gets PEFT's lora_magnitude_vector (one per output
// feature) in the diffusers file, with use_dora in its adapter metadata (what FluxPipeline's
// load_lora_weights needs; tools/ref/check_diffusers_exports.py (d) loads it), the magnitudes
// train, and a run resumes from the file exactly.
TEST(FluxTrainCli, DoRATrainsMagnitudesAndResumesExactly) {
    FluxWorkspace w;
    const std::string dora = "--model_type lora --lora_rank 4 --use_dora true --learning_rate 0.05 ";
    ASSERT_EQ(run_status(w.command("straight", dora + "--max_train_steps 2")), 0) << w.log();
    ASSERT_EQ(run_status(w.command("split", dora + "--max_train_steps 1")), 0) << w.log();
    ASSERT_EQ(run_status(w.command("split", dora + "--max_train_steps 2")), 0) << w.log();
    const auto file = w.dir / "straight" / "pytorch_lora_weights.safetensors";
    const auto straight = tensors_of(file);
    const auto split = tensors_of(w.dir / "split" / "pytorch_lora_weights.safetensors");
    const auto base = tensors_of(w.model / "transformer" / "diffusion_pytorch_model.safetensors");
    ASSERT_EQ(straight.size(), split.size());
    int64_t magnitudes = 0, factors = 0;
    double moved = 0;
    for (const auto& [name, t] : straight) {
        EXPECT_TRUE(at::equal(t, split.at(name))) << name << ": resume is not exact";
        if (name.ends_with(".lora_A.weight")) ++factors;
        if (!name.ends_with(".lora_magnitude_vector")) continue;
        ++magnitudes;
        // DoRA starts from the row norms of the frozen weight: [out] per projection.
        const std::string module = name.substr(12, name.size() - 12 - 22);  // no "transformer.", no suffix
        const at::Tensor weight = base.at(module + ".weight").to(at::kFloat);
        ASSERT_EQ(t.sizes(), at::IntArrayRef({weight.size(0)})) << name;
        moved = std::max(moved, (t.to(at::kFloat) - weight.norm(2, {1})).abs().max().item<double>());
    }
    EXPECT_EQ(magnitudes, factors) << "one magnitude per adapted projection";
    EXPECT_GT(magnitudes, 0);
    EXPECT_GT(moved, 1e-3) << "the magnitudes must train";
    const auto meta = nlohmann::json::parse(io::SafetensorsFile(file).metadata().at("lora_adapter_metadata"));
    EXPECT_EQ(meta.at("transformer.use_dora"), true);
}

}  // namespace
}  // namespace test_flux_train_cli_local
}  // namespace dtune
