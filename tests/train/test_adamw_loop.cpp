// AdamW's per-tensor loop (deterministic runs), which reads no step count back to the host so that a
// CUDA graph captures it: on the CPU it gives the bits of the loop it replaced (the host-scalar
// formulation, kept here as the reference), eagerly and under use_device_lr(), run after run; an
// fp16 overflow leaves every tensor as it was.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "train/optimizer.h"

namespace dtune::train {
namespace test_adamw_loop_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

// The loop as it was: the step count read back per parameter, the bias corrections as host doubles.
struct HostLoop {
    double lr, wd, b1 = 0.9, b2 = 0.999, eps = 1e-8;
    std::vector<at::Tensor> m, v, step;
    void operator()(std::vector<at::Tensor>& params) {
        at::NoGradGuard no_grad;
        if (m.empty()) {
            for (const auto& p : params) {
                m.push_back(at::zeros_like(p));
                v.push_back(at::zeros_like(p));
                step.push_back(at::zeros({}, at::kFloat));
            }
        }
        for (size_t i = 0; i < params.size(); ++i) {
            at::Tensor& p = params[i];
            const at::Tensor grad = p.grad();
            step[i].add_(1);
            const double t = step[i].item<double>();
            p.mul_(1 - lr * wd);
            m[i].lerp_(grad, 1 - b1);
            v[i].mul_(b2).addcmul_(grad, grad, 1 - b2);
            const double step_size = lr / (1 - std::pow(b1, t));
            const double bc2_sqrt = std::sqrt(1 - std::pow(b2, t));
            const at::Tensor denom = (v[i].sqrt() / bc2_sqrt).add_(eps);
            p.addcdiv_(m[i], denom, -step_size);
        }
    }
};

// 11 parameters (more than a vector register of doubles holds, so [n] kernels take their vector
// path) of several shapes, float32 or float64.
std::vector<at::Tensor> make_params(at::ScalarType dtype) {
    at::Generator gen = at::detail::createCPUGenerator(5);
    std::vector<at::Tensor> out;
    for (int64_t i = 0; i < 11; ++i)
        out.push_back(at::randn({3 + i, 17 + 2 * i}, gen, dtype).requires_grad_(true));
    return out;
}

std::vector<std::string> names_of(size_t n) {
    std::vector<std::string> out;
    for (size_t i = 0; i < n; ++i) out.push_back("p" + std::to_string(i) + ".weight");
    return out;
}

void set_grads(std::vector<at::Tensor>& params, int64_t step) {
    at::Generator gen = at::detail::createCPUGenerator(100 + step);
    for (auto& p : params) p.mutable_grad() = at::randn(p.sizes(), gen, p.scalar_type()) * 0.3;
}

// `steps` steps of the new loop (lr changing per step, as a schedule would); device_lr: the
// graph's settings (upload_lr before each step).
std::vector<at::Tensor> run_loop(at::ScalarType dtype, int64_t steps, bool device_lr, double wd) {
    std::vector<at::Tensor> params = make_params(dtype);
    AdamW opt({ParamGroup{names_of(params.size()), params, 1e-2, wd}}, AdamWOptions{.fused = false});
    if (device_lr) opt.use_device_lr();
    for (int64_t s = 0; s < steps; ++s) {
        set_grads(params, s);
        opt.set_lr(1e-2 / (1.0 + 0.37 * static_cast<double>(s)));
        opt.upload_lr();
        opt.step();
        opt.after_step();
    }
    return params;
}

std::vector<at::Tensor> run_host(at::ScalarType dtype, int64_t steps, double wd) {
    std::vector<at::Tensor> params = make_params(dtype);
    HostLoop loop{1e-2, wd};
    for (int64_t s = 0; s < steps; ++s) {
        set_grads(params, s);
        loop.lr = 1e-2 / (1.0 + 0.37 * static_cast<double>(s));
        loop(params);
    }
    return params;
}

TEST(AdamWLoop, DeviceScalarsGiveTheHostLoopsBits) {
    for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
        for (double wd : {0.0, 0.05}) {
            const auto expected = run_host(dtype, 6, wd);
            for (bool device_lr : {false, true}) {
                const auto got = run_loop(dtype, 6, device_lr, wd);
                const auto again = run_loop(dtype, 6, device_lr, wd);
                for (size_t i = 0; i < got.size(); ++i) {
                    EXPECT_TRUE(at::equal(got[i], expected[i]))
                        << "param " << i << " dtype " << dtype << " wd " << wd << " device_lr " << device_lr
                        << " max diff " << (got[i] - expected[i]).abs().max().item<double>();
                    EXPECT_TRUE(at::equal(got[i], again[i])) << "two runs differ, param " << i;
                }
            }
        }
    }
}

