// End to end: `dtune train` on CPU with the tiny SDXL fixture and a generated dataset of a dozen
// small PNGs (written with io::write_image): loss finite, outputs written (full: a pipeline folder
// `dtune inspect` opens; LoRA: ComfyUI-keyed adapter files, EMA copy), resume equality through
// the CLI (2 steps straight == 1 step, then resume, 1 step), SIGTERM -> checkpoint + exit code 4,
// an unimplemented option -> exit code 2 naming it, and bad inputs (an empty image folder, an
// unwritable output_dir, a missing model, a damaged checkpoint) -> the README's exit codes; a hung
// webhook bounds the end of a run and a SIGTERM cuts it; planted secrets reach no output.
#include <gtest/gtest.h>

#include <set>

#include <csignal>
#include <fstream>
#include <thread>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/fs.h"
#include "io/image.h"
#include "io/safetensors.h"
#include "support/http_listener.h"
#include "support/shell.h"
#include "support/test_support.h"
#include "train_cli_util.h"

namespace dtune {
namespace test_train_cli_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

struct Workspace {
    test::TempDir dir;
    std::filesystem::path config;

    Workspace() {
        const auto images = dir / "images";
        std::filesystem::create_directories(images);
        for (int i = 0; i < 12; ++i) {
            io::RgbImage img(80, 64);  // landscape: resized to 80x64 then centre-cropped to 64x64
            for (size_t p = 0; p < img.pixels.size(); ++p)
                img.pixels[p] = static_cast<uint8_t>((p * 7 + i * 31) % 256);
            io::write_image(images / ("a photo number " + std::to_string(i) + ".png"), img);
        }
        const nlohmann::json backends =
            nlohmann::json::array({{{"id", "tiny"},
                                    {"type", "local"},
                                    {"instance_data_dir", images.string()},
                                    {"resolution", 64},
                                    {"resolution_type", "pixel"},
                                    {"caption_strategy", "filename"}},
                                   {{"id", "text"},
                                    {"type", "local"},
                                    {"dataset_type", "text_embeds"},
                                    {"default", true},
                                    {"cache_dir", (dir / "cache_text").string()}}});
        fs::write_file_atomic(dir / "multidatabackend.json", backends.dump(2));
        const nlohmann::json cfg = testutil::tiny_cli_config(dir / "multidatabackend.json");
        config = dir / "config.json";
        fs::write_file_atomic(config, cfg.dump(2));
    }

    std::string command(const std::string& out, const std::string& extra) const {
        return std::string(DTUNE_BIN) + " train --config '" + config.string() + "' --output_dir '" +
               (dir / out).string() + "' " + extra + " 2>>'" + (dir / "log.txt").string() + "'";
    }
};

using test::run_status;

TEST(TrainCli, EndToEndOutputsAndResumeEquality) {
    Workspace w;
    ASSERT_EQ(run_status(w.command("straight", "--max_train_steps 2")), 0)
        << fs::read_file(w.dir / "log.txt");
    ASSERT_EQ(run_status(w.command("split", "--max_train_steps 1")), 0);
    ASSERT_EQ(run_status(w.command("split", "--max_train_steps 2")), 0);
    EXPECT_NE(fs::read_file(w.dir / "log.txt").find("resumed from"), std::string::npos);

    const auto out = w.dir / "straight";
    for (const char* f :
         {"config.resolved.json", "metrics.jsonl", "checkpoint-1/.guard", "checkpoint-2/.guard",
          "pipeline/unet/config.json", "pipeline/unet/diffusion_pytorch_model.safetensors"})
        EXPECT_TRUE(std::filesystem::exists(out / f)) << f;
    std::ifstream metrics(out / "metrics.jsonl");
    std::string line;
    int lines = 0;
    while (std::getline(metrics, line)) {
        EXPECT_TRUE(std::isfinite(nlohmann::json::parse(line).at("loss").get<double>())) << line;
        ++lines;
    }
    EXPECT_EQ(lines, 2);

    const auto a = io::load_safetensors(out / "pipeline/unet/diffusion_pytorch_model.safetensors");
    const auto b = io::load_safetensors(w.dir / "split/pipeline/unet/diffusion_pytorch_model.safetensors");
    const auto base =
        io::load_safetensors(test::fixtures_dir() / "tiny-sdxl/unet/diffusion_pytorch_model.safetensors");
    ASSERT_EQ(a.size(), b.size());
    std::map<std::string, at::Tensor> base_by_name(base.begin(), base.end());
    int64_t differing = 0, trained = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_EQ(a[i].first, b[i].first);
        differing += at::equal(a[i].second, b[i].second) ? 0 : 1;
        trained += at::equal(a[i].second, base_by_name.at(a[i].first)) ? 0 : 1;
    }
    EXPECT_EQ(differing, 0);
    EXPECT_GT(trained, 0);
    // pipeline/ is a complete diffusers folder that dtune's own loader opens.
    EXPECT_TRUE(std::filesystem::exists(out / "pipeline/model_index.json"));
    EXPECT_EQ(run_status(std::string(DTUNE_BIN) + " inspect '" + (out / "pipeline").string() +
                         "' >/dev/null 2>>'" + (w.dir / "log.txt").string() + "'"),
              0)
        << fs::read_file(w.dir / "log.txt");
}

