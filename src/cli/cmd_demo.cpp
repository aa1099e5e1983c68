// `dtune demo`: the README's first command. With no arguments it writes a synthetic shapes dataset
// and a built-in tiny SDXL-shaped model, then runs the whole pipeline on the CPU in-process — a
// training run in two halves (checkpoint, then resume), validation images, eval loss, TensorBoard
// logs, the exported pipeline and report.html — and prints where everything is.
// `--model_family flux` does the same with a tiny Flux.1 [dev]-shaped model and a LoRA trained
// with flow matching.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>

#include "cli/command.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "demo/demo_data.h"
#include "demo/demo_model.h"
#include "io/image_tensor.h"
#include "report/html_report.h"
#include "report/observers.h"
#include "train/config.h"
#include "train/signals.h"
#include "train/trainer.h"

namespace dtune::cli {
namespace {

constexpr int kImageSize = 64;
constexpr int kTrainImages = 36;
constexpr int kEvalImages = 4;

struct DemoArgs {
    std::string model_family = "sdxl";
    std::optional<int64_t> steps;  // unset: the family's default (kSdxlSteps, kFluxSteps)
    std::filesystem::path output_dir = "dtune-demo";
    std::string model_type;  // empty: the family's default (sdxl full, flux lora)
    int vae_fit_steps = 60;
    bool flux() const { return model_family == "flux"; }
};
// Both keep the run within about a minute on a 2-core machine: a Flux step attends over T5's 512
// text tokens and the image's, and costs about twice an SDXL demo step.
constexpr int64_t kSdxlSteps = 240;
constexpr int64_t kFluxSteps = 200;

DemoArgs parse_demo_args(const std::vector<std::string>& args) {
    DemoArgs a;
    for (size_t i = 0; i < args.size(); ++i) {
        const std::string& key = args[i];
        DTUNE_CHECK_AS(UsageError, i + 1 < args.size(), "option ", key,
                       " needs a value; see dtune demo --help");
        const std::string& value = args[++i];
        try {
            if (key == "--steps")
                a.steps = std::stoll(value);
            else if (key == "--model_family")
                a.model_family = value;
            else if (key == "--output_dir")
                a.output_dir = value;
            else if (key == "--model_type")
                a.model_type = value;
            else if (key == "--vae_fit_steps")
                a.vae_fit_steps = std::stoi(value);
            else
                throw UsageError(str("unknown option '", key, "' for demo; see dtune demo --help"));
        } catch (const std::logic_error&) {
            throw UsageError(str("option ", key, " needs a number, got '", value, "'"));
        }
    }
    DTUNE_CHECK_AS(UsageError, a.model_family == "sdxl" || a.model_family == "flux", "--model_family ",
                   a.model_family, " is not sdxl or flux");
    if (!a.steps) a.steps = a.flux() ? kFluxSteps : kSdxlSteps;
    if (a.model_type.empty()) a.model_type = a.flux() ? "lora" : "full";
    DTUNE_CHECK_AS(UsageError, *a.steps >= 2, "--steps ", *a.steps, " is too small; use 2 or more");
    DTUNE_CHECK_AS(UsageError, a.model_type == "full" || a.model_type == "lora", "--model_type ",
                   a.model_type, " is not full or lora");
    return a;
}

at::Tensor load_images(const std::filesystem::path& dir, int count) {
    std::vector<at::Tensor> images;
    for (int i = 0; i < count; ++i)
        images.push_back(io::to_tensor(io::read_image(dir / str("shape_", i, ".png"))));
    return at::stack(images);  // [N, 3, H, W] in [-1, 1]
}

// config.json and multidatabackend.json for the run (kept so `dtune train --config` reruns it).
std::filesystem::path write_configs(const DemoArgs& a, const std::filesystem::path& root) {
    const auto cfg = root / "config";
    std::filesystem::create_directories(cfg);
    const nlohmann::json backends =
        nlohmann::json::array({{{"id", "shapes"},
                                {"type", "local"},
                                {"instance_data_dir", (root / "data" / "train").string()},
                                {"caption_strategy", "textfile"},
                                {"resolution", kImageSize},
                                {"resolution_type", "pixel"}},
                               {{"id", "shapes-eval"},
                                {"type", "local"},
                                {"dataset_type", "eval"},
                                {"instance_data_dir", (root / "data" / "eval").string()},
                                {"caption_strategy", "textfile"},
                                {"resolution", kImageSize},
                                {"resolution_type", "pixel"}},
                               {{"id", "text-embeds"},
                                {"type", "local"},
                                {"dataset_type", "text_embeds"},
                                {"default", true},
                                {"cache_dir", (root / "cache" / "text").string()}}});
    fs::write_file_atomic(cfg / "multidatabackend.json", backends.dump(2) + "\n");
    fs::write_file_atomic(cfg / "prompts.json",
                          nlohmann::json{{"green_square", "a green square on a black background"},
                                         {"yellow_triangle", "a yellow triangle on a blue background"}}
                                  .dump(2) +
                              "\n");
    const int64_t steps = *a.steps, quarter = std::max<int64_t>(1, steps / 4);
    nlohmann::json config{{"model_family", a.model_family},
                          {"model_type", a.model_type},
                          {"pretrained_model_name_or_path", (root / "model").string()},
                          {"pretrained_vae_model_name_or_path", (root / "model" / "vae").string()},
                          {"output_dir", (root / "run").string()},
                          {"data_backend_config", (cfg / "multidatabackend.json").string()},
                          {"resolution", kImageSize},
                          {"resolution_type", "pixel"},
                          {"train_batch_size", 4},
                          {"optimizer", "torch-adamw"},
                          {"learning_rate", a.model_type == "lora" ? 1e-3 : 4e-4},
                          {"lr_scheduler", "constant"},
                          {"mixed_precision", "no"},
                          {"gradient_checkpointing", false},
                          {"caption_dropout_probability", 0.1},
                          {"seed", 42},
                          {"device", "cpu"},
                          {"max_train_steps", steps},
                          {"checkpoint_step_interval", std::max<int64_t>(1, steps / 2)},
                          {"report_to", "tensorboard"},
                          {"validation_prompt", "a red circle on a blue background"},
                          {"user_prompt_library", (cfg / "prompts.json").string()},
                          {"validation_negative_prompt", ""},
                          {"validation_step_interval", quarter},
                          {"validation_resolution", str(kImageSize, "x", kImageSize)},
                          {"validation_num_inference_steps", 12},
                          {"validation_seed", 42},
                          {"eval_steps_interval", quarter},
                          {"num_eval_images", kEvalImages},
                          {"eval_timesteps", 8}};
    // Flux [dev]'s guidance is an input of the network: the LoRA trains at 1.0 (SimpleTuner's
    // flux_guidance_value) and this tiny model has never seen another value. SDXL: CFG.
    config["validation_guidance"] = a.flux() ? 1.0 : 3.0;
    fs::write_file_atomic(cfg / "config.json", config.dump(2) + "\n");
    return cfg / "config.json";
}

train::TrainResult train_until(const std::filesystem::path& config_file, int64_t steps) {
    auto config = train::TrainConfig::load(config_file, {"--max_train_steps", std::to_string(steps)});
    train::Trainer trainer(std::move(config));
    report::add_observers(trainer);
    return trainer.run();
}

// How to generate with what the run exported: a full fine-tune's diffusers pipeline folder (written
// by the trainer), or the base model plus the LoRA file. Flux at the guidance it was validated with.
std::string sample_command(const std::filesystem::path& root, const DemoArgs& a) {
    const auto run = root / "run";
    const std::string model =
        a.model_type == "lora"
            ? str((root / "model").string(), " --lora ", (run / "pytorch_lora_weights.safetensors").string())
            : (run / "pipeline").string();
    return str("dtune sample --model ", model,
               " --prompt \"a red circle on a blue background\" --width 64 --height 64",
               a.flux() ? " --guidance 1.0" : "");
}

std::pair<double, double> loss_trend(const std::filesystem::path& metrics) {
    const auto rows = report::read_jsonl(metrics);
    const size_t k = std::max<size_t>(1, rows.size() / 10);
    double first = 0, last = 0;
    for (size_t i = 0; i < k && i < rows.size(); ++i) first += rows[i].at("loss").get<double>();
    for (size_t i = rows.size() - std::min(k, rows.size()); i < rows.size(); ++i)
        last += rows[i].at("loss").get<double>();
    return {first / static_cast<double>(k), last / static_cast<double>(k)};
}

int run_demo(const std::vector<std::string>& args) {
    const DemoArgs a = parse_demo_args(args);
    const auto t0 = std::chrono::steady_clock::now();
    const auto root = std::filesystem::absolute(a.output_dir);
    DTUNE_CHECK_AS(UsageError, !std::filesystem::exists(root / "run"), root.string(),
                   " already holds a demo run; pass --output_dir <new folder> or delete it");
    log::info() << "demo: writing " << kTrainImages << " + " << kEvalImages << " synthetic images";
    demo::write_demo_dataset(root / "data" / "train", kTrainImages, kImageSize);
    // Eval images: the samples after the training ones (unseen combinations).
    std::filesystem::create_directories(root / "data" / "eval");
    for (int i = 0; i < kEvalImages; ++i) {
        const auto s = demo::demo_sample(kTrainImages + i);
        io::write_image(root / "data" / "eval" / str("shape_", i, ".png"), demo::draw_sample(s, kImageSize));
        std::ofstream(root / "data" / "eval" / str("shape_", i, ".txt")) << s.caption() << "\n";
    }
    log::info() << "demo: building the tiny " << (a.flux() ? "Flux.1" : "SDXL")
                << "-shaped model (fitting its autoencoder to the shapes)";
    demo::DemoModelOptions mo;
    mo.seed = 42;
    mo.vae_fit_images = load_images(root / "data" / "train", kTrainImages);
    mo.vae_fit_steps = a.vae_fit_steps;
    const std::string model_summary =
        a.flux() ? demo::write_demo_flux_model(root / "model", demo::demo_vocabulary(), mo)
                 : demo::write_demo_model(root / "model", demo::demo_vocabulary(), mo);
    log::info() << "demo: model: " << model_summary;
    const auto config_file = write_configs(a, root);

    train::install_stop_signal_handlers();
    const int64_t steps = *a.steps, half = steps / 2;
    log::info() << "demo: training steps 1-" << half << ", then stopping (checkpoint-" << half << ")";
    if (train_until(config_file, half).outcome == train::TrainOutcome::kInterrupted)
        return static_cast<int>(ExitCode::kInterrupted);
    log::info() << "demo: resuming from checkpoint-" << half << " to step " << steps;
    const auto result = train_until(config_file, steps);
    if (result.outcome == train::TrainOutcome::kInterrupted) return static_cast<int>(ExitCode::kInterrupted);
    const std::string sample = sample_command(root, a);

    const auto run = root / "run";
    const auto [first, last] = loss_trend(run / "metrics.jsonl");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf(
        "\ndtune demo finished in %.0f s: %lld steps (resumed at %lld), loss %.4f -> %.4f (mean of first / "
        "last "
        "10%% of steps)\n\n"
        "  dataset          %s\n"
        "  model            %s\n"
        "  config           %s\n"
        "  checkpoints      %s/checkpoint-*\n"
        "  validation       %s/validation_images/\n"
        "  metrics          %s/metrics.jsonl, eval loss in %s/eval.jsonl\n"
        "  TensorBoard      tensorboard --logdir %s/logs\n"
        "  generate with    %s\n"
        "  report           %s/report.html  <- open this in a browser\n",
        seconds, static_cast<long long>(result.global_step), static_cast<long long>(half), first, last,
        (root / "data").c_str(), (root / "model").c_str(), config_file.c_str(), run.c_str(), run.c_str(),
        run.c_str(), run.c_str(), run.c_str(), sample.c_str(), run.c_str());
    return 0;
}

}  // namespace

DTUNE_REGISTER_COMMAND(
    demo, "demo", "train a tiny model on synthetic shapes on the CPU and write a report (start here)",
    "usage: dtune demo [--model_family sdxl|flux] [--steps N] [--output_dir DIR] [--model_type full|lora]\n\n"
    "Writes a synthetic dataset of coloured shapes (\"a red circle on a blue background\") and a\n"
    "built-in tiny SDXL-shaped model (random weights; its autoencoder is first fitted to the shapes),\n"
    "then trains it on the CPU the way `dtune train` does: half the steps, a checkpoint, a resume for\n"
    "the rest, validation images, eval loss, TensorBoard logs, the exported pipeline and report.html.\n"
    "About a minute on 2 cores; prints where everything is at the end.\n\n"
    "  --model_family F     sdxl (default) or flux: a tiny Flux.1 [dev]-shaped model (transformer, "
    "16-channel\n"
    "                       VAE, CLIP + T5 text encoders) whose LoRA trains with flow matching\n"
    "  --steps N            training steps (default 240 for sdxl, 200 for flux)\n"
    "  --output_dir DIR     where everything goes (default ./dtune-demo; must not hold a run)\n"
    "  --model_type TYPE    full or lora (default full for sdxl, lora for flux)\n"
    "  --vae_fit_steps N    autoencoder fitting steps before training (default 60; 0 = random VAE)\n",
    run_demo);

}  // namespace dtune::cli
