// Quantised frozen weights on the GPU, piece by piece (models/common/quantize.h): the
// dequantisation kernel's bandwidth, and one SDXL-sized Linear's forward + input-gradient time with
// a bf16 weight, an int8 weight (dequantised per call) and an fp8 weight (fp8 GEMM forward where the
// card has it), under bf16 autocast as training runs it. Prints one JSON line per measurement:
//   {"bench": "dequantize", "format": "int8", "rows": 5120, "cols": 1280, "us": ..., "gb_per_s": ...}
//   {"bench": "linear_fwd_bwd", "weight": "int8", "m": 16384, "k": 1280, "n": 5120, "us": ..., ...}
// Usage (GPU machine): bench_quant [--iters 50]
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>

#include "models/common/quantize.h"

namespace {

using dtune::QuantFormat;
namespace m = dtune::models;

// The mean over `iters` calls after 3 warm-ups, synchronised, in microseconds.
double time_us(const std::function<void()>& fn, int iters) {
    for (int i = 0; i < 3; ++i) fn();
    torch::cuda::synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) fn();
    torch::cuda::synchronize();
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
}

const char* name(QuantFormat f) {
    return f == QuantFormat::kInt8 ? "int8" : f == QuantFormat::kFloat8 ? "fp8" : "bf16";
}

}  // namespace

int main(int argc, char** argv) {
    int iters = 50;
    for (int i = 1; i + 1 < argc; ++i)
        if (std::string(argv[i]) == "--iters") iters = std::stoi(argv[i + 1]);
    if (!at::hasCUDA()) {
        std::fprintf(stderr, "bench_quant needs a CUDA device\n");
        return 1;
    }
    const c10::Device cuda(c10::kCUDA, 0);
    const bool fp8_gemm = m::fp8_gemm_available(cuda);
    for (const auto format : {QuantFormat::kInt8, QuantFormat::kFloat8}) {
        for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{5120, 1280}, {1280, 5120}, {640, 640}}) {
            const at::Tensor w = at::randn({rows, cols}, at::TensorOptions(cuda).dtype(at::kBFloat16));
            const m::QuantizedWeight q = m::quantize_weight(w, format);
            const double us =
                time_us([&] { (void)m::dequantize_weight(q.data, q.scale, at::kBFloat16); }, iters);
            const double bytes = static_cast<double>(rows * cols) * 3.0;  // 1 read + 2 written
            std::printf(
                "{\"bench\": \"dequantize\", \"format\": \"%s\", \"rows\": %ld, \"cols\": %ld, \"us\": %.2f, "
                "\"gb_per_s\": %.1f}\n",
                name(format), static_cast<long>(rows), static_cast<long>(cols), us, bytes / us / 1e3);
        }
    }

    // attention projection at 128×128 tokens batch 1.
    for (const auto& [mm, k, n] : {std::tuple<int64_t, int64_t, int64_t>{16384, 1280, 10240},
                                   {16384, 5120, 1280},
                                   {16384, 640, 640},
                                   {4096, 1280, 1280}}) {
        const at::Tensor w = (at::randn({n, k}, at::TensorOptions(cuda)) * 0.02).to(at::kBFloat16);
        const at::Tensor x =
            at::randn({mm, k}, at::TensorOptions(cuda).dtype(at::kBFloat16)).requires_grad_();
        const at::Tensor g = at::randn({mm, n}, at::TensorOptions(cuda).dtype(at::kBFloat16));
        for (const auto format : {QuantFormat::kNone, QuantFormat::kInt8, QuantFormat::kFloat8}) {
            m::QuantizedWeight q;
            if (format != QuantFormat::kNone) q = m::quantize_weight(w, format);
            const auto fwd = [&] {
                at::autocast::set_autocast_enabled(at::kCUDA, true);
                at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
                at::Tensor y = format == QuantFormat::kNone ? at::linear(x, w)
                                                            : m::quantized_linear(x, q.data, q.scale, {});
                at::autocast::set_autocast_enabled(at::kCUDA, false);
                at::autocast::clear_cache();
                return y;
            };
            const double fwd_us = time_us(
                [&] {
                    at::NoGradGuard ng;
                    (void)fwd();
                },
                iters);
            const double both_us = time_us([&] { fwd().backward(g); }, iters);
            std::printf(
                "{\"bench\": \"linear_fwd_bwd\", \"weight\": \"%s\", \"m\": %ld, \"k\": %ld, \"n\": %ld, "
                "\"fwd_us\": %.1f, \"fwd_bwd_us\": %.1f, \"fp8_gemm\": %s}\n",
                name(format), static_cast<long>(mm), static_cast<long>(k), static_cast<long>(n), fwd_us,
                both_us, format == QuantFormat::kFloat8 && fp8_gemm ? "true" : "false");
        }
    }
    return 0;
}