TEST(TrainCli, LoRARunWritesAdapterFilesAndResumesExactly) {
    Workspace w;
    const std::string lora =
        "--model_type lora --lora_rank 4 --lora_alpha 4 --lora_format comfyui --use_ema true ";
    ASSERT_EQ(run_status(w.command("straight", lora + "--max_train_steps 2")), 0)
        << fs::read_file(w.dir / "log.txt");
    ASSERT_EQ(run_status(w.command("split", lora + "--max_train_steps 1")), 0);
    ASSERT_EQ(run_status(w.command("split", lora + "--max_train_steps 2")), 0);
    const auto out = w.dir / "straight";
    for (const char* f :
         {"pytorch_lora_weights.safetensors", "ema/pytorch_lora_weights.safetensors",
          "checkpoint-1/pytorch_lora_weights.safetensors", "checkpoint-2/pytorch_lora_weights.safetensors"})
        EXPECT_TRUE(std::filesystem::exists(out / f)) << f;
    EXPECT_FALSE(std::filesystem::exists(out / "pipeline"));
    const auto file = io::load_safetensors(out / "pytorch_lora_weights.safetensors");
    int64_t alphas = 0;
    for (const auto& [k, v] : file) {
        EXPECT_EQ(k.rfind("lora_unet_", 0), 0u) << k;
        if (k.size() > 6 && k.compare(k.size() - 6, 6, ".alpha") == 0) {
            ++alphas;
            EXPECT_EQ(v.item<float>(), 4.0f) << k;
        }
    }
    EXPECT_GT(alphas, 0);
    for (const char* f : {"pytorch_lora_weights.safetensors", "ema/pytorch_lora_weights.safetensors"})
        EXPECT_EQ(fs::read_file(out / f), fs::read_file(w.dir / "split" / f)) << f;
    EXPECT_EQ(run_status(std::string(DTUNE_BIN) + " inspect '" +
                         (out / "pytorch_lora_weights.safetensors").string() + "' >/dev/null 2>>'" +
                         (w.dir / "log.txt").string() + "'"),
              0);
}

// The seed config of issue #22: SimpleTuner's SDXL quickstart config.json lines as they stand (the
// main block, "Quantised model training" and "Validation previews") plus only what points at this
// machine (model, data, webhook, preview decoder, a short run without the step-0 benchmark images,
// a validation prompt). The run must
// finish, train on an int8 UNet with optimi-lion, and send TAESD previews to the webhook.
TEST(TrainCli, QuickstartSeedConfigRunsUnchanged) {
    Workspace w;
    test::HttpListener listener;
    nlohmann::json cfg = nlohmann::json::parse(R"({
      "model_type": "lora",
      "model_family": "sdxl",
      "model_flavour": "base-1.0",
      "output_dir": "/home/user/output/models",
      "validation_resolution": "1024x1024,1280x768",
      "validation_guidance": 3.4,
      "use_gradient_checkpointing": true,
      "learning_rate": 1e-4,
      "base_model_precision": "int8-quanto",
      "text_encoder_1_precision": "no_change",
      "text_encoder_2_precision": "no_change",
      "optimizer": "optimi-lion",
      "validation_preview": true,
      "validation_preview_steps": 1
    })");
    cfg["pretrained_model_name_or_path"] = (test::fixtures_dir() / "tiny-sdxl").string();
    cfg["data_backend_config"] = (w.dir / "multidatabackend.json").string();
    cfg["output_dir"] = (w.dir / "out").string();
    cfg["webhook_config"] = nlohmann::json{{"webhook_type", "raw"}, {"callback_url", listener.url("/hook")}};
    cfg["validation_preview_model"] =
        (std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref" / "tiny-taesd").string();
    cfg["validation_prompt"] = "a red cube";
    cfg["validation_num_inference_steps"] = 2;
    cfg["validation_step_interval"] = 2;
    cfg["max_train_steps"] = 2;
    cfg["train_batch_size"] = 2;
    cfg["device"] = "cpu";
    cfg["disable_benchmark"] = true;  // a short run: no base-model images at step 0 (20 s on a CPU)
    fs::write_file_atomic(w.dir / "seed.json", cfg.dump(2));
    const std::string cmd = std::string(DTUNE_BIN) + " train --config '" + (w.dir / "seed.json").string() +
                            "' 2>>'" + (w.dir / "log.txt").string() + "'";
    ASSERT_EQ(run_status(cmd), 0) << fs::read_file(w.dir / "log.txt");
    const std::string log = fs::read_file(w.dir / "log.txt");
    EXPECT_NE(log.find("quantised the UNet on cpu (int8-quanto: "), std::string::npos) << log;
    EXPECT_TRUE(std::filesystem::exists(w.dir / "out" / "pytorch_lora_weights.safetensors"));
    const auto resolved = nlohmann::json::parse(fs::read_file(w.dir / "out" / "config.resolved.json"));
    EXPECT_EQ(resolved.at("optimizer"), "optimi-lion");
    EXPECT_EQ(resolved.at("base_model_precision"), "int8-quanto");
    std::set<std::vector<int64_t>> preview_sizes;
    for (const auto& r : listener.requests()) {
        const auto body = nlohmann::json::parse(r.body);
        if (body.value("type", "") == "validation.image")
            preview_sizes.insert(body.at("data").at("resolution").get<std::vector<int64_t>>());
    }
    // Both validation resolutions were previewed.
    EXPECT_EQ(preview_sizes, (std::set<std::vector<int64_t>>{{1024, 1024}, {1280, 768}})) << log;
}

