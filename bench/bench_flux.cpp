// Flux.1 [dev]'s transformer at full size with random weights on the GPU (issue #21's measurement):
// bf16 forward, and forward + backward to the input (the frozen-base shape of LoRA training), at
// one resolution; the median of --steps timed runs after 2 warm-ups, and the peak memory. Prints
// one JSON line:
//   {"bench": "flux_transformer", "width": 1024, "height": 1024, "tokens": 4096, "text_tokens": 512,
//    "params_b": 11.9, "forward_ms": ..., "forward_backward_ms": ..., "peak_gib": ...}
// Usage (GPU machine): bench_flux [--width 1024] [--height 1024] [--steps 5] [--text 512] [--cudnn_attention
// 0|1 (1)] [--profile trace.json]: --profile also writes one more forward + backward as a Kineto trace
// (GPU activity only) for bench/summarize_trace.py --steps 1.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "core/gpu_memory.h"
#include "models/common/layers.h"
#include "models/flux/flux_transformer.h"

namespace {

int64_t arg(int argc, char** argv, const std::string& name, int64_t fallback) {
    for (int i = 1; i + 1 < argc; ++i)
        if (argv[i] == name) return std::stoll(argv[i + 1]);
    return fallback;
}

std::string text_arg(int argc, char** argv, const std::string& name) {
    for (int i = 1; i + 1 < argc; ++i)
        if (argv[i] == name) return argv[i + 1];
    return "";
}

}  // namespace

int main(int argc, char** argv) {
    namespace m = dtune::models;
    if (!torch::cuda::is_available()) {
        std::fprintf(stderr, "bench_flux needs a CUDA device\n");
        return 1;
    }
    const int64_t width = arg(argc, argv, "--width", 1024), height = arg(argc, argv, "--height", 1024);
    const int64_t steps = arg(argc, argv, "--steps", 5), text = arg(argc, argv, "--text", 512);
    const c10::Device cuda(c10::kCUDA, 0);
    // --cudnn_attention 0 keeps SDPA off cuDNN's kernels and the training pass on flash by name;
    // 1 (the default, as in training) leaves both to SDPA's pick, cuDNN's kernel on Hopper.
    if (arg(argc, argv, "--cudnn_attention", 1) == 0) {
        at::globalContext().setSDPUseCuDNN(false);
        m::set_flux_training_attention(m::FluxTrainingAttention::kFlash);
    } else {
        m::set_flux_training_attention(m::FluxTrainingAttention::kSdpaChoice);
    }
    m::FluxTransformerConfig c;  // FLUX.1-dev: 19 double, 38 single blocks, 3072 wide
    c.guidance_embeds = true;
    m::FluxTransformer2DModel model{nullptr};
    {
        m::UninitializedParameters scope(at::kBFloat16, cuda);
        model = m::FluxTransformer2DModel(c);
    }
    model->to(cuda, at::kBFloat16);
    int64_t params = 0;
    {
        at::NoGradGuard no_grad;
        for (auto& p : model->parameters()) {
            p.normal_(0.0, 0.02);
            p.set_requires_grad(false);
            params += p.numel();
        }
    }
    const int64_t lh = 2 * (height / 16), lw = 2 * (width / 16), tokens = (lh / 2) * (lw / 2);
    const auto opts = at::TensorOptions(cuda).dtype(at::kBFloat16);
    const at::Tensor x = at::randn({1, tokens, 64}, opts), ctx = at::randn({1, text, 4096}, opts);
    const at::Tensor pooled = at::randn({1, 768}, opts), t = at::full({1}, 0.7, opts),
                     g = at::full({1}, 3.5, opts);
    const at::Tensor img_ids = m::flux_image_ids(lh, lw).to(cuda),
                     txt_ids = at::zeros({text, 3}, at::TensorOptions(cuda));
    const auto run = [&](bool backward) {
        if (backward) {
            const at::Tensor xi = x.clone().requires_grad_();
            model->forward(xi, ctx, pooled, t, g, img_ids, txt_ids).to(at::kFloat).square().mean().backward();
        } else {
            at::NoGradGuard no_grad;
            (void)model->forward(x, ctx, pooled, t, g, img_ids, txt_ids);
        }
    };
    const auto time_ms = [&](bool backward) {
        std::vector<double> ms;
        for (int64_t i = 0; i < steps + 2; ++i) {
            torch::cuda::synchronize();
            const auto t0 = std::chrono::steady_clock::now();
            run(backward);
            torch::cuda::synchronize();
            if (i >= 2)
                ms.push_back(
                    std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        }
        std::sort(ms.begin(), ms.end());
        return ms[ms.size() / 2];
    };
    const double fwd = time_ms(false), fwd_bwd = time_ms(true);
    if (const std::string trace = text_arg(argc, argv, "--profile"); !trace.empty()) {
        namespace prof = torch::autograd::profiler;
        const std::set<torch::profiler::impl::ActivityType> activities{
            torch::profiler::impl::ActivityType::CUDA};
        const prof::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
        prof::prepareProfiler(config, activities);
        prof::enableProfiler(config, activities);
        run(true);
        torch::cuda::synchronize();
        prof::disableProfiler()->save(trace);
    }
    // The input gradient under the kernel in use against the flash kernel's: relative L2 difference
    // (bf16 attention kernels differ in summation order, ~1e-3; a broken backward gives ~1).
    double grad_vs_flash = 0;
    if (m::flux_training_attention() != m::FluxTrainingAttention::kFlash) {
        const auto input_grad = [&] {
            const at::Tensor xi = x.clone().requires_grad_();
            model->forward(xi, ctx, pooled, t, g, img_ids, txt_ids).to(at::kFloat).square().mean().backward();
            return xi.grad().to(at::kFloat);
        };
        const at::Tensor used = input_grad();
        const auto kept = m::flux_training_attention();
        m::set_flux_training_attention(m::FluxTrainingAttention::kFlash);
        const at::Tensor flash = input_grad();
        m::set_flux_training_attention(kept);
        grad_vs_flash = ((used - flash).norm() / flash.norm()).item<double>();
    }
    std::printf(
        "{\"bench\": \"flux_transformer\", \"width\": %ld, \"height\": %ld, \"tokens\": %ld, "
        "\"text_tokens\": %ld, "
        "\"params_b\": %.2f, \"forward_ms\": %.1f, \"forward_backward_ms\": %.1f, \"peak_gib\": %.2f, "
        "\"training_attention\": \"%s\", \"input_grad_rel_diff_vs_flash\": %.2e}\n",
        static_cast<long>(width), static_cast<long>(height), static_cast<long>(tokens),
        static_cast<long>(text), static_cast<double>(params) / 1e9, fwd, fwd_bwd,
        dtune::peak_gpu_memory_gib(cuda).value_or(0.0),
        m::flux_training_attention() == m::FluxTrainingAttention::kFlash ? "flash" : "sdpa_choice",
        grad_vs_flash);
    return 0;
}
