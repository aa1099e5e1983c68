// bench_sample: one text-to-image generation with a full-size SDXL built from configs with random
// weights (no checkpoint needed), printed as JSON: seconds per image (warm), UNet steps per second
// and peak accelerator memory. Usage:
//   bench_sample [--configs DIR] [--tokenizers DIR] [--res 1024] [--steps 30] [--sampler euler]
//                [--dtype bf16] [--device cuda|cpu] [--warmup_steps 2]
// DIR defaults: ../shared/fixtures/sdxl-base-configs (unet/, vae/, text_encoder{,_2}/, scheduler/
// config files) and ../shared/fixtures/tiny-sdxl (tokenizer/, tokenizer_2/). With --device cuda
// (the default) and no CUDA device it prints {"skipped": ...} and exits 0; it compiles without
// CUDA (the device-generic at::accelerator API gives synchronisation and memory statistics).
// `--configs <tiny-sdxl> --device cpu --res 64 --steps 2 --dtype fp32` is a CPU smoke run.
#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <torch/torch.h>

#include <chrono>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/fs.h"
#include "validate/sdxl_pipeline.h"

namespace {

struct Args {
    std::string configs = "../shared/fixtures/sdxl-base-configs";
    std::string tokenizers = "../shared/fixtures/tiny-sdxl";
    int64_t res = 1024, steps = 30, warmup_steps = 2;
    std::string sampler = "euler", dtype = "bf16", device = "cuda";
};

Args parse(int argc, char** argv) {
    Args a;
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string k = argv[i], v = argv[i + 1];
        if (k == "--configs")
            a.configs = v;
        else if (k == "--tokenizers")
            a.tokenizers = v;
        else if (k == "--res")
            a.res = std::stoll(v);
        else if (k == "--steps")
            a.steps = std::stoll(v);
        else if (k == "--warmup_steps")
            a.warmup_steps = std::stoll(v);
        else if (k == "--sampler")
            a.sampler = v;
        else if (k == "--dtype")
            a.dtype = v;
        else if (k == "--device")
            a.device = v;
        else
            throw std::runtime_error("unknown option " + k +
                                     "; see the comment at the top of bench_sample.cpp");
    }
    return a;
}

void sync(const c10::Device& d) {
    if (d.is_cuda()) at::accelerator::synchronizeDevice(0);
}

// Random-weight pipeline: every module built from its config.json, cast to dtype on device (the
// VAE kept fp32 for fp16 when force_upcast is set, as load_autoencoder_kl does).
dtune::validate::SDXLPipeline build(const Args& a, c10::ScalarType dtype, c10::Device dev) {
    using namespace dtune::models;
    namespace fs = std::filesystem;
    const fs::path c = a.configs, t = a.tokenizers;
    SDXLTextEncoders te{
        CLIPTokenizer::from_folder(t / "tokenizer"), CLIPTokenizer::from_folder(t / "tokenizer_2"),
        CLIPTextModel(CLIPTextConfig::from_json_file(c / "text_encoder" / "config.json")),
        CLIPTextModelWithProjection(CLIPTextConfig::from_json_file(c / "text_encoder_2" / "config.json")),
        true};
    te.text_encoder->to(dev, dtype);
    te.text_encoder_2->to(dev, dtype);
    UNet2DConditionModel unet(
        UNet2DConditionConfig::from_json(ConfigReader::from_file(c / "unet" / "config.json")));
    unet->to(dev, dtype);
    AutoencoderKL vae(AutoencoderKLConfig::from_json(ConfigReader::from_file(c / "vae" / "config.json")));
    vae->to(dev, dtype == c10::kHalf && vae->config().force_upcast ? c10::kFloat : dtype);
    auto sched = nlohmann::json::parse(dtune::fs::read_file(c / "scheduler" / "scheduler_config.json"));
    return dtune::validate::SDXLPipeline(std::move(te), std::move(unet), std::move(vae), std::move(sched),
                                         dev);
}

}  // namespace

int main(int argc, char** argv) {
    using namespace dtune;
    const Args a = parse(argc, argv);
    if (a.device.rfind("cuda", 0) == 0 && !at::hasCUDA()) {
        std::cout << R"({"bench": "sample", "skipped": "no CUDA device"})" << std::endl;
        return 0;
    }
    const c10::Device dev = parse_device(a.device);
    const auto dtype = parse_dtype(a.dtype);
    auto pipe = build(a, dtype, dev);
    validate::GenerationRequest r;
    r.prompt = {"a photograph of an astronaut riding a horse"};
    r.negative_prompt = std::vector<std::string>{"blurry, low quality"};
    r.width = r.height = a.res;
    r.guidance_scale = 5.0;
    r.sampler = a.sampler;
    r.steps = a.warmup_steps;  // warm-up: kernels, allocator, cuDNN autotuning
    pipe.generate(r);
    sync(dev);
    if (dev.is_cuda()) at::accelerator::resetPeakStats(0);

    r.steps = a.steps;
    std::chrono::steady_clock::time_point t_first, t_last;
    const auto t0 = std::chrono::steady_clock::now();
    pipe.generate(r, [&](int64_t done, int64_t) {
        sync(dev);
        (done == 1 ? t_first : t_last) = std::chrono::steady_clock::now();
    });
    sync(dev);
    const auto t1 = std::chrono::steady_clock::now();
    using secs = std::chrono::duration<double>;
    const double total = secs(t1 - t0).count();
    // Steps 2..n only: step 1 also holds the prompt encoding.
    const double steps_per_s = a.steps > 1 ? (a.steps - 1) / secs(t_last - t_first).count() : 0.0;
    double peak_gib = 0;
    if (dev.is_cuda())
        peak_gib =
            static_cast<double>(at::accelerator::getDeviceStats(0).allocated_bytes[0].peak) / (1 << 30);
    nlohmann::json j{{"bench", "sample"},
                     {"res", a.res},
                     {"steps", a.steps},
                     {"sampler", a.sampler},
                     {"dtype", a.dtype},
                     {"device", dev.str()},
                     {"cfg", true},
                     {"seconds_per_image", total},
                     {"unet_steps_per_s", steps_per_s},
                     {"peak_allocated_gib", peak_gib}};
    std::cout << j.dump() << std::endl;
    return 0;
}