// quantized_model_cache: the first quantised run writes the UNet's quantised file, the next loads
// it instead of the full-precision weights and trains the same adapters; a damaged file is reported
// and rebuilt, never trusted.
TEST(TrainCli, QuantizedModelCacheIsWrittenThenLoadedAndRebuiltWhenDamaged) {
    Workspace w;
    const auto cache = w.dir / "qcache";
    const std::string opts =
        "--model_type lora --lora_rank 4 --base_model_precision int8-quanto --max_train_steps 1 "
        "--quantized_model_cache '" +
        cache.string() + "' ";
    const auto log_since = [&](std::size_t from) { return fs::read_file(w.dir / "log.txt").substr(from); };
    ASSERT_EQ(run_status(w.command("a", opts)), 0) << fs::read_file(w.dir / "log.txt");
    EXPECT_NE(log_since(0).find("wrote the quantised UNet to "), std::string::npos);
    std::vector<std::filesystem::path> files;
    for (const auto& e : std::filesystem::directory_iterator(cache)) files.push_back(e.path());
    ASSERT_EQ(files.size(), 1u);
    EXPECT_EQ(files[0].extension(), ".safetensors");

    std::size_t mark = fs::read_file(w.dir / "log.txt").size();
    ASSERT_EQ(run_status(w.command("b", opts)), 0) << log_since(mark);
    EXPECT_NE(log_since(mark).find("loaded the quantised UNet (int8-quanto) from " + files[0].string()),
              std::string::npos)
        << log_since(mark);
    EXPECT_EQ(log_since(mark).find("wrote the quantised UNet"), std::string::npos);
    EXPECT_EQ(fs::read_file(w.dir / "a" / "pytorch_lora_weights.safetensors"),
              fs::read_file(w.dir / "b" / "pytorch_lora_weights.safetensors"));

    std::filesystem::resize_file(files[0], std::filesystem::file_size(files[0]) / 2);
    mark = fs::read_file(w.dir / "log.txt").size();
    ASSERT_EQ(run_status(w.command("c", opts)), 0) << log_since(mark);
    EXPECT_NE(log_since(mark).find("cannot be read"), std::string::npos) << log_since(mark);
    EXPECT_NE(log_since(mark).find("wrote the quantised UNet to "), std::string::npos);
    EXPECT_EQ(fs::read_file(w.dir / "a" / "pytorch_lora_weights.safetensors"),
              fs::read_file(w.dir / "c" / "pytorch_lora_weights.safetensors"));
}

TEST(TrainCli, SigtermSavesACheckpointAndExitsWith4) {
    Workspace w;
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        const std::string cmd =
            "exec " + w.command("interrupted", "--max_train_steps 50 --checkpointing_steps 100");
        execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
        _exit(127);
    }
    const auto metrics = w.dir / "interrupted" / "metrics.jsonl";
    for (int i = 0;
         i < 1200 && !(std::filesystem::exists(metrics) && std::filesystem::file_size(metrics) > 0); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    kill(child, SIGTERM);
    int status = 0;
    waitpid(child, &status, 0);
    ASSERT_TRUE(WIFEXITED(status)) << fs::read_file(w.dir / "log.txt");
    EXPECT_EQ(WEXITSTATUS(status), 4) << fs::read_file(w.dir / "log.txt");
    bool found = false;
    for (const auto& e : std::filesystem::directory_iterator(w.dir / "interrupted"))
        if (e.path().filename().string().rfind("checkpoint-", 0) == 0)
            found = found || std::filesystem::exists(e.path() / ".guard");
    EXPECT_TRUE(found);
}

