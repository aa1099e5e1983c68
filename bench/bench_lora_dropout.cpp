// LoRA's adapter products with input dropout on the GPU (models/common/lora_dropout.h), one shape at
// a time: the masked copy then cuBLAS (the composite path), the kernels that read the mask inside
// the product (the default; DTUNE_LORA_DROPOUT_KERNELS=0 is the copy), and the same products without dropout
// (cuBLAS alone, the floor). Each op is captured 50 times into a CUDA graph and replayed, as a graphed
// training step runs it, so launch overhead is left out. Prints one JSON line per shape and product:
//   {"bench": "lora_dropout", "op": "down", "n": 16384, "k": 640, "r": 16, "plain_us": ...,
//    "composite_us": ..., "kernels_us": ..., "max_rel_diff": ...}
// op: down (h = mask(x)·aᵀ), down_grad (dA = ghᵀ·mask(x)), up_add (dx += mask(gh·a)).
// kernels_kept_us: down recording the mask's decisions, the backward products reading them
// (LoRADropoutMask::keep) instead of hashing. max_rel_diff: kernels against the composite, over the
// composite's largest magnitude.
// Usage (GPU machine): bench_lora_dropout [--r 16] [--replays 20]
#include <ATen/ATen.h>
#include <torch/cuda.h>
#ifdef DTUNE_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "models/common/lora_dropout.h"

#ifdef DTUNE_WITH_CUDA
namespace {

namespace m = dtune::models;

int int_arg(int argc, char** argv, const std::string& name, int fallback) {
    for (int i = 1; i + 1 < argc; ++i)
        if (argv[i] == name) return std::atoi(argv[i + 1]);
    return fallback;
}

constexpr int kPerGraph = 50;

// Microseconds per call of `fn`, captured kPerGraph times into one graph on a side stream.
double graphed_us(const std::function<void()>& fn, int replays) {
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
    const c10::cuda::CUDAStreamGuard guard(side);
    fn();  // warm-up outside the capture (cuBLAS workspaces, lazy initialisation)
    torch::cuda::synchronize();
    at::cuda::CUDAGraph graph;
    graph.capture_begin();
    for (int i = 0; i < kPerGraph; ++i) fn();
    graph.capture_end();
    graph.replay();
    torch::cuda::synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < replays; ++i) graph.replay();
    torch::cuda::synchronize();
    const std::chrono::duration<double, std::micro> dt = std::chrono::steady_clock::now() - t0;
    return dt.count() / (replays * kPerGraph);
}

double rel_diff(const at::Tensor& got, const at::Tensor& ref) {
    const at::Tensor g = got.to(at::kFloat), f = ref.to(at::kFloat);
    return (g - f).abs().max().item<double>() / std::max(f.abs().max().item<double>(), 1e-30);
}

}  // namespace

int main(int argc, char** argv) {
    if (!torch::cuda::is_available()) {
        std::fprintf(stderr, "bench_lora_dropout: no CUDA device\n");
        return 2;
    }
    const int r = int_arg(argc, argv, "--r", 16), replays = int_arg(argc, argv, "--replays", 20);
    const auto on = at::TensorOptions().device(at::kCUDA, 0);
    // SDXL at 1024², batch 4: self-attention at 640 and 1280 channels, the text's keys and values;
    // Flux.1: the joint sequence at 3072.
    const std::vector<std::pair<int64_t, int64_t>> shapes{
        {16384, 640}, {4096, 1280}, {308, 2048}, {4608, 3072}};
    const m::LoRADropoutKernels was = m::lora_dropout_kernels_mode();
    for (const auto& [n, k] : shapes) {
        const at::Tensor x = at::randn({n, k}, on).to(at::kBFloat16);
        const at::Tensor a = (at::randn({r, k}, on) * 0.05).to(at::kBFloat16);
        const at::Tensor gh = at::randn({n, r}, on).to(at::kBFloat16);
        const m::LoRADropoutMask mask{at::full({1}, 7, on.dtype(at::kLong)), 3, 0.1, 0};
        at::Tensor h = at::empty({n, r}, x.options()), dx = at::zeros({n, k}, x.options());
        at::Tensor da;
        // The decisions recorded by the forward kernel, for the backward products' last column.
        at::Tensor keep;
        m::set_lora_dropout_kernels(m::LoRADropoutKernels::kTensorCores);
        m::lora_masked_down_out(h, x, a, mask, &keep);
        m::LoRADropoutMask kept = mask;
        kept.keep = keep;
        struct Op {
            const char* name;
            std::function<void()> plain, masked, recorded;
            std::function<at::Tensor()> result;
        };
        const std::vector<Op> ops{
            {"down", [&] { at::mm_out(h, x, a.t()); }, [&] { m::lora_masked_down_out(h, x, a, mask); },
             [&] { m::lora_masked_down_out(h, x, a, mask, &keep); },
             [&] {
                 m::lora_masked_down_out(h, x, a, mask);
                 return h.clone();
             }},
            {"down_grad", [&] { da = at::mm(gh.t(), x, at::kFloat); },
             [&] { da = m::lora_masked_down_grad(gh, x, mask, at::kFloat); },
             [&] { da = m::lora_masked_down_grad(gh, x, kept, at::kFloat); },
             [&] { return m::lora_masked_down_grad(gh, x, mask, at::kFloat); }},
            {"up_add", [&] { dx.addmm_(gh, a); }, [&] { m::lora_masked_up_add_(dx, gh, a, mask); },
             [&] { m::lora_masked_up_add_(dx, gh, a, kept); },
             [&] {
                 at::Tensor d = at::zeros({n, k}, x.options());
                 m::lora_masked_up_add_(d, gh, a, mask);
                 return d;
             }},
        };
        for (const Op& op : ops) {
            const double plain = graphed_us(op.plain, replays);
            m::set_lora_dropout_kernels(m::LoRADropoutKernels::kOff);
            const double composite = graphed_us(op.masked, replays);
            const at::Tensor ref = op.result();
            m::set_lora_dropout_kernels(m::LoRADropoutKernels::kTensorCores);
            const double kernels = graphed_us(op.masked, replays);
            const double recorded = graphed_us(op.recorded, replays);
            const double diff = rel_diff(op.result(), ref);
            std::printf(
                "{\"bench\": \"lora_dropout\", \"op\": \"%s\", \"n\": %lld, \"k\": %lld, \"r\": %d, "
                "\"plain_us\": "
                "%.2f, \"composite_us\": %.2f, \"kernels_us\": %.2f, \"kernels_kept_us\": %.2f, "
                "\"max_rel_diff\": %.3g}\n",
                op.name, static_cast<long long>(n), static_cast<long long>(k), r, plain, composite, kernels,
                recorded, diff);
            std::fflush(stdout);
        }
    }
    m::set_lora_dropout_kernels(was);
    return 0;
}
#else
int main() {
    std::fprintf(stderr, "bench_lora_dropout: built without CUDA in libtorch\n");
    return 2;
}
#endif