// A parameter that has no gradient in some step keeps its own count: its bias corrections follow
// it, as the host loop's did (the counts live on the device; nothing is read back).
TEST(AdamWLoop, CountsPerParameterAndResumesFromState) {
    std::vector<at::Tensor> params = make_params(at::kFloat);
    std::vector<at::Tensor> ref = make_params(at::kFloat);
    AdamW opt({ParamGroup{names_of(params.size()), params, 1e-2, 0.01}}, AdamWOptions{.fused = false});
    HostLoop loop{1e-2, 0.01};
    std::vector<at::Tensor> ref_first(ref.begin(), ref.begin() + 4);
    for (int64_t s = 0; s < 5; ++s) {
        set_grads(params, s);
        set_grads(ref, s);
        if (s == 1)
            for (size_t i = 4; i < params.size(); ++i) params[i].mutable_grad().reset();
        opt.step();
        if (s == 1) {
            HostLoop part{1e-2, 0.01};
            // The host loop with the counts of the first four parameters only.
            part.m.assign(loop.m.begin(), loop.m.begin() + 4);
            part.v.assign(loop.v.begin(), loop.v.begin() + 4);
            part.step.assign(loop.step.begin(), loop.step.begin() + 4);
            for (size_t i = 0; i < 4; ++i) ref_first[i].mutable_grad() = ref[i].grad();
            part(ref_first);
        } else {
            loop(ref);
        }
    }
    const TensorMap state = opt.state_dict();
    EXPECT_EQ(state.at("p0.weight.step").item<float>(), 5.0f);
    EXPECT_EQ(state.at("p5.weight.step").item<float>(), 4.0f);
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i], ref[i])) << "param " << i;

    // A fresh optimizer loaded from the state continues with the same bits.
    std::vector<at::Tensor> copy;
    for (const auto& p : params) copy.push_back(p.detach().clone().requires_grad_(true));
    AdamW loaded({ParamGroup{names_of(copy.size()), copy, 1e-2, 0.01}}, AdamWOptions{.fused = false});
    loaded.load_state_dict(state);
    set_grads(params, 9);
    set_grads(copy, 9);
    opt.step();
    loaded.step();
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i], copy[i])) << "param " << i;
}

// fp16 loss scaling: an overflowed step (found_inf 1) changes nothing, counts included, and the
// next step is the one an optimizer that never saw the overflow takes.
TEST(AdamWLoop, OverflowSkipsOnTheDevice) {
    std::vector<at::Tensor> params = make_params(at::kFloat);
    std::vector<at::Tensor> clean = make_params(at::kFloat);
    AdamW opt({ParamGroup{names_of(params.size()), params, 1e-2, 0.02}}, AdamWOptions{.fused = false});
    AdamW ref({ParamGroup{names_of(clean.size()), clean, 1e-2, 0.02}}, AdamWOptions{.fused = false});
    const at::Tensor found_inf = at::zeros({}, at::kFloat);
    ASSERT_TRUE(opt.skip_step_on_overflow(found_inf));
    set_grads(params, 0);
    set_grads(clean, 0);
    opt.step();
    ref.step();
    const TensorMap before = opt.state_dict();
    std::vector<at::Tensor> weights;
    for (const auto& p : params) weights.push_back(p.detach().clone());
    found_inf.fill_(1);
    set_grads(params, 1);
    params[3].mutable_grad()[0][0] = std::numeric_limits<float>::infinity();
    params[4].mutable_grad()[1][2] = std::nanf("");
    opt.step();
    const TensorMap after = opt.state_dict();
    for (const auto& [key, value] : before) EXPECT_TRUE(at::equal(value, after.at(key))) << key;
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i], weights[i])) << i;
    found_inf.fill_(0);
    set_grads(params, 2);
    set_grads(clean, 2);
    opt.step();
    ref.step();
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i], clean[i])) << i;
}

// bf16 weights: the lr-like scalars are applied in float32, as a host scalar was (a bf16 scalar
// would round 1 - lr wd to 1 and drop the decay). Not the old bits: its scalar division multiplied
// by a reciprocal; each step may round one bf16 ulp (2^-7 relative) apart, so 3 steps stay within 3.
TEST(AdamWLoop, Bf16WeightsDecay) {
    const auto host = run_host(at::kBFloat16, 3, 0.5);
    const auto got = run_loop(at::kBFloat16, 3, true, 0.5);
    const auto none = run_loop(at::kBFloat16, 3, true, 0.0);
    for (size_t i = 0; i < got.size(); ++i) {
        const at::Tensor h = host[i].to(at::kFloat), g = got[i].to(at::kFloat);
        EXPECT_TRUE(((g - h).abs() <= h.abs() * (3 * 0.0078125) + 1e-6).all().item<bool>())
            << "more than three bf16 roundings apart, param " << i;
        EXPECT_FALSE(at::equal(got[i], none[i])) << "weight decay had no effect, param " << i;
    }
}

}  // namespace
}  // namespace test_adamw_loop_local
}  // namespace dtune::train
