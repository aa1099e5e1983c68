// make_random_pipeline: writes a diffusers SDXL pipeline folder with random weights, built from the
// component configs in a folder such as ../shared/fixtures/sdxl-base-configs, so full-size training
// and sampling runs (`dtune train`, `dtune sample`) can be exercised without downloading a model.
// The step time of a run does not depend on the weights' values.
//
//   make_random_pipeline --configs <dir> --tokenizers <dir> --out <dir> [--dtype bf16] [--seed 0]
//
// <configs> holds {unet,vae,text_encoder,text_encoder_2}/config.json and scheduler/; <tokenizers>
// holds tokenizer/ and tokenizer_2/ (and model_index.json, copied when present). Prints one JSON line.
#include <ATen/ATen.h>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <iostream>
#include <string>

#include "core/dtype.h"
#include "core/error.h"
#include "core/fs.h"
#include "io/safetensors.h"
#include "models/clip/clip_text_model.h"
#include "models/common/weights.h"
#include "models/unet/unet_2d_condition.h"
#include "models/vae/autoencoder_kl.h"

namespace {

namespace stdfs = std::filesystem;

struct Args {
    stdfs::path configs, tokenizers, out;
    std::string dtype = "bf16";
    uint64_t seed = 0;
};

Args parse(int argc, char** argv) {
    Args a;
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string k = argv[i], v = argv[i + 1];
        if (k == "--configs")
            a.configs = v;
        else if (k == "--tokenizers")
            a.tokenizers = v;
        else if (k == "--out")
            a.out = v;
        else if (k == "--dtype")
            a.dtype = v;
        else if (k == "--seed")
            a.seed = std::stoull(v);
        else
            throw dtune::UsageError("make_random_pipeline: unknown option " + k);
    }
    if (a.configs.empty() || a.tokenizers.empty() || a.out.empty())
        throw dtune::UsageError(
            "usage: make_random_pipeline --configs <dir> --tokenizers <dir> --out <dir> [--dtype bf16] "
            "[--seed 0]");
    return a;
}

// Casts every tensor of `module` to dtype and writes `<dir>/<file>` plus the component's config.
void write_component(const torch::nn::Module& module, const stdfs::path& config_dir, const stdfs::path& dir,
                     const std::string& file, c10::ScalarType dtype) {
    stdfs::create_directories(dir);
    dtune::io::TensorList tensors = dtune::models::state_dict(module);
    for (auto& [name, t] : tensors) t = t.to(dtype).contiguous();
    dtune::io::save_safetensors(dir / file, tensors);
    stdfs::copy_file(config_dir / "config.json", dir / "config.json",
                     stdfs::copy_options::overwrite_existing);
}

void copy_tree(const stdfs::path& from, const stdfs::path& to) {
    stdfs::create_directories(to);
    stdfs::copy(from, to, stdfs::copy_options::recursive | stdfs::copy_options::overwrite_existing);
}

}  // namespace

int main(int argc, char** argv) try {
    using namespace dtune::models;
    const Args a = parse(argc, argv);
    const auto dtype = dtune::parse_dtype(a.dtype);
    const auto t0 = std::chrono::steady_clock::now();
    torch::manual_seed(a.seed);
    at::NoGradGuard no_grad;
    {
        UNet2DConditionModel unet(
            UNet2DConditionConfig::from_json(ConfigReader::from_file(a.configs / "unet" / "config.json")));
        write_component(*unet, a.configs / "unet", a.out / "unet", "diffusion_pytorch_model.safetensors",
                        dtype);
    }
    {
        AutoencoderKL vae(
            AutoencoderKLConfig::from_json(ConfigReader::from_file(a.configs / "vae" / "config.json")));
        write_component(*vae, a.configs / "vae", a.out / "vae", "diffusion_pytorch_model.safetensors", dtype);
    }
    {
        CLIPTextModel te(CLIPTextConfig::from_json_file(a.configs / "text_encoder" / "config.json"));
        write_component(*te, a.configs / "text_encoder", a.out / "text_encoder", "model.safetensors", dtype);
        CLIPTextModelWithProjection te2(
            CLIPTextConfig::from_json_file(a.configs / "text_encoder_2" / "config.json"));
        write_component(*te2, a.configs / "text_encoder_2", a.out / "text_encoder_2", "model.safetensors",
                        dtype);
    }
    copy_tree(a.configs / "scheduler", a.out / "scheduler");
    copy_tree(a.tokenizers / "tokenizer", a.out / "tokenizer");
    copy_tree(a.tokenizers / "tokenizer_2", a.out / "tokenizer_2");
    if (stdfs::exists(a.tokenizers / "model_index.json"))
        stdfs::copy_file(a.tokenizers / "model_index.json", a.out / "model_index.json",
                         stdfs::copy_options::overwrite_existing);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::cout << R"({"tool": "make_random_pipeline", "out": ")" << a.out.string() << R"(", "dtype": ")"
              << a.dtype << R"(", "seconds": )" << secs << "}" << std::endl;
    return 0;
} catch (const std::exception& e) {
    std::cerr << "make_random_pipeline: " << e.what() << std::endl;
    return 1;
}
