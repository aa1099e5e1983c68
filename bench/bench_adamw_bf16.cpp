// adamw_bf16 step time on the CPU: the flat-bucket AdamWBF16 against the per-tensor loop it
// replaced (kept below: one parameter at a time, ~30 small ops each and
// host reads of the step count), in the same run on the same tensors. Prints JSON:
//   {"bench": "adamw_bf16_step", "tensors": 2520, "elements": ..., "old_ms_per_step": ...,
//    "new_ms_per_step": ..., "old_cpu_ms_per_step": ..., "new_cpu_ms_per_step": ..., ...}
// (wall time, and this process's CPU time, which a busy machine distorts less).
// The parameter list mimics the SDXL UNet's: 2,520 tensors (transformer blocks at 1280/640
// channels, ResNets, norms and biases) with every channel count divided by --scale (default 16).
// Usage: bench_adamw_bf16 [--scale 16] [--steps 3] [--threads N] [--bucket ELEMENTS]
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <sys/resource.h>

#include "train/optimizer.h"

namespace {

using dtune::train::TensorMap;

std::string arg(int argc, char** argv, const std::string& name, const std::string& fallback) {
    for (int i = 1; i + 1 < argc; ++i)
        if (argv[i] == name) return argv[i + 1];
    return fallback;
}

// SDXL-UNet-like shapes: per transformer block (C channels, text width T) the attention and
// feed-forward weights; per ResNet two 3x3 convs, norms and biases. Channel counts / scale.
std::vector<std::vector<int64_t>> sdxl_like_shapes(int64_t scale) {
    std::vector<std::vector<int64_t>> shapes;
    const int64_t T = 2048 / scale;
    auto transformer = [&](int64_t C) {
        for (int i = 0; i < 3; ++i) shapes.push_back({C}), shapes.push_back({C});  // norm1..3
        for (int i = 0; i < 4; ++i) shapes.push_back({C, C});                      // attn1 q k v out
        shapes.push_back({C});                                                     // attn1 out bias
        shapes.push_back({C, C});                                                  // attn2 q
        shapes.push_back({C, T}), shapes.push_back({C, T});                        // attn2 k v
        shapes.push_back({C, C}), shapes.push_back({C});                           // attn2 out
        shapes.push_back({8 * C, C}), shapes.push_back({8 * C});                   // GEGLU proj
        shapes.push_back({C, 4 * C}), shapes.push_back({C});                       // ff out
    };
    auto resnet = [&](int64_t C) {
        for (int i = 0; i < 2; ++i) {
            shapes.push_back({C}), shapes.push_back({C});  // norm
            shapes.push_back({C, C, 3, 3}), shapes.push_back({C});
        }
        shapes.push_back({C, 1280 / scale}), shapes.push_back({C});  // time embedding projection
    };
    const int64_t c640 = 640 / scale, c1280 = 1280 / scale, c320 = 320 / scale;
    while (shapes.size() < 2520) {
        for (int i = 0; i < 10; ++i) transformer(c1280);
        for (int i = 0; i < 2; ++i) transformer(c640);
        resnet(c1280), resnet(c640), resnet(c320);
    }
    shapes.resize(2520);
    return shapes;
}

// The per-tensor AdamWBF16 step this project used before the flat-bucket version (same arithmetic).
void legacy_step(std::vector<at::Tensor>& params, std::vector<TensorMap>& states, double lr, double wd,
                 at::Generator& gen) {
    const double b1 = 0.9, b2 = 0.999, eps = 1e-6, threshold = 5e-3;
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
        at::Tensor& p = params[i];
        TensorMap& st = states[i];
        if (!st.count("exp_avg")) {
            st["exp_avg"] = at::zeros_like(p);
            st["exp_avg_sq"] = at::zeros_like(p);
            st["shift"] = at::zeros_like(p);
            st["step"] = at::zeros({}, at::kDouble);
            st["accumulated_decay"] = at::rand({}, gen, at::kDouble) * threshold;
        }
        const double t = st["step"].add_(1).item<double>();
        double accumulated = st["accumulated_decay"].item<double>() + wd * lr;
        const double decay = accumulated > threshold ? accumulated : 0.0;
        st["accumulated_decay"].fill_(accumulated - decay);
        at::Tensor &m = st["exp_avg"], &v = st["exp_avg_sq"], &shift = st["shift"];
        const at::Tensor g32 = p.grad().to(at::kFloat);
        m.mul_(b1);
        dtune::train::copy_stochastic_(m, g32 + (1 - b1) * m.to(at::kFloat), gen);
        v.mul_(b2).addcmul_(p.grad(), p.grad(), 1 - b2);
        const at::Tensor denom = v.sqrt().add_(eps);
        dtune::train::copy_stochastic_(
            shift,
            shift.to(at::kFloat)
                .addcdiv_(m.to(at::kFloat), denom.to(at::kFloat), -lr * std::sqrt(1 - std::pow(b2, t))),
            gen);
        const at::Tensor before = p.clone();
        dtune::train::copy_stochastic_(p, shift.to(at::kFloat) + p.to(at::kFloat), gen);
        dtune::train::copy_stochastic_(shift, (before - p).to(at::kFloat) + shift.to(at::kFloat), gen);
        if (decay > 0) shift.add_(p, -decay);
    }
}

