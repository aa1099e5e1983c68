// bench_unet_step: one SDXL-sized training step of the UNet (forward + backward) with random
// weights, printed as JSON. Usage:
//   bench_unet_step <unet/config.json> [--res 1024] [--batch 1] [--steps 10] [--warmup 3]
//                   [--dtype bf16] [--checkpointing] [--channels-last] [--count-only]
// --count-only builds the model on the CPU and prints its parameter count (no CUDA needed).
// Needs CUDA at run time (exits 0 with {"skipped": ...} without it); compiles without CUDA (the
// device-generic at::accelerator API gives synchronisation and allocator statistics).
#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <ATen/DeviceAccelerator.h>

#include "core/dtype.h"
#include "models/unet/unet_2d_condition.h"

namespace {

struct Args {
    std::string config;
    int64_t res = 1024, batch = 1, steps = 10, warmup = 3;
    std::string dtype = "bf16";
    bool checkpointing = false, channels_last = false, count_only = false;
};

Args parse(int argc, char** argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        const std::string s = argv[i];
        auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
        if (s == "--res")
            a.res = std::stoll(next());
        else if (s == "--batch")
            a.batch = std::stoll(next());
        else if (s == "--steps")
            a.steps = std::stoll(next());
        else if (s == "--warmup")
            a.warmup = std::stoll(next());
        else if (s == "--dtype")
            a.dtype = next();
        else if (s == "--checkpointing")
            a.checkpointing = true;
        else if (s == "--channels-last")
            a.channels_last = true;
        else if (s == "--count-only")
            a.count_only = true;
        else
            a.config = s;
    }
    return a;
}

void cuda_sync() {
    if (at::hasCUDA()) at::accelerator::synchronizeDevice(0);
}

}  // namespace

int main(int argc, char** argv) {
    using namespace dtune;
    const Args a = parse(argc, argv);
    if (a.config.empty()) {
        std::cerr
            << "usage: bench_unet_step <unet/config.json> [--res N] [--batch N] [--steps N] [--dtype bf16]\n";
        return 2;
    }
    if (!at::hasCUDA() && !a.count_only) {
        std::cout << R"({"bench": "unet_step", "skipped": "no CUDA device"})" << std::endl;
        return 0;
    }
    const auto dtype = parse_dtype(a.dtype);
    std::filesystem::path cfg_path = a.config;
    if (std::filesystem::is_directory(cfg_path)) cfg_path /= "config.json";
    auto config = models::UNet2DConditionConfig::from_json(models::ConfigReader::from_file(cfg_path));
    models::UNet2DConditionModel unet(config);  // random init on CPU in fp32, then moved
    int64_t params = 0;
    for (const auto& p : unet->parameters()) params += p.numel();
    if (a.count_only) {
        std::cout << "{\"bench\": \"unet_step\", \"params\": " << params << "}" << std::endl;
        return 0;
    }
    const c10::Device dev(c10::kCUDA, 0);
    unet->to(dev, dtype);
    unet->set_gradient_checkpointing(a.checkpointing);
    unet->set_channels_last(a.channels_last);

    const int64_t lat = a.res / 8;
    auto opts = at::TensorOptions().device(dev).dtype(dtype);
    const at::Tensor x = at::randn({a.batch, config.in_channels, lat, lat}, opts);
    const at::Tensor t = at::randint(0, 1000, {a.batch}, at::TensorOptions().device(dev).dtype(at::kLong));
    const at::Tensor ctx = at::randn({a.batch, 77, config.cross_attention_dim[0]}, opts);
    models::UNetAddedCond added;
    if (config.text_time_embedding) {
        const int64_t n_ids = 6;
        added.text_embeds = at::randn(
            {a.batch, config.projection_class_embeddings_input_dim - n_ids * config.addition_time_embed_dim},
            opts);
        added.time_ids =
            // Built in fp64 on the CPU, then converted: torch 2.11 cannot build bf16 tensors from values.
            at::tensor(std::vector<double>{1024.0, 1024, 0, 0, 1024, 1024}).to(opts).repeat({a.batch, 1});
    }
    // The kernels SDPA picks for this model's level-1 attention (self and cross) at this size.
    const int64_t heads = config.heads.size() > 1 ? config.heads[1] : config.heads[0];
    const int64_t ch =
        config.block_out_channels.size() > 1 ? config.block_out_channels[1] : config.block_out_channels[0];
    const at::Tensor q =
        at::randn({a.batch, heads, (lat / 2) * (lat / 2), ch / heads}, opts);  // [B, h, N, d]
    const at::Tensor kv = at::randn({a.batch, heads, 77, ch / heads}, opts);
    const std::string self_kernel = models::sdpa_backend_name(q, q, q);
    const std::string cross_kernel = models::sdpa_backend_name(q, kv, kv);
    std::vector<double> ms;
    for (int64_t s = 0; s < a.warmup + a.steps; ++s) {
        if (s == a.warmup) at::accelerator::resetPeakStats(0);
        cuda_sync();
        const auto t0 = std::chrono::steady_clock::now();
        unet->zero_grad(/*set_to_none=*/true);
        unet->forward(x, t, ctx, added).to(at::kFloat).square().mean().backward();
        cuda_sync();
        const double dt =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (s >= a.warmup) ms.push_back(dt);
    }
    std::sort(ms.begin(), ms.end());
    // allocated_bytes[0] is the aggregate over pools; peak since the reset after warm-up.
    const auto stats = at::accelerator::getDeviceStats(0);
    const double peak_gib = static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 30);
    std::cout << "{\"bench\": \"unet_step\", \"params\": " << params << ", \"res\": " << a.res
              << ", \"batch\": " << a.batch << ", \"dtype\": \"" << a.dtype
              << "\", \"checkpointing\": " << (a.checkpointing ? "true" : "false")
              << ", \"channels_last\": " << (a.channels_last ? "true" : "false")
              << ", \"steps\": " << ms.size() << ", \"ms_per_step_median\": " << ms[ms.size() / 2]
              << ", \"ms_per_step_min\": " << ms.front() << ", \"sdpa_self\": \"" << self_kernel
              << "\", \"sdpa_cross\": \"" << cross_kernel << "\", \"peak_allocated_gib\": " << peak_gib << "}"
              << std::endl;
    return 0;
}