// DTUNE_FUSED_KERNELS=0 runs the plain ATen ops (here: the LoRA training linear and GEGLU on the
// CPU); the adapters it trains equal the fused run's to float rounding. SGD keeps the comparison a
// comparison of gradients: Adam's first steps divide by |g|, so a gradient that is rounding noise
// becomes a full learning-rate step of either sign. A bad value is a usage error.
TEST(TrainCli, FusedKernelsCanBeTurnedOffForTriage) {
    Workspace w;
    const std::string lora =
        "--model_type lora --lora_rank 4 --lora_alpha 4 --max_train_steps 2 "
        "--optimizer torch-sgd --learning_rate 0.05";
    ASSERT_EQ(run_status(w.command("fused", lora)), 0) << fs::read_file(w.dir / "log.txt");
    ASSERT_EQ(run_status("DTUNE_FUSED_KERNELS=0 " + w.command("plain", lora)), 0)
        << fs::read_file(w.dir / "log.txt");
    EXPECT_NE(fs::read_file(w.dir / "log.txt").find("DTUNE_FUSED_KERNELS=0: dtune's fused kernels are off"),
              std::string::npos);
    const auto fused = io::load_safetensors(w.dir / "fused" / "pytorch_lora_weights.safetensors");
    const auto plain = io::load_safetensors(w.dir / "plain" / "pytorch_lora_weights.safetensors");
    ASSERT_EQ(fused.size(), plain.size());
    // The up factors start at zero, so their size is what training moved them.
    double max_diff = 0, max_up = 0;
    for (std::size_t i = 0; i < fused.size(); ++i) {
        ASSERT_EQ(fused[i].first, plain[i].first);
        max_diff = std::max(max_diff, (fused[i].second - plain[i].second).abs().max().item<double>());
        if (fused[i].first.find(".up.weight") != std::string::npos)
            max_up = std::max(max_up, fused[i].second.abs().max().item<double>());
    }
    EXPECT_GT(max_up, 1e-5);
    EXPECT_LE(max_diff, 1e-4 * max_up);
    EXPECT_EQ(run_status("DTUNE_FUSED_KERNELS=maybe " + w.command("bad", lora)), 2);
    EXPECT_NE(fs::read_file(w.dir / "log.txt").find("DTUNE_FUSED_KERNELS='maybe' is not understood"),
              std::string::npos);
}

// The kernel switches read on first use (DTUNE_FUSED_RESNET_TRAINING, DTUNE_LORA_DROPOUT_KERNELS,
// DTUNE_FUSED_QKV):
// a bad value ends the run with exit 2 naming the variable and its choices, not with a failure in
// a forward or backward pass.
TEST(TrainCli, BadKernelSwitchesAreUsageErrors) {
    Workspace w;
    const std::string lora = "--model_type lora --lora_rank 4 --max_train_steps 1";
    EXPECT_EQ(run_status("DTUNE_FUSED_RESNET_TRAINING=maybe " + w.command("bad", lora)), 2);
    EXPECT_NE(
        fs::read_file(w.dir / "log.txt")
            .find("DTUNE_FUSED_RESNET_TRAINING='maybe' is not understood; use 1 (on/true, the default)"),
        std::string::npos)
        << fs::read_file(w.dir / "log.txt");
    EXPECT_EQ(run_status("DTUNE_LORA_DROPOUT_KERNELS=maybe " + w.command("bad2", lora)), 2);
    EXPECT_NE(fs::read_file(w.dir / "log.txt").find("DTUNE_LORA_DROPOUT_KERNELS=maybe is not a choice"),
              std::string::npos)
        << fs::read_file(w.dir / "log.txt");
    EXPECT_EQ(run_status("DTUNE_FUSED_QKV=maybe " + w.command("bad3", lora)), 2);
    EXPECT_NE(fs::read_file(w.dir / "log.txt")
                  .find("DTUNE_FUSED_QKV=maybe is not a choice: use 1 (q/k/v LoRA layers as one function, "
                        "the default) or 0 (one by one)"),
              std::string::npos)
        << fs::read_file(w.dir / "log.txt");
}

// A bad DTUNE_MAX_IMAGE_PIXELS stops at start with exit 2, before any image is decoded.
TEST(TrainCli, BadMaxImagePixelsIsAUsageErrorAtStart) {
    Workspace w;
    EXPECT_EQ(run_status("DTUNE_MAX_IMAGE_PIXELS=lots " + w.command("bad", "--max_train_steps 1")), 2);
    EXPECT_NE(fs::read_file(w.dir / "log.txt").find("DTUNE_MAX_IMAGE_PIXELS='lots' is not a pixel count"),
              std::string::npos);
    EXPECT_FALSE(std::filesystem::exists(w.dir / "cache_text"));
}

TEST(TrainCli, UnimplementedOptionExitsWithUsageError) {
    Workspace w;
    EXPECT_EQ(run_status(w.command("bad", "--t5_padding zero")), 2);
    EXPECT_NE(
        fs::read_file(w.dir / "log.txt").find("option t5_padding = \"zero\" is not implemented by dtune"),
        std::string::npos);
}

TEST(TrainCli, MissingDataBackendConfigNamesTheKey) {
    Workspace w;
    EXPECT_EQ(run_status(w.command("missing", "--data_backend_config nope.json")), 3);
    EXPECT_NE(
        fs::read_file(w.dir / "log.txt").find("data_backend_config \"nope.json\" is not a readable file"),
        std::string::npos)
        << fs::read_file(w.dir / "log.txt");
}

