// `dtune selfcheck`: proves that this build works on this machine: libtorch math and autograd,
// attention, safetensors write+read, the thread pool, and the GPU when there is one.
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>

#include "cli/command.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "io/safetensors.h"

namespace dtune::cli {
namespace {

namespace stdfs = std::filesystem;

void check_autograd() {
    // d/dx sum(x^3) = 3x^2: a closed form the autograd result must match.
    at::Tensor x = at::linspace(-2, 2, 9, at::kDouble).requires_grad_(true);
    at::Tensor y = x.pow(3).sum();
    auto grads = torch::autograd::grad({y}, {x});
    at::Tensor expected = 3 * x.detach().pow(2);
    DTUNE_CHECK(at::allclose(grads[0], expected), "autograd gradient of sum(x^3) is wrong");
}

void check_attention() {
    // SDPA must equal softmax(QK^T/sqrt(d))V computed by hand.
    at::manual_seed(0);
    at::Tensor q = at::randn({2, 3, 5, 8}), k = at::randn({2, 3, 7, 8}), v = at::randn({2, 3, 7, 8});
    at::Tensor fused = at::scaled_dot_product_attention(q, k, v);
    at::Tensor manual = at::softmax(at::matmul(q, k.transpose(-1, -2)) / std::sqrt(8.0), -1).matmul(v);
    DTUNE_CHECK(at::allclose(fused, manual, 1e-5, 1e-5),
                "scaled_dot_product_attention differs from the reference");
}

void check_safetensors() {
    const stdfs::path dir = stdfs::temp_directory_path() / ("dtune-selfcheck-" + std::to_string(::getpid()));
    stdfs::create_directories(dir);
    struct Cleanup {
        stdfs::path dir;
        ~Cleanup() {
            std::error_code ec;
            stdfs::remove_all(dir, ec);
        }
    } cleanup{dir};
    at::Tensor a = at::arange(12, at::kFloat).reshape({3, 4});
    at::Tensor b = at::arange(5, at::kLong).to(at::kBFloat16);
    io::save_safetensors(dir / "check.safetensors", {{"a", a}, {"b", b}}, {{"format", "pt"}});
    io::SafetensorsFile f(dir / "check.safetensors");
    DTUNE_CHECK(at::equal(f.get("a"), a) && at::equal(f.get("b"), b),
                "safetensors round trip changed the data");
    DTUNE_CHECK(f.metadata().at("format") == "pt", "safetensors metadata lost");
}

void check_thread_pool() {
    ThreadPool pool(4);
    std::vector<int> out(1000);
    pool.parallel_for(out.size(), [&](std::size_t i) { out[i] = static_cast<int>(i * i); });
    for (std::size_t i = 0; i < out.size(); ++i)
        DTUNE_CHECK(out[i] == static_cast<int>(i * i), "thread pool lost work");
}

void check_cuda() {
    at::Tensor a = at::randn({256, 256}, at::kFloat);
    at::Tensor b = at::randn({256, 256}, at::kFloat);
    at::Tensor ref = at::matmul(a.to(at::kBFloat16), b.to(at::kBFloat16)).to(at::kFloat);
    at::Tensor gpu =
        at::matmul(a.to(at::kCUDA, at::kBFloat16), b.to(at::kCUDA, at::kBFloat16)).to(at::kCPU, at::kFloat);
    DTUNE_CHECK(at::allclose(gpu, ref, 5e-2, 5e-1), "bf16 matmul on the GPU differs from the CPU");
}

int run_selfcheck(const std::vector<std::string>&) {
    struct Step {
        const char* name;
        std::function<void()> fn;
        bool needs_cuda;
    };
    const std::vector<Step> steps = {
        {"libtorch autograd", check_autograd, false},
        {"scaled dot-product attention", check_attention, false},
        {"safetensors write + mmap read", check_safetensors, false},
        {"thread pool", check_thread_pool, false},
        {"CUDA bf16 matmul", check_cuda, true},
    };
    int failures = 0;
    for (const auto& step : steps) {
        if (step.needs_cuda && !cuda_available()) {
            std::printf("  skip  %-32s (no CUDA device)\n", step.name);
            continue;
        }
        const auto t0 = std::chrono::steady_clock::now();
        try {
            step.fn();
            const double ms =
                std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
            std::printf("  ok    %-32s %7.1f ms\n", step.name, ms);
        } catch (const std::exception& e) {
            ++failures;
            std::printf("  FAIL  %-32s %s\n", step.name, e.what());
        }
    }
    std::printf(failures == 0 ? "selfcheck passed\n" : "selfcheck FAILED (%d check(s))\n", failures);
    return failures == 0 ? 0 : 1;
}

}  // namespace

DTUNE_REGISTER_COMMAND(
    selfcheck, "selfcheck", "check that this build works here (torch, attention, I/O, GPU)",
    "usage: dtune selfcheck\n\nRuns quick checks of libtorch math and autograd, attention, "
    "safetensors writing and\nreading, the thread pool and (when present) a bf16 matmul on the "
    "GPU. Exit code 0 when all pass.\n",
    run_selfcheck);

}  // namespace dtune::cli
