// `dtune sample`: text-to-image generation with an SDXL pipeline folder. Writes one PNG per image
// and a JSON sidecar (same name, .json) holding every setting needed to reproduce it.
#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/version.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/progress.h"
#include "io/image.h"
#include "validate/sdxl_pipeline.h"

namespace dtune::cli {
namespace {

struct SampleArgs {
    std::string model;
    std::string config_folder;  // for single-file checkpoints
    std::string prompt;
    std::optional<std::string> negative_prompt;
    int64_t width = 1024, height = 1024, steps = 30;
    double guidance = 5.0, guidance_rescale = 0.0;
    uint64_t seed = 0;
    std::string sampler = "euler";
    int batch = 1;
    std::string device = "auto", dtype = "auto";
    std::string output_dir = "samples";
    bool grid = false;
};

int64_t to_int(const std::string& key, const std::string& v) {
    try {
        std::size_t used = 0;
        const long long x = std::stoll(v, &used);
        if (used == v.size()) return x;
    } catch (const std::exception&) {
    }
    throw UsageError(str(key, " expects an integer, got '", v, "'"));
}

double to_double(const std::string& key, const std::string& v) {
    try {
        std::size_t used = 0;
        const double x = std::stod(v, &used);
        if (used == v.size()) return x;
    } catch (const std::exception&) {
    }
    throw UsageError(str(key, " expects a number, got '", v, "'"));
}

SampleArgs parse_args(const std::vector<std::string>& args) {
    SampleArgs a;
    for (std::size_t i = 0; i < args.size(); ++i) {
        std::string key = args[i], value;
        const bool is_flag = key == "--grid";
        if (key.rfind("--", 0) != 0) {
            if (!a.model.empty())
                throw UsageError(str("unexpected argument '", key, "'; see dtune sample --help"));
            a.model = key;
            continue;
        }
        if (const auto eq = key.find('='); eq != std::string::npos) {
            value = key.substr(eq + 1);
            key = key.substr(0, eq);
        } else if (!is_flag) {
            if (i + 1 >= args.size()) throw UsageError(str(key, " needs a value; see dtune sample --help"));
            value = args[++i];
        }
        if (key == "--model")
            a.model = value;
        else if (key == "--config_folder")
            a.config_folder = value;
        else if (key == "--prompt")
            a.prompt = value;
        else if (key == "--negative_prompt")
            a.negative_prompt = value;
        else if (key == "--width")
            a.width = to_int(key, value);
        else if (key == "--height")
            a.height = to_int(key, value);
        else if (key == "--steps")
            a.steps = to_int(key, value);
        else if (key == "--guidance")
            a.guidance = to_double(key, value);
        else if (key == "--guidance_rescale")
            a.guidance_rescale = to_double(key, value);
        else if (key == "--seed")
            a.seed = static_cast<uint64_t>(to_int(key, value));
        else if (key == "--sampler")
            a.sampler = value;
        else if (key == "--batch")
            a.batch = static_cast<int>(to_int(key, value));
        else if (key == "--device")
            a.device = value;
        else if (key == "--dtype")
            a.dtype = value;
        else if (key == "--output_dir")
            a.output_dir = value;
        else if (key == "--grid")
            a.grid = true;
        else
            throw UsageError(str("unknown option '", key, "' for sample; see dtune sample --help"));
    }
    if (a.model.empty())
        throw UsageError("sample needs a model: dtune sample --model <sdxl pipeline folder> ...");
    if (std::filesystem::is_regular_file(a.model) && a.config_folder.empty())
        throw UsageError(
            str(a.model, " is a single-file checkpoint: also pass --config_folder <diffusers SDXL folder> ",
                "for its configs, tokenizers and scheduler"));
    if (a.prompt.empty()) throw UsageError("sample needs --prompt \"...\"");
    // Checked again by the pipeline; here so that a typo fails before the model loads.
    if (a.width <= 0 || a.height <= 0 || a.width % 8 || a.height % 8)
        throw UsageError(
            str("--width/--height ", a.width, "x", a.height, " is invalid: use positive multiples of 8"));
    if (a.steps < 1) throw UsageError(str("--steps ", a.steps, " is invalid: use 1 or more"));
    if (a.batch < 1) throw UsageError(str("--batch ", a.batch, " is invalid: use 1 or more"));
    return a;
}

c10::Device pick_device(const std::string& name) {
    if (name == "auto") return cuda_available() ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
    const c10::Device d = parse_device(name);
    if (d.is_cuda() && !cuda_available())
        throw UsageError("--device cuda asked but no CUDA device is available; use --device cpu");
    return d;
}

nlohmann::json sidecar(const SampleArgs& a, c10::Device device, c10::ScalarType dtype, int index,
                       double seconds) {
    nlohmann::json j;
    j["model"] = a.model;
    if (!a.config_folder.empty()) j["config_folder"] = a.config_folder;
    j["prompt"] = a.prompt;
    j["negative_prompt"] = a.negative_prompt ? nlohmann::json(*a.negative_prompt) : nlohmann::json(nullptr);
    j["width"] = a.width;
    j["height"] = a.height;
    j["steps"] = a.steps;
    j["guidance"] = a.guidance;
    j["guidance_rescale"] = a.guidance_rescale;
    j["seed"] = a.seed;
    j["sampler"] = a.sampler;
    j["batch"] = a.batch;
    j["index_in_batch"] = index;
    j["device"] = device.str();
    j["dtype"] = dtype_name(dtype);
    j["seconds_per_batch"] = seconds;
    j["dtune_version"] = kVersion;
    j["dtune_commit"] = kGitCommit;
    return j;
}

int run_sample(const std::vector<std::string>& args) {
    const SampleArgs a = parse_args(args);
    const c10::Device device = pick_device(a.device);
    const c10::ScalarType dtype =
        a.dtype == "auto" ? (device.is_cuda() ? c10::kBFloat16 : c10::kFloat) : parse_dtype(a.dtype);
    log::info() << "loading " << a.model << " on " << device.str() << " in " << dtype_name(dtype);
    const validate::PipelineLoadOptions load{dtype, device};
    auto pipe = a.config_folder.empty()
                    ? validate::SDXLPipeline::load(a.model, load)
                    : validate::SDXLPipeline::load_single_file(a.model, a.config_folder, load);

    validate::GenerationRequest r;
    r.prompt = {a.prompt};
    if (a.negative_prompt) r.negative_prompt = std::vector<std::string>{*a.negative_prompt};
    r.width = a.width;
    r.height = a.height;
    r.steps = a.steps;
    r.guidance_scale = a.guidance;
    r.guidance_rescale = a.guidance_rescale;
    r.sampler = a.sampler;
    r.seed = a.seed;
    r.num_images_per_prompt = a.batch;

    ProgressOptions po;
    po.label = "sampling";
    po.unit = "step";
    Progress bar(a.steps, po);
    const auto t0 = std::chrono::steady_clock::now();
    const auto out = pipe.generate(r, [&](int64_t, int64_t) { bar.update(); });
    bar.finish();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    std::filesystem::create_directories(a.output_dir);
    const auto images = validate::to_rgb_images(out.images);
    for (std::size_t i = 0; i < images.size(); ++i) {
        const std::string stem = str("sample_", a.seed, "_", i);
        const auto png = std::filesystem::path(a.output_dir) / (stem + ".png");
        io::write_image(png, images[i]);
        fs::write_file_atomic(std::filesystem::path(a.output_dir) / (stem + ".json"),
                              sidecar(a, device, dtype, static_cast<int>(i), seconds).dump(1) + "\n");
        std::printf("%s\n", png.string().c_str());
    }
    if (a.grid && images.size() > 1) {
        const int cols = static_cast<int>(std::ceil(std::sqrt(static_cast<double>(images.size()))));
        const auto grid_path = std::filesystem::path(a.output_dir) / str("grid_", a.seed, ".png");
        io::write_image(grid_path, io::make_grid(images, cols, 4));
        std::printf("%s\n", grid_path.string().c_str());
    }
    log::info() << images.size() << " image(s) in " << seconds << " s";
    return 0;
}

}  // namespace

DTUNE_REGISTER_COMMAND(
    sample, "sample", "generate images from an SDXL model folder",
    "usage: dtune sample --model <folder | file.safetensors> --prompt TEXT [options]\n\n"
    "Generates images with an SDXL diffusers pipeline folder (model_index.json, unet/, vae/,\n"
    "text_encoder{,_2}/, tokenizer{,_2}/, scheduler/) or an SDXL single-file checkpoint, and writes\n"
    "<output_dir>/sample_<seed>_<i>.png plus sample_<seed>_<i>.json with every setting used.\n\n"
    "  --model PATH            the pipeline folder or single file (may also be the first argument)\n"
    "  --config_folder DIR     with a single file: a diffusers SDXL folder giving the configs,\n"
    "                          tokenizers and scheduler (weights come from the file)\n"
    "  --prompt TEXT           what to draw (required)\n"
    "  --negative_prompt TEXT  what to steer away from (default: none; zero embeddings)\n"
    "  --width N, --height N   image size in pixels, multiples of 8 (default 1024x1024)\n"
    "  --steps N               sampler steps (default 30)\n"
    "  --guidance X            classifier-free guidance scale; <= 1 disables CFG (default 5.0)\n"
    "  --guidance_rescale X    CFG rescale of Lin et al. 2023, 0..1 (default 0 = off)\n"
    "  --seed N                seed of the CPU generator for the initial noise (default 0);\n"
    "                          the same seed gives the same image on any device\n"
    "  --sampler NAME          euler | euler_a | ddim | dpmpp_2m | dpmpp_2m_karras | unipc\n"
    "                          (default euler), configured from scheduler/scheduler_config.json\n"
    "  --batch N               images generated together for the prompt (default 1)\n"
    "  --device cpu|cuda|auto  where to run (default auto: cuda when available)\n"
    "  --dtype fp32|bf16|fp16|auto  weights dtype (default auto: bf16 on cuda, fp32 on cpu);\n"
    "                          the VAE stays fp32 in fp16 runs when its config sets force_upcast\n"
    "  --output_dir DIR        where images go (default ./samples; created if missing)\n"
    "  --grid                  with --batch > 1, also write grid_<seed>.png of all images\n",
    run_sample);

}  // namespace dtune::cli