TEST(TrainCli, CaptionlessSamplesAreLeftOutOfTheLoggedPlan) {
    Workspace w;
    for (int i = 1; i < 12; ++i)  // image 0 has no caption file
        fs::write_file_atomic(w.dir / "images" / ("a photo number " + std::to_string(i) + ".txt"),
                              "a caption\n");
    const nlohmann::json backends =
        nlohmann::json::array({{{"id", "tiny"},
                                {"instance_data_dir", (w.dir / "images").string()},
                                {"resolution", 64},
                                {"resolution_type", "pixel"},
                                {"caption_strategy", "textfile"}},
                               {{"id", "text"},
                                {"dataset_type", "text_embeds"},
                                {"default", true},
                                {"cache_dir", (w.dir / "cache_text").string()}}});
    fs::write_file_atomic(w.dir / "multidatabackend.json", backends.dump(2));
    ASSERT_EQ(run_status(w.command("out", "--max_train_steps 1")), 0) << fs::read_file(w.dir / "log.txt");
    const std::string log = fs::read_file(w.dir / "log.txt");
    EXPECT_NE(log.find("1 sample(s) without a usable caption left out; dataset 'tiny': 11 samples"),
              std::string::npos)
        << log;
}

TEST(TrainCli, EvalDatasetUsesTheSameFallbacksAndDisableAsTraining) {
    Workspace w;
    const auto images = w.dir / "images";
    // Neither image entry names caption_strategy, instance_prompt or resolution: config.json's
    // SimpleTuner fallbacks (given on the command line here) apply to the eval dataset as well.
    const auto write_backends = [&](const nlohmann::json& eval_entry) {
        const nlohmann::json backends =
            nlohmann::json::array({{{"id", "tiny"}, {"instance_data_dir", images.string()}},
                                   eval_entry,
                                   {{"id", "text"},
                                    {"dataset_type", "text_embeds"},
                                    {"default", true},
                                    {"cache_dir", (w.dir / "cache_text").string()}}});
        fs::write_file_atomic(w.dir / "multidatabackend.json", backends.dump(2));
    };
    const std::string fallbacks =
        "--caption_strategy instanceprompt --instance_prompt 'a photo' --resolution 64 --resolution_type "
        "pixel "
        "--max_train_steps 1 --num_eval_images 1 --eval_timesteps 2 ";
    write_backends({{"id", "ev"}, {"dataset_type", "eval"}, {"instance_data_dir", images.string()}});
    ASSERT_EQ(run_status(w.command("eval", fallbacks)), 0) << fs::read_file(w.dir / "log.txt");
    EXPECT_TRUE(std::filesystem::exists(w.dir / "eval" / "eval.jsonl"));
    // An eval entry switched off (SimpleTuner's "disable" alias) means no eval loss, not a failed run.
    write_backends({{"id", "ev"},
                    {"dataset_type", "eval"},
                    {"disable", true},
                    {"instance_data_dir", (w.dir / "missing").string()}});
    ASSERT_EQ(run_status(w.command("off", fallbacks)), 0) << fs::read_file(w.dir / "log.txt");
    EXPECT_FALSE(std::filesystem::exists(w.dir / "off" / "eval.jsonl"));
}

// Bad inputs found by an audit: each stops before any training with the README's exit code and a
// message naming the file or key at fault.
std::string train_output(const std::string& command) {
    const test::ShellRun r = test::run_shell(command);
    return std::to_string(r.exit_code) + ": " + r.output;
}

// Configuration mistakes found by an adversarial run (issue #20): each exits 2 with a message
// naming the file or key, the value and what is allowed, before any training.
TEST(TrainCli, ConfigurationMistakesExitWith2NamingTheKey) {
    Workspace w;
    const auto run = [&](const std::string& extra) {
        return train_output(std::string(DTUNE_BIN) + " train --config '" + w.config.string() +
                            "' --output_dir '" + (w.dir / "out").string() + "' --max_train_steps 1 " + extra +
                            " 2>&1");
    };
    // Before: printed as a negative step count.
    std::string out = run("--max_train_steps 99999999999999999999");
    EXPECT_EQ(out.rfind("2: ", 0), 0u) << out;
    EXPECT_NE(out.find("option max_train_steps = 1e+20 is out of range"), std::string::npos) << out;
    // Before: accepted, and trained with a negative learning rate.
    out = run("--learning_rate -1");
    EXPECT_EQ(out.rfind("2: ", 0), 0u) << out;
    EXPECT_NE(out.find("option learning_rate = -1.0 is out of range; allowed: greater than 0"),
              std::string::npos)
        << out;
    // Before: a C++ backtrace from the bucket maths.
    out = run("--resolution 1e9");
    EXPECT_EQ(out.rfind("2: ", 0), 0u) << out;
    EXPECT_NE(out.find("option resolution = 1000000000.0 is outside the range resolution_type=pixel_area"),
              std::string::npos)
        << out;
    // Before: exit 3 (a data error) for a syntax error in multidatabackend.json, 2 in config.json.
    fs::write_file_atomic(w.dir / "multidatabackend.json", "[\n  {\"id\": \"tiny\"},\n]\n");
    out = run("");
    EXPECT_EQ(out.rfind("2: ", 0), 0u) << out;
    EXPECT_NE(out.find((w.dir / "multidatabackend.json").string() + ":3:1: not valid JSON"),
              std::string::npos)
        << out;
}