std::vector<at::Tensor> make_params(const std::vector<std::vector<int64_t>>& shapes) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
    std::vector<at::Tensor> params;
    for (const auto& s : shapes) {
        at::Tensor p = at::randn(s, gen).mul_(0.02).to(at::kBFloat16).requires_grad_(true);
        p.mutable_grad() = at::randn(s, gen).mul_(1e-3).to(at::kBFloat16);
        params.push_back(p);
    }
    return params;
}

double cpu_ms() {  // this process's user + system time: robust on a shared, overloaded machine
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3 + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e3;
}

struct Timing {
    double wall_ms = 0, cpu_ms = 0;  // per step
};

template <typename Fn>
Timing time_steps(int steps, Fn&& fn) {
    fn();  // first step: state allocation (and packing) excluded
    const double c0 = cpu_ms();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) fn();
    const double wall =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return {wall / steps, (cpu_ms() - c0) / steps};
}

}  // namespace

int main(int argc, char** argv) {
    const int64_t scale = std::stoll(arg(argc, argv, "--scale", "16"));
    const int steps = std::stoi(arg(argc, argv, "--steps", "3"));
    const int threads = std::stoi(arg(argc, argv, "--threads", "0"));
    const int64_t bucket = std::stoll(arg(argc, argv, "--bucket", "0"));  // 0: the optimizer's default
    if (threads > 0) at::set_num_threads(threads);
    const auto shapes = sdxl_like_shapes(scale);
    const double lr = 1e-5, wd = 1e-2;

    std::vector<at::Tensor> old_params = make_params(shapes);
    std::vector<TensorMap> old_states(old_params.size());
    at::Generator old_gen = at::make_generator<at::CPUGeneratorImpl>(2);
    const Timing old_t = time_steps(steps, [&] { legacy_step(old_params, old_states, lr, wd, old_gen); });

    std::vector<at::Tensor> new_params = make_params(shapes);
    dtune::train::ParamGroup group;
    int64_t elements = 0;
    for (size_t i = 0; i < new_params.size(); ++i) {
        group.names.push_back("p" + std::to_string(i));
        group.params.push_back(new_params[i]);
        elements += new_params[i].numel();
    }
    group.lr = lr, group.weight_decay = wd;
    dtune::train::AdamWBF16Options options;
    if (bucket > 0) options.bucket_elements = bucket;
    dtune::train::AdamWBF16 opt({group}, at::make_generator<at::CPUGeneratorImpl>(2), options);
    const Timing new_t = time_steps(steps, [&] { opt.step(); });

    std::printf(
        "{\"bench\": \"adamw_bf16_step\", \"tensors\": %zu, \"elements\": %lld, \"scale\": %lld, "
        "\"steps\": %d, \"threads\": %d, \"old_ms_per_step\": %.2f, \"new_ms_per_step\": %.2f, "
        "\"old_cpu_ms_per_step\": %.2f, \"new_cpu_ms_per_step\": %.2f, \"cpu_speedup\": %.2f}\n",
        shapes.size(), static_cast<long long>(elements), static_cast<long long>(scale), steps,
        at::get_num_threads(), old_t.wall_ms, new_t.wall_ms, old_t.cpu_ms, new_t.cpu_ms,
        old_t.cpu_ms / new_t.cpu_ms);
    return 0;
}
