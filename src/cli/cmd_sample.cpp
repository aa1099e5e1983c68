// `dtune sample`: text-to-image generation with an SDXL pipeline folder or single-file checkpoint
// (+ optional LoRA). Writes one image per sample (PNG, JPEG or WebP) and a JSON sidecar (same
// name, .json) holding every setting needed to reproduce it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/version.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/quant_preset.h"
#include "core/thread_pool.h"
#include "diffusion/scheduler_config.h"
#include "family/model_family.h"
#include "io/image.h"
#include "io/safetensors.h"
#include "models/common/quantize.h"
#include "validate/generation.h"

namespace dtune::cli {
namespace {

struct SampleArgs {
    std::string model;
    std::string config_folder;  // for single-file checkpoints; empty = built-in SDXL base configs
    std::string prompt;
    std::optional<std::string> negative_prompt;
    int64_t width = 1024, height = 1024, steps = 30;
    double guidance = 5.0, guidance_rescale = 0.0;
    bool steps_given = false, guidance_given = false;  // Flux picks its own defaults otherwise
    uint64_t seed = 0;
    std::string sampler = "euler";
    int batch = 1;
    std::string device = "auto", dtype = "auto";
    std::string output_dir = "samples";
    bool grid = false;
    bool vae_tiling = false;  // decode in overlapping 512-pixel tiles (large images, less memory)
    std::string lora;
    double lora_scale = 1.0;
    // base_model_precision and text_encoder_{1,2}_precision (core/quant_preset.h)
    std::array<std::string, 3> precision{"no_change", "no_change", "no_change"};
    std::string format = "png";
    int quality = 90;
    int threads = 0;                    // 0 = automatic (see cpu_threads)
    int64_t max_sequence_length = 512;  // Flux: T5 tokens
    double true_cfg_scale = 1.0;        // Flux: true CFG with --negative_prompt when > 1
    // Flux: components' weights from single files (configs from the Flux folder)
    std::string clip_file;  // CLIP-L (ComfyUI's clip_l.safetensors)
    std::string t5_file;    // T5 (ComfyUI's t5xxl_*)
    std::string vae_file;   // Black Forest Labs' ae.safetensors
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

std::string precision_key(size_t i) {
    return i == 0 ? "base_model_precision" : str("text_encoder_", i, "_precision");
}

using Setter = std::function<void(SampleArgs&, const std::string& key, const std::string& value)>;

// Every option that takes a value, by name.
const std::map<std::string, Setter>& value_options() {
    static const std::map<std::string, Setter> options = {
        {"--model", [](SampleArgs& a, auto&, auto& v) { a.model = v; }},
        {"--config_folder", [](SampleArgs& a, auto&, auto& v) { a.config_folder = v; }},
        {"--prompt", [](SampleArgs& a, auto&, auto& v) { a.prompt = v; }},
        {"--negative_prompt", [](SampleArgs& a, auto&, auto& v) { a.negative_prompt = v; }},
        {"--width", [](SampleArgs& a, auto& k, auto& v) { a.width = to_int(k, v); }},
        {"--height", [](SampleArgs& a, auto& k, auto& v) { a.height = to_int(k, v); }},
        {"--steps",
         [](SampleArgs& a, auto& k, auto& v) {
             a.steps = to_int(k, v);
             a.steps_given = true;
         }},
        {"--guidance",
         [](SampleArgs& a, auto& k, auto& v) {
             a.guidance = to_double(k, v);
             a.guidance_given = true;
         }},
        {"--guidance_rescale", [](SampleArgs& a, auto& k, auto& v) { a.guidance_rescale = to_double(k, v); }},
        {"--seed", [](SampleArgs& a, auto& k, auto& v) { a.seed = static_cast<uint64_t>(to_int(k, v)); }},
        {"--sampler", [](SampleArgs& a, auto&, auto& v) { a.sampler = v; }},
        {"--batch", [](SampleArgs& a, auto& k, auto& v) { a.batch = static_cast<int>(to_int(k, v)); }},
        {"--device", [](SampleArgs& a, auto&, auto& v) { a.device = v; }},
        {"--dtype", [](SampleArgs& a, auto&, auto& v) { a.dtype = v; }},
        {"--output_dir", [](SampleArgs& a, auto&, auto& v) { a.output_dir = v; }},
        {"--lora", [](SampleArgs& a, auto&, auto& v) { a.lora = v; }},
        {"--lora_scale", [](SampleArgs& a, auto& k, auto& v) { a.lora_scale = to_double(k, v); }},
        {"--base_model_precision", [](SampleArgs& a, auto&, auto& v) { a.precision[0] = v; }},
        {"--text_encoder_1_precision", [](SampleArgs& a, auto&, auto& v) { a.precision[1] = v; }},
        {"--text_encoder_2_precision", [](SampleArgs& a, auto&, auto& v) { a.precision[2] = v; }},
        {"--format", [](SampleArgs& a, auto&, auto& v) { a.format = v; }},
        {"--quality", [](SampleArgs& a, auto& k, auto& v) { a.quality = static_cast<int>(to_int(k, v)); }},
        {"--threads", [](SampleArgs& a, auto& k, auto& v) { a.threads = static_cast<int>(to_int(k, v)); }},
        {"--text_encoder_file", [](SampleArgs& a, auto&, auto& v) { a.clip_file = v; }},
        {"--text_encoder_2_file", [](SampleArgs& a, auto&, auto& v) { a.t5_file = v; }},
        {"--vae_file", [](SampleArgs& a, auto&, auto& v) { a.vae_file = v; }},
        {"--true_cfg_scale", [](SampleArgs& a, auto& k, auto& v) { a.true_cfg_scale = to_double(k, v); }},
        {"--max_sequence_length",
         [](SampleArgs& a, auto& k, auto& v) { a.max_sequence_length = to_int(k, v); }},
    };
    return options;
}

// Checked again by the pipeline; here so that a typo fails before the model loads.
void check_args(const SampleArgs& a) {
    if (a.model.empty())
        throw UsageError("sample needs a model: dtune sample --model <sdxl pipeline folder | file> ...");
    if (a.prompt.empty()) throw UsageError("sample needs --prompt \"...\"");
    if (a.width <= 0 || a.height <= 0 || a.width % 8 || a.height % 8)
        throw UsageError(
            str("--width/--height ", a.width, "x", a.height, " is invalid: use positive multiples of 8"));
    if (a.steps < 1) throw UsageError(str("--steps ", a.steps, " is invalid: use 1 or more"));
    if (a.batch < 1) throw UsageError(str("--batch ", a.batch, " is invalid: use 1 or more"));
    if (a.quality < 1 || a.quality > 100)
        throw UsageError(str("--quality ", a.quality, " is invalid: use 1..100 (100 = lossless WebP)"));
    if (a.threads < 0)
        throw UsageError(str("--threads ", a.threads, " is invalid: use 1 or more (0 = auto)"));
    if (!std::isfinite(a.lora_scale)) throw UsageError("--lora_scale must be a finite number");
    for (size_t i = 0; i < a.precision.size(); ++i)
        parse_quant_preset(a.precision[i], "--" + precision_key(i));
    diffusion::parse_sampler_kind(a.sampler);  // an unknown --sampler stops before the model loads
    // A NaN guidance would give a noise image and a sidecar with "guidance": null.
    if (!std::isfinite(a.guidance))
        throw UsageError(
            str("--guidance ", a.guidance, " is invalid: use a finite number (e.g. 5.0; <= 1 disables CFG)"));
    if (!std::isfinite(a.true_cfg_scale))
        throw UsageError(str("--true_cfg_scale ", a.true_cfg_scale,
                             " is invalid: use a finite number (e.g. 4.0 with --negative_prompt; 1 = off)"));
    if (!std::isfinite(a.guidance_rescale))
        throw UsageError(str("--guidance_rescale ", a.guidance_rescale, " is invalid: use 0..1 (0 = off)"));
    if (!a.lora.empty() && !std::filesystem::is_regular_file(a.lora))
        throw UsageError(str("--lora ", a.lora, " is not a file; pass a LoRA .safetensors file"));
    io::image_extension(a.format);  // throws UsageError for an unknown format
}

SampleArgs parse_args(const std::vector<std::string>& args) {
    SampleArgs a;
    for (std::size_t i = 0; i < args.size(); ++i) {
        std::string key = args[i], value;
        if (key.rfind("--", 0) != 0) {
            if (!a.model.empty())
                throw UsageError(str("unexpected argument '", key, "'; see dtune sample --help"));
            a.model = key;
            continue;
        }
        if (key == "--grid") {
            a.grid = true;
            continue;
        }
        if (key == "--vae_tiling") {
            a.vae_tiling = true;
            continue;
        }
        if (const auto eq = key.find('='); eq != std::string::npos) {
            value = key.substr(eq + 1);
            key = key.substr(0, eq);
        } else if (value_options().count(key)) {
            if (i + 1 >= args.size()) throw UsageError(str(key, " needs a value; see dtune sample --help"));
            value = args[++i];
        }
        const auto it = value_options().find(key);
        if (it == value_options().end())
            throw UsageError(str("unknown option '", key, "' for sample; see dtune sample --help"));
        it->second(a, key, value);
    }
    check_args(a);
    return a;
}

// Intra-op threads for CPU sampling: --threads, else OMP_NUM_THREADS when set (libtorch reads
// it itself), else the CPUs this process may run on (affinity/cpuset, not the host's count) capped
// at 16: past that the tiny-batch convolutions and GEMMs of sampling stop scaling and only add
// contention with whatever else runs on the machine.
int cpu_threads(int requested) {
    if (requested > 0) return requested;
    if (std::getenv("OMP_NUM_THREADS")) return 0;  // 0 = leave libtorch's choice
    return std::clamp(usable_cpus(), 1, 16);
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
    j["lora"] = a.lora.empty() ? nlohmann::json(nullptr) : nlohmann::json(a.lora);
    if (a.vae_tiling) j["vae_tiling"] = true;
    if (!a.lora.empty()) j["lora_scale"] = a.lora_scale;
    for (size_t i = 0; i < a.precision.size(); ++i)
        if (a.precision[i] != "no_change") j[precision_key(i)] = a.precision[i];
    if (a.true_cfg_scale != 1.0) j["true_cfg_scale"] = a.true_cfg_scale;
    for (const auto& [key, file] :
         {std::pair<const char*, const std::string*>{"text_encoder_file", &a.clip_file},
          {"text_encoder_2_file", &a.t5_file},
          {"vae_file", &a.vae_file}})
        if (!file->empty()) j[key] = *file;
    j["device"] = device.str();
    j["dtype"] = dtype_name(dtype);
    j["seconds_per_batch"] = seconds;
    j["dtune_version"] = kVersion;
    j["dtune_commit"] = kGitCommit;
    return j;
}

// Flux's options, checked before the model loads. True CFG needs both --negative_prompt and
// --true_cfg_scale > 1; either alone would be ignored (as diffusers ignores it), so it is refused.
void check_flux_args(const SampleArgs& a) {
    for (size_t i = 0; i < a.precision.size(); ++i)
        DTUNE_CHECK_AS(UsageError, a.precision[i] == "no_change", "--", precision_key(i),
                       " is not supported for Flux pipelines yet; leave it at no_change");
    DTUNE_CHECK_AS(UsageError, !a.negative_prompt || a.true_cfg_scale > 1,
                   "--negative_prompt on Flux takes effect through true classifier-free guidance: add "
                   "--true_cfg_scale > 1 (e.g. 4.0; each step then runs the transformer twice)");
    DTUNE_CHECK_AS(UsageError, a.true_cfg_scale <= 1 || a.negative_prompt, "--true_cfg_scale ",
                   a.true_cfg_scale,
                   " needs --negative_prompt (\"\" for an empty one), as in diffusers' "
                   "FluxPipeline; [dev]'s --guidance is the embedded guidance, not CFG");
    for (const auto& [option, file, what] :
         {std::tuple<const char*, const std::string*, const char*>{"--text_encoder_file", &a.clip_file,
                                                                   "a CLIP-L .safetensors (clip_l)"},
          {"--text_encoder_2_file", &a.t5_file, "a T5 .safetensors (t5xxl_fp16)"},
          {"--vae_file", &a.vae_file, "a Flux VAE .safetensors (ae.safetensors)"}})
        DTUNE_CHECK_AS(UsageError, file->empty() || std::filesystem::is_regular_file(*file), option, " ",
                       *file, " is not a file; pass ", what);
}

// The options that only Flux reads, refused for SDXL rather than ignored.
void check_sdxl_args(const SampleArgs& a) {
    for (const auto& [option, given] : {std::pair{"--text_encoder_file", !a.clip_file.empty()},
                                        std::pair{"--text_encoder_2_file", !a.t5_file.empty()},
                                        std::pair{"--vae_file", !a.vae_file.empty()},
                                        std::pair{"--true_cfg_scale", a.true_cfg_scale != 1.0}})
        DTUNE_CHECK_AS(UsageError, !given, option, " is for Flux pipelines; ", a.model,
                       " is an SDXL model: drop it (SDXL's classifier-free guidance scale is --guidance)");
}

validate::GenerationRequest request_from(const SampleArgs& a) {
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
    r.vae_tiling = a.vae_tiling;
    r.true_cfg_scale = a.true_cfg_scale;
    r.max_sequence_length = a.max_sequence_length;
    r.free_text_encoders = true;  // one generate: Flux's T5-XXL (~9.5 GiB) goes before the transformer runs
    return r;
}

// NaN or infinite latents or pixels would be written as a black (or noise) image with exit code 0.
// The weights were checked at load time, so such an output comes from finite weights that overflow
// at this precision (e.g. an fp16 VAE without force_upcast) or from extreme settings.
void check_finite_output(const SampleArgs& a, const validate::GenerationResult& out, c10::ScalarType dtype) {
    for (const auto& [what, t] :
         {std::pair<const char*, const at::Tensor*>{"the denoised latents", &out.latents},
          {"the decoded image", &out.images}})
        if (t->defined() && !at::isfinite(*t).all().item<bool>())
            throw DataError(str(what, " from ", a.model, a.lora.empty() ? "" : " with LoRA " + a.lora,
                                " hold NaN or infinite values, so no image was written to ", a.output_dir,
                                "; the weights are finite but overflow in ", dtype_name(dtype),
                                ": try --dtype fp32 (or bf16), a lower --guidance or --lora_scale, or "
                                "another VAE"));
}

int run_sample(const std::vector<std::string>& args) {
    SampleArgs a = parse_args(args);
    // Before the model loads and the images are sampled, not when the first image is written.
    fs::require_writable_dir(a.output_dir, "--output_dir");
    const c10::Device device = pick_device(a.device);
    const c10::ScalarType dtype =
        a.dtype == "auto" ? (device.is_cuda() ? c10::kBFloat16 : c10::kFloat) : parse_dtype(a.dtype);
    if (const int threads = device.is_cpu() ? cpu_threads(a.threads) : a.threads; threads > 0) {
        at::set_num_threads(threads);
        log::info() << "using " << threads << " CPU threads";
    }
    ProgressOptions po;
    po.label = "sampling";
    po.unit = "step";
    // The family by what --model is (a folder's model_index.json; a single file's key layout).
    const family::ModelFamily& fam = family::family_of_model(a.model);
    const bool flux = std::string(fam.name()) == "flux";
    if (flux && std::filesystem::is_regular_file(a.model))
        DTUNE_CHECK_AS(
            UsageError, family::family_of_model_folder(a.config_folder) == &fam, a.model,
            " is a Flux transformer single file: pass --config_folder with a diffusers Flux folder "
            "(FLUX.1-dev or -schnell) for the text encoders, tokenizers, VAE and scheduler");
    if (flux)
        check_flux_args(a);
    else
        check_sdxl_args(a);
    family::PipelineSource src;
    src.model = a.model;
    src.config_folder = a.config_folder;
    src.text_encoder_file = a.clip_file;
    src.text_encoder_2_file = a.t5_file;
    src.vae_file = a.vae_file;
    src.precision = a.precision;
    src.lora = a.lora;
    src.lora_scale = a.lora_scale;
    src.device = device;
    src.dtype = dtype;
    log::info() << "loading " << a.model << " (" << fam.name() << ") on " << device.str() << " in "
                << dtype_name(dtype);
    const auto pipe = fam.open_pipeline(src);
    // The family's defaults where the user gave none (Flux [dev] 28 steps at 3.5, [schnell] 4).
    if (flux && !a.steps_given) a.steps = pipe->defaults().steps;
    if (flux && !a.guidance_given) a.guidance = pipe->defaults().guidance;
    Progress bar(a.steps, po);
    const auto t0 = std::chrono::steady_clock::now();
    const validate::GenerationResult result =
        pipe->generate(request_from(a), [&](int64_t, int64_t) { bar.update(); });
    bar.finish();
    const validate::GenerationResult& out = result;
    check_finite_output(a, out, dtype);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    std::filesystem::create_directories(a.output_dir);
    const std::string ext = io::image_extension(a.format);
    const auto images = validate::to_rgb_images(out.images);
    for (std::size_t i = 0; i < images.size(); ++i) {
        const std::string stem = str("sample_", a.seed, "_", i);
        const auto path = std::filesystem::path(a.output_dir) / (stem + ext);
        io::write_image(path, images[i], a.quality);
        fs::write_file_atomic(std::filesystem::path(a.output_dir) / (stem + ".json"),
                              sidecar(a, device, dtype, static_cast<int>(i), seconds).dump(1) + "\n");
        std::printf("%s\n", path.string().c_str());
    }
    if (a.grid && images.size() > 1) {
        const int cols = static_cast<int>(std::ceil(std::sqrt(static_cast<double>(images.size()))));
        const auto grid_path = std::filesystem::path(a.output_dir) / str("grid_", a.seed, ext);
        io::write_image(grid_path, io::make_grid(images, cols, 4), a.quality);
        std::printf("%s\n", grid_path.string().c_str());
    }
    log::info() << images.size() << " image(s) in " << seconds << " s";
    return 0;
}

}  // namespace

DTUNE_REGISTER_COMMAND(
    sample, "sample", "generate images from an SDXL or Flux.1 model folder, or an SDXL single file",
    "usage: dtune sample --model <folder | file.safetensors> --prompt TEXT [options]\n\n"
    "Generates images with an SDXL diffusers pipeline folder (model_index.json, unet/, vae/,\n"
    "text_encoder{,_2}/, tokenizer{,_2}/, scheduler/) or an SDXL single-file checkpoint (the\n"
    ".safetensors that ComfyUI/A1111 use), and writes <output_dir>/sample_<seed>_<i>.<format>\n"
    "plus sample_<seed>_<i>.json with every setting used. A Flux.1 [dev]/[schnell] diffusers folder\n"
    "(model_index.json naming FluxPipeline) samples with flow matching; --guidance is then [dev]'s\n"
    "embedded guidance (the transformer takes it as an input; 3.5 is usual), not CFG: true CFG is\n"
    "--negative_prompt with --true_cfg_scale > 1. --lora takes a Flux LoRA in diffusers/PEFT,\n"
    "kohya/ComfyUI (lora_unet_double_blocks_...) or Black Forest Labs' (double_blocks....lora_A)\n"
    "layout. A Flux transformer single file (flux1-dev.safetensors, ComfyUI's, fp8 ones) takes\n"
    "--config_folder with a diffusers Flux folder for the other components and the configs;\n"
    "--text_encoder_file, --text_encoder_2_file and --vae_file replace components' weights. The\n"
    "precision options are not supported for Flux yet.\n\n"
    "  --model PATH            the pipeline folder or single file (may also be the first argument)\n"
    "  --config_folder DIR     with a single file: a diffusers folder giving the configs,\n"
    "                          tokenizers and scheduler (weights come from the file); default:\n"
    "                          dtune's built-in SDXL base 1.0 configs and CLIP tokenizers\n"
    "  --prompt TEXT           what to draw (required)\n"
    "  --negative_prompt TEXT  what to steer away from (default: none; zero embeddings). Flux:\n"
    "                          only with --true_cfg_scale > 1\n"
    "  --width N, --height N   image size in pixels, multiples of 8 (default 1024x1024)\n"
    "  --steps N               sampler steps (default 30)\n"
    "  --guidance X            classifier-free guidance scale; <= 1 disables CFG (default 5.0).\n"
    "                          Flux: [dev]'s embedded guidance (default 3.5), one pass per step\n"
    "  --true_cfg_scale X      Flux: true classifier-free guidance as diffusers' FluxPipeline, with\n"
    "                          --negative_prompt: two transformer passes per step, neg + X·(pos − neg)\n"
    "                          (default 1.0 = off; > 1 needs --negative_prompt, \"\" for an empty one)\n"
    "  --guidance_rescale X    CFG rescale of Lin et al. 2023, 0..1 (default 0 = off)\n"
    "  --seed N                seed of the CPU generator for the initial noise (default 0);\n"
    "                          the same seed gives the same image on any device\n"
    "  --sampler NAME          euler | euler_a | ddim | dpmpp_2m | dpmpp_2m_karras | unipc\n"
    "                          (default euler), configured from the scheduler config\n"
    "  --batch N               images generated together for the prompt (default 1)\n"
    "  --lora FILE             a UNet LoRA .safetensors (diffusers, PEFT or kohya/ComfyUI keys), or\n"
    "                          a Flux transformer LoRA (diffusers/PEFT, kohya/ComfyUI or Black Forest\n"
    "                          Labs' keys; fused q/k/v LoRAs are split); text-encoder parts of the\n"
    "                          file are skipped with a warning\n"
    "  --lora_scale X          LoRA strength (default 1.0; 0 = the base model's output)\n"
    "  --base_model_precision P  quantise the UNet after loading: int8-quanto, int8-torchao (int8\n"
    "                          weights), fp8-quanto, fp8-torchao (fp8 e4m3; fp8 matmuls on Hopper);\n"
    "                          half the weights' memory; default no_change\n"
    "  --text_encoder_1_precision P, --text_encoder_2_precision P  the same for the CLIP encoders\n"
    "  --device cpu|cuda|auto  where to run (default auto: cuda when available)\n"
    "  --dtype fp32|bf16|fp16|auto  weights dtype (default auto: bf16 on cuda, fp32 on cpu);\n"
    "                          the VAE stays fp32 in fp16 runs when its config sets force_upcast\n"
    "  --vae_tiling            decode the image in overlapping 512-pixel tiles: less memory for\n"
    "                          large images (seams are blended; small differences at tile edges)\n"
    "  --text_encoder_file F   Flux: CLIP-L from one .safetensors file (ComfyUI's clip_l.safetensors:\n"
    "                          transformers' keys, bare or under text_model. / transformer. /\n"
    "                          text_encoders.clip_l.transformer.), its config from the Flux folder\n"
    "  --text_encoder_2_file F Flux: T5 from one .safetensors file (ComfyUI's t5xxl_fp16 or\n"
    "                          t5xxl_fp8_e4m3fn), its config from the Flux folder\n"
    "  --vae_file F            Flux: the VAE from one .safetensors file (Black Forest Labs'\n"
    "                          ae.safetensors, ldm layout), its config from the Flux folder\n"
    "  --max_sequence_length N Flux: T5 prompt tokens (default 512; [schnell] takes at most 256)\n"
    "  --threads N             CPU intra-op threads (default: OMP_NUM_THREADS if set, else the\n"
    "                          CPUs this process may use, at most 16)\n"
    "  --format png|jpeg|webp  image format (default png)\n"
    "  --quality N             JPEG/WebP quality 1..100 (default 90; WebP 100 = lossless)\n"
    "  --output_dir DIR        where images go (default ./samples; created if missing)\n"
    "  --grid                  with --batch > 1, also write grid_<seed>.<format> of all images\n",
    run_sample);

}  // namespace dtune::cli