TEST(TrainCli, EmptyImageFolderExitsWith3NamingTheFolder) {
    Workspace w;
    for (const auto& f : std::filesystem::directory_iterator(w.dir / "images"))
        std::filesystem::remove(f.path());
    const std::string cmd = std::string(DTUNE_BIN) + " train --config '" + w.config.string() +
                            "' --output_dir '" + (w.dir / "out").string() + "' --max_train_steps 1 2>&1";
    const std::string out = train_output(cmd);
    // Before: exit 2 and "Dataset produced no usable samples ... Lower train_batch_size", no folder named.
    EXPECT_EQ(out.rfind("3: ", 0), 0u) << out;
    EXPECT_NE(
        out.find("no images were discovered in instance_data_dir '" + (w.dir / "images").string() + "'"),
        std::string::npos)
        << out;
}

TEST(TrainCli, UnwritableOutputDirExitsWith2BeforeTheCachesAreBuilt) {
    Workspace w;
    fs::write_file_atomic(w.dir / "a_file",
                          "x");  // a file where a folder is needed: unwritable even for root
    const auto output_dir = w.dir / "a_file" / "out";
    const std::string out =
        train_output(std::string(DTUNE_BIN) + " train --config '" + w.config.string() + "' --output_dir '" +
                     output_dir.string() + "' --max_train_steps 1 2>&1");
    // Before: exit 1 with "filesystem error: cannot create directories" after the text cache was built.
    EXPECT_EQ(out.rfind("2: ", 0), 0u) << out;
    EXPECT_NE(out.find("output_dir '" + output_dir.string() + "' cannot be created or written"),
              std::string::npos)
        << out;
    EXPECT_FALSE(std::filesystem::exists(w.dir / "cache_text"))
        << "the text cache was built before the check";
    // `dtune cache` reads output_dir from the config only.
    auto cfg = nlohmann::json::parse(fs::read_file(w.config));
    cfg["--output_dir"] = output_dir.string();
    fs::write_file_atomic(w.dir / "cache_config.json", cfg.dump(2));
    const std::string cache = train_output(std::string(DTUNE_BIN) + " cache --config '" +
                                           (w.dir / "cache_config.json").string() + "' 2>&1");
    EXPECT_EQ(cache.rfind("2: ", 0), 0u) << cache;
    EXPECT_FALSE(std::filesystem::exists(w.dir / "cache_text")) << cache;
}

TEST(TrainCli, MissingModelFolderExitsWith3) {
    Workspace w;
    const std::string out =
        train_output(std::string(DTUNE_BIN) + " train --config '" + w.config.string() + "' --output_dir '" +
                     (w.dir / "out").string() + "' --pretrained_model_name_or_path '" +
                     (w.dir / "no_model").string() + "' 2>&1");
    // Before: exit 2, while `dtune sample --model <missing>` exits 3 (README: missing model files).
    EXPECT_EQ(out.rfind("3: ", 0), 0u) << out;
    EXPECT_NE(out.find((w.dir / "no_model").string()), std::string::npos) << out;
}

TEST(TrainCli, RelativeModelPathNamesTheWorkingDirectory) {
    // Issue #25: relative paths resolve against the working directory; the error must say which.
    Workspace w;
    std::filesystem::create_directories(w.dir / "elsewhere");
    const std::string out =
        train_output("cd '" + (w.dir / "elsewhere").string() + "' && " + std::string(DTUNE_BIN) +
                     " train --config '" + w.config.string() + "' --output_dir '" + (w.dir / "out").string() +
                     "' --pretrained_model_name_or_path sdxl-base 2>&1");
    EXPECT_EQ(out.rfind("3: ", 0), 0u) << out;
    EXPECT_NE(out.find("pretrained_model_name_or_path \"sdxl-base\" is not a local folder (a relative path "
                       "starts at the working directory " +
                       std::filesystem::weakly_canonical(w.dir / "elsewhere").string()),
              std::string::npos)
        << out;
}

TEST(TrainCli, ModelFolderWithoutVaeSaysSoInsteadOfHubAdvice) {
    // Issue #25: "using the model's own VAE …/vae", then that path called a hub id to download.
    Workspace w;
    const auto model = w.dir / "sdxl-base";
    std::filesystem::copy(test::fixtures_dir() / "tiny-sdxl", model,
                          std::filesystem::copy_options::recursive);
    std::filesystem::remove_all(model / "vae");
    const std::string out =
        train_output("cd '" + w.dir.path().string() + "' && " + std::string(DTUNE_BIN) + " train --config '" +
                     w.config.string() + "' --output_dir '" + (w.dir / "out").string() +
                     "' --pretrained_model_name_or_path sdxl-base 2>&1");
    EXPECT_EQ(out.rfind("3: ", 0), 0u) << out;
    EXPECT_NE(out.find("the model folder sdxl-base has no vae/ folder"), std::string::npos) << out;
    EXPECT_EQ(out.find("hub id"), std::string::npos) << out;
}

TEST(TrainCli, AClosedOutputPipeIsAnErrorNotAKillingSignal) {
    // A rank writing to a dead peer's socket was killed by SIGPIPE before it could report the
    // peer's fault (exit 1 instead of 75, once under load). Here the same signal, deterministically:
    // `dtune train --help` writes its help into a pipe whose reader is already closed, with SIGPIPE
    // at its default action in the child as any shell would leave it. dtune must live to exit.
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    ::close(fds[0]);  // no reader: the first write raises SIGPIPE unless it is ignored
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        ::signal(SIGPIPE, SIG_DFL);
        ::dup2(fds[1], STDOUT_FILENO);
        const int null = ::open("/dev/null", O_WRONLY);
        ::dup2(null, STDERR_FILENO);
        ::execl(DTUNE_BIN, DTUNE_BIN, "train", "--help", static_cast<char*>(nullptr));
        ::_exit(127);
    }
    ::close(fds[1]);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_FALSE(WIFSIGNALED(status)) << "killed by signal " << WTERMSIG(status);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_NE(WEXITSTATUS(status), 127) << "could not execute " << DTUNE_BIN;
}

TEST(TrainCli, HelpSaysAwsDatasetsStreamWithoutALocalCopy) {
    // Issue #25: the help said aws datasets were "mirrored to output_dir/cache/s3/<id>"; they are
    // read from the bucket (TrainS3.ImagesAndParquetInTheBucketCachesLocal checks no mirror exists).
    const std::string help = train_output(std::string(DTUNE_BIN) + " train --help 2>&1");
    EXPECT_EQ(help.rfind("0: ", 0), 0u) << help;
    EXPECT_EQ(help.find("cache/s3"), std::string::npos) << help;
    EXPECT_EQ(help.find("mirrored"), std::string::npos) << help;
    EXPECT_NE(help.find("nothing is copied to local disk first"), std::string::npos) << help;
    EXPECT_NE(help.find("Relative paths"), std::string::npos) << help;
}

TEST(TrainCli, DamagedCheckpointNamesItselfAndTheWayOut) {
    Workspace w;
    ASSERT_EQ(run_status(w.command("out", "--max_train_steps 1")), 0) << fs::read_file(w.dir / "log.txt");
    const auto optimizer = w.dir / "out" / "checkpoint-1" / "optimizer.safetensors";
    std::filesystem::resize_file(optimizer,
                                 std::filesystem::file_size(optimizer) / 2);  // bit rot, a bad copy
    const std::string out =
        train_output(std::string(DTUNE_BIN) + " train --config '" + w.config.string() + "' --output_dir '" +
                     (w.dir / "out").string() + "' --max_train_steps 2 2>&1");
    // Before: only the safetensors message, ending in "re-download or re-export it".
    EXPECT_EQ(out.rfind("3: ", 0), 0u) << out;
    EXPECT_NE(out.find("checkpoint " + (w.dir / "out" / "checkpoint-1").string() +
                       " is damaged: optimizer.safetensors"),
              std::string::npos)
        << out;
    EXPECT_NE(out.find("resume_from_checkpoint"), std::string::npos) << out;
}

// ---- webhooks and secrets (issue #20) ----------------------------------------------------------

std::string train_command(const Workspace& w, const std::string& out, const std::string& extra) {
    return std::string(DTUNE_BIN) + " train --config '" + w.config.string() + "' --output_dir '" +
           (w.dir / out).string() + "' " + extra;
}

std::string hung_webhook_option(const test::SilentListener& hook) {
    const nlohmann::json entry = {{"webhook_type", "raw"}, {"callback_url", hook.url()}};
    return "--webhook_config '" + entry.dump() + "'";
}

std::size_t count_of(const std::string& text, const std::string& part) {
    std::size_t n = 0;
    for (auto p = text.find(part); p != std::string::npos; p = text.find(part, p + 1)) ++n;
    return n;
}

// A webhook that accepts and never answers kept `dtune train` alive for minutes after training
// (each queued event took ~10 s to fail); the end of a run now waits 15 s at most for webhooks and
// says once what it dropped.
TEST(TrainCli, HungWebhookDelaysTheEndByTheBoundedFlushAtMost) {
    Workspace w;
    test::SilentListener hook;
    const auto r = test::run_shell(
        "timeout -s KILL 150 " + train_command(w, "out", "--max_train_steps 2 " + hung_webhook_option(hook)),
        "(end of training)");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    ASSERT_GE(r.seconds_after_mark, 0) << r.output;
    // 15 s of flush, plus the final export and the teardown of a tiny model.
    EXPECT_LT(r.seconds_after_mark, 25) << r.output;
    EXPECT_GE(hook.connections(), 1) << "the webhook was never tried";
    EXPECT_LE(count_of(r.output, "could not deliver"), 1u) << r.output;
    EXPECT_EQ(count_of(r.output, "not delivered"), 1u) << r.output;
    EXPECT_TRUE(std::filesystem::exists(w.dir / "out" / "pipeline" / "model_index.json"));
}

// The first SIGTERM during that flush was taken as "save a checkpoint at the next step" and
// ignored; now it ends the wait at once and the process exits with the run's own code.
TEST(TrainCli, SigtermDuringTheWebhookFlushEndsTheProcess) {
    Workspace w;
    test::SilentListener hook;
    const auto log_path = w.dir / "log.txt";
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        const std::string cmd = "exec " +
                                train_command(w, "out", "--max_train_steps 2 " + hung_webhook_option(hook)) +
                                " 2>>'" + log_path.string() + "'";
        execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
        _exit(127);
    }
    auto log_has = [&](const std::string& text) {
        return std::filesystem::exists(log_path) && test::contains(fs::read_file(log_path), text);
    };
    int status = 0;
    bool exited = false;
    for (int i = 0; i < 1500 && !log_has("webhooks: delivering the last"); ++i) {
        if (waitpid(child, &status, WNOHANG) == child) {
            exited = true;
            break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ASSERT_FALSE(exited) << "exited before the flush: " << fs::read_file(log_path);
    if (!log_has("webhooks: delivering the last")) {
        kill(child, SIGKILL);
        waitpid(child, &status, 0);
        FAIL() << "the webhook flush never started: " << fs::read_file(log_path);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const auto signalled = std::chrono::steady_clock::now();
    kill(child, SIGTERM);
    for (int i = 0; i < 100 && !exited; ++i) {
        exited = waitpid(child, &status, WNOHANG) == child;
        if (!exited) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - signalled).count();
    if (!exited) {
        kill(child, SIGKILL);
        waitpid(child, &status, 0);
    }
    ASSERT_TRUE(exited) << "SIGTERM during the webhook flush did not end the process:\n"
                        << fs::read_file(log_path);
    EXPECT_LT(seconds, 5) << fs::read_file(log_path);
    ASSERT_TRUE(WIFEXITED(status)) << fs::read_file(log_path);
    EXPECT_EQ(WEXITSTATUS(status), 0) << "training had completed: " << fs::read_file(log_path);
    EXPECT_TRUE(std::filesystem::exists(w.dir / "out" / "pipeline" / "model_index.json"));
}

// Secrets planted in an inline webhook_config (a URL's password, a ?token= value, auth_token, a
// Discord URL's path) and in multidatabackend.json (S3 keys) appear in no file under output_dir
// (config.resolved.json, each checkpoint's copy, report.html, ...) and nowhere in the console.
TEST(TrainCli, PlantedSecretsReachNoOutputFileNorTheConsole) {
    Workspace w;
    test::HttpListener hook;  // answers 200: the secrets are really used
    const std::string host = "127.0.0.1:" + std::to_string(hook.port());
    const std::vector<std::string> secrets = {"PLANTED-url-password-41", "PLANTED-query-token-42",
                                              "PLANTED-auth-token-43",   "PLANTED-discord-path-44",
                                              "PLANTED-aws-key-id-45",   "PLANTED-aws-secret-46",
                                              "PLANTED-aws-session-47"};
    const nlohmann::json hooks = nlohmann::json::array(
        {{{"webhook_type", "raw"},
          {"callback_url", "http://hookuser:" + secrets[0] + "@" + host + "/raw?token=" + secrets[1]},
          {"auth_token", secrets[2]}},
         {{"webhook_type", "discord"}, {"webhook_url", "http://" + host + "/api/webhooks/1/" + secrets[3]}}});
    auto config = nlohmann::json::parse(fs::read_file(w.config));
    config["--webhook_config"] = hooks.dump();  // inline JSON, as SimpleTuner's docs show it
    fs::write_file_atomic(w.config, config.dump(2));
    auto backends = nlohmann::json::parse(fs::read_file(w.dir / "multidatabackend.json"));
    backends[0]["aws_access_key_id"] = secrets[4];
    backends[0]["aws_secret_access_key"] = secrets[5];
    backends[0]["aws_session_token"] = secrets[6];
    fs::write_file_atomic(w.dir / "multidatabackend.json", backends.dump(2));

    const auto r = test::run_shell(train_command(w, "out", "--max_train_steps 2 --log_level debug"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    bool token_used = false;
    for (const auto& req : hook.requests())
        token_used |= req.headers.count("x-api-key") && req.headers.at("x-api-key") == secrets[2];
    EXPECT_TRUE(token_used) << "the raw webhook never received its auth_token";
    int files = 0;
    for (const auto& e : std::filesystem::recursive_directory_iterator(w.dir / "out")) {
        if (!e.is_regular_file()) continue;
        ++files;
        const std::string bytes = fs::read_file(e.path());
        for (const auto& secret : secrets)
            EXPECT_EQ(bytes.find(secret), std::string::npos) << secret << " in " << e.path().string();
    }
    EXPECT_GT(files, 5);
    EXPECT_TRUE(std::filesystem::exists(w.dir / "out" / "report.html"));
    EXPECT_TRUE(std::filesystem::exists(w.dir / "out" / "checkpoint-1" / "config.resolved.json"));
    for (const auto& secret : secrets) EXPECT_EQ(r.output.find(secret), std::string::npos) << secret;
}

}  // namespace
}  // namespace test_train_cli_local
}  // namespace dtune
