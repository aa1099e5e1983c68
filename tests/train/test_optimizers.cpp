// Optimizers and clipping against torch.optim / torch.nn.utils (tests/data/ref/train_ref.safetensors,
// made by tools/ref/gen_train_ref.py) and closed forms; state save/load round trips.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>

#include "core/error.h"
#include "io/safetensors.h"
#include "train/optimizer.h"

namespace dtune::train {
namespace test_optimizers_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

const io::SafetensorsFile& ref() {
    static const io::SafetensorsFile file(std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref" /
                                          "train_ref.safetensors");
    return file;
}
at::Tensor get(const std::string& key) {
    return ref().get(key).clone();
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
    return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// The reference's two parameters, fresh leaves that require grad.
std::vector<at::Tensor> fresh_params() {
    return {get("init.0").requires_grad_(true), get("init.1").requires_grad_(true)};
}

ParamGroup group_of(const std::vector<at::Tensor>& params, double lr, double wd) {
    return ParamGroup{{"a.weight", "b.bias"}, params, lr, wd};
}

// Runs steps [from, to) with the reference gradients.
void run_steps(Optimizer& opt, std::vector<at::Tensor>& params, int from, int to) {
    for (int s = from; s < to; ++s) {
        for (size_t i = 0; i < params.size(); ++i)
            params[i].mutable_grad() = get(str("grads.", i))[s].clone();
        opt.step();
        opt.zero_grad();
    }
}

TEST(AdamW, MatchesTorchFusedAndLoop) {
    for (bool fused : {true, false}) {
        SCOPED_TRACE(fused ? "fused" : "loop");
        auto params = fresh_params();
        AdamW opt({group_of(params, 1e-2, 0.05)}, AdamWOptions{0.9, 0.999, 1e-8, fused});
        run_steps(opt, params, 0, 5);
        const TensorMap st = opt.state_dict();
        for (int i = 0; i < 2; ++i) {
            EXPECT_LE(max_abs_diff(params[i], get(str("adamw.", i))), 1e-6);
            const std::string name = i == 0 ? "a.weight" : "b.bias";
            EXPECT_LE(max_abs_diff(st.at(name + ".exp_avg"), get(str("adamw.exp_avg.", i))), 1e-6);
            EXPECT_LE(max_abs_diff(st.at(name + ".exp_avg_sq"), get(str("adamw.exp_avg_sq.", i))), 1e-7);
            EXPECT_EQ(st.at(name + ".step").item<double>(), 5.0);
        }
    }
}

TEST(AdamW, StateRoundTripContinuesExactly) {
    auto straight = fresh_params();
    AdamW a({group_of(straight, 1e-2, 0.05)}, AdamWOptions{.fused = false});
    run_steps(a, straight, 0, 5);

    auto resumed = fresh_params();
    TensorMap saved;
    {
        AdamW b({group_of(resumed, 1e-2, 0.05)}, AdamWOptions{.fused = false});
        run_steps(b, resumed, 0, 2);
        saved = b.state_dict();
    }
    AdamW c({group_of(resumed, 1e-2, 0.05)}, AdamWOptions{.fused = false});
    c.load_state_dict(saved);
    run_steps(c, resumed, 2, 5);
    for (int i = 0; i < 2; ++i) EXPECT_TRUE(at::equal(straight[i], resumed[i]));

    TensorMap bad = saved;
    bad["c.weight.exp_avg"] = at::zeros({1});
    EXPECT_THROW(c.load_state_dict(bad), DataError);
    bad = saved;
    bad["a.weight.exp_avg"] = at::zeros({4, 3});
    EXPECT_THROW(c.load_state_dict(bad), DataError);
}

TEST(SGD, MatchesTorchVariants) {
    const std::vector<std::tuple<std::string, SGDOptions, double>> cases = {
        {"sgd", SGDOptions{0.9, 0.0, false}, 0.01},
        {"sgd_nesterov", SGDOptions{0.9, 0.0, true}, 0.0},
        {"sgd_plain", SGDOptions{}, 0.0}};
    for (const auto& [name, options, wd] : cases) {
        SCOPED_TRACE(name);
        auto params = fresh_params();
        SGD opt({group_of(params, 0.05, wd)}, options);
        run_steps(opt, params, 0, 5);
        for (int i = 0; i < 2; ++i) EXPECT_LE(max_abs_diff(params[i], get(str(name, ".", i))), 1e-6);
    }
}

TEST(Adafactor, MatchesTorch) {
    auto params = fresh_params();  // a [3, 4] matrix (factored moments) and a [5] vector
    Adafactor opt({group_of(params, 1e-2, 0.01)});
    run_steps(opt, params, 0, 5);
    for (int i = 0; i < 2; ++i) EXPECT_LE(max_abs_diff(params[i], get(str("adafactor.", i))), 1e-6);
    const TensorMap st = opt.state_dict();
    EXPECT_EQ(st.at("a.weight.row_var").sizes(), (at::IntArrayRef{3, 1}));
    EXPECT_EQ(st.at("a.weight.col_var").sizes(), (at::IntArrayRef{1, 4}));
    Adafactor again({group_of(fresh_params(), 1e-2, 0.01)});
    again.load_state_dict(st);  // factored shapes load back
    EXPECT_EQ(again.state_dict().size(), st.size());
}

TEST(Lion, HandComputedSteps) {
    at::Tensor p = at::ones({1}, at::kDouble).requires_grad_(true);
    Lion opt({ParamGroup{{"w"}, {p}, 0.1, 0.1}});
    p.mutable_grad() = at::full({1}, 0.5, at::kDouble);
    opt.step();
    // p = 1 (1 - 0.01) - 0.1 sign(0.1 * 0.5) = 0.89; m = 0.01 * 0.5
    EXPECT_NEAR(p.item<double>(), 0.89, 1e-12);
    p.mutable_grad() = at::full({1}, -2.0, at::kDouble);
    opt.step();
    // p = 0.89 * 0.99 - 0.1 sign(0.9 * 0.005 - 0.2) = 0.9811; m = 0.99 * 0.005 - 0.02
    EXPECT_NEAR(p.item<double>(), 0.9811, 1e-12);
    EXPECT_NEAR(opt.state_dict().at("w.exp_avg").item<double>(), -0.01505, 1e-12);
}

TEST(GradClip, MatchesTorch) {
    for (const std::string kind : {"norm", "value"}) {
        SCOPED_TRACE(kind);
        auto params = fresh_params();
        for (int i = 0; i < 2; ++i) params[i].mutable_grad() = get(str("grads.", i))[0] * 2;
        if (kind == "norm") {
            const double total = clip_grad_norm(params, 1.5);
            EXPECT_NEAR(total, get("clip_norm.total").item<double>(), 1e-5);
        } else {
            clip_grad_value(params, 0.3);
        }
        for (int i = 0; i < 2; ++i)
            EXPECT_LE(max_abs_diff(params[i].grad(), get(str("clip_", kind, ".", i))), 1e-6);
    }
    // Below the threshold nothing changes.
    at::Tensor p = at::zeros({3}).requires_grad_(true);
    p.mutable_grad() = at::tensor({0.1f, 0.2f, -0.2f});
    EXPECT_NEAR(clip_grad_norm({p}, 10.0), 0.3, 1e-6);
    EXPECT_TRUE(at::equal(p.grad(), at::tensor({0.1f, 0.2f, -0.2f})));
}

TEST(GradClip, AsyncNormStaysOnDeviceAndMeasuresWithoutMax) {
    // Two parameters with gradients (3, 4) and (12): total norm sqrt(9 + 16 + 144) = 13.
    at::Tensor a = at::zeros({2}).requires_grad_(true), b = at::zeros({1}).requires_grad_(true);
    a.mutable_grad() = at::tensor({3.0f, 4.0f});
    b.mutable_grad() = at::tensor({12.0f});
    const at::Tensor measured = clip_grad_norm_async({a, b}, 0.0);
    EXPECT_EQ(measured.dim(), 0);
    EXPECT_NEAR(measured.item<double>(), 13.0, 1e-5);
    EXPECT_TRUE(at::equal(a.grad(), at::tensor({3.0f, 4.0f})));  // max_norm 0: nothing scaled
    EXPECT_NEAR(clip_grad_norm_async({a, b}, 6.5).item<double>(), 13.0, 1e-5);
    EXPECT_LE(max_abs_diff(a.grad(), at::tensor({1.5f, 2.0f})), 1e-6);  // scaled by 6.5 / 13
    EXPECT_LE(max_abs_diff(b.grad(), at::tensor({6.0f})), 1e-6);
    at::Tensor none = at::zeros({1}).requires_grad_(true);
    EXPECT_FALSE(clip_grad_norm_async({none}, 1.0).defined());  // no gradient: nothing to measure
}

TEST(StochasticRounding, BracketsAndIsUnbiased) {
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(7);
    // 1 + 2^-9 lies a quarter of the way between the bf16 neighbours 1 and 1 + 2^-7; the negative value
    // three quarters of the way between -3 and -3 - 2^-6.
    for (const double x : {1.0 + std::ldexp(1.0, -9), -(3.0 + 0.75 * std::ldexp(1.0, -6))}) {
        SCOPED_TRACE(x);
        const at::Tensor src = at::full({20000}, x, at::kFloat);
        at::Tensor dst = at::empty({20000}, at::kBFloat16);
        copy_stochastic_(dst, src, g);
        const at::Tensor d = dst.to(at::kDouble);
        EXPECT_LE((d - x).abs().max().item<double>(), std::abs(x) * std::ldexp(1.0, -7));
        EXPECT_NEAR(d.mean().item<double>(), x, std::abs(x) * 2e-4);  // sd of the mean ~ 3e-5 relative
        EXPECT_GT((d != d[0]).sum().item<int64_t>(), 0);              // both neighbours occur
    }
    const at::Tensor exact = at::tensor({1.0f, -2.0f, 0.5f, 0.0f});
    at::Tensor out = at::empty({4}, at::kBFloat16);
    copy_stochastic_(out, exact, g);
    EXPECT_TRUE(at::equal(out.to(at::kFloat), exact));
}

// A double-precision mirror of SimpleTuner's AdamWBF16 without rounding or decay: the true weight
// p + shift must track it to bf16 accuracy.
TEST(AdamWBF16, TracksItsExactArithmeticAndIsSeeded) {
    for (bool quirk : {true, false}) {
        SCOPED_TRACE(quirk ? "simpletuner momentum" : "textbook momentum");
        at::Tensor p = get("init.0").to(at::kBFloat16).requires_grad_(true);
        AdamWBF16Options o;
        o.simpletuner_momentum = quirk;
        AdamWBF16 opt({ParamGroup{{"w"}, {p}, 1e-2, 0.0}}, at::make_generator<at::CPUGeneratorImpl>(3), o);
        at::Tensor w = p.detach().to(at::kDouble);
        at::Tensor m = at::zeros_like(w);
        at::Tensor v = at::zeros_like(w);
        for (int t = 1; t <= 5; ++t) {
            const at::Tensor grad = get("grads.0")[t - 1].to(at::kBFloat16);
            p.mutable_grad() = grad;
            opt.step();
            const at::Tensor gd = grad.to(at::kDouble);
            m = quirk ? gd + 0.1 * 0.9 * m : 0.9 * m + 0.1 * gd;
            v = 0.999 * v + 0.001 * gd * gd;
            w = w - 1e-2 * std::sqrt(1 - std::pow(0.999, t)) * m / (v.sqrt() + 1e-6);
        }
        const TensorMap st = opt.state_dict();
        const at::Tensor true_w = p.detach().to(at::kDouble) + st.at("w.shift").to(at::kDouble);
        EXPECT_EQ(p.scalar_type(), at::kBFloat16);
        EXPECT_LE(max_abs_diff(true_w, w), 5e-4);  // the five updates move weights by ~5e-2
        EXPECT_GT(max_abs_diff(w, get("init.0")), 1e-2);
    }
    // Same seed, same bits.
    std::array<at::Tensor, 2> runs;
    for (auto& r : runs) {
        at::Tensor p = get("init.1").to(at::kBFloat16).requires_grad_(true);
        AdamWBF16 opt({ParamGroup{{"w"}, {p}, 1e-2, 0.01}}, at::make_generator<at::CPUGeneratorImpl>(11));
        for (int t = 0; t < 3; ++t) {
            p.mutable_grad() = get("grads.1")[t].to(at::kBFloat16);
            opt.step();
        }
        r = p.detach().clone();
    }
    EXPECT_TRUE(at::equal(runs[0], runs[1]));
}

TEST(AdamWBF16, DecayIsAppliedOnceAccumulatedAndNeedsBf16) {
    at::Tensor p = at::full({64}, 1.0, at::kBFloat16).requires_grad_(true);
    AdamWBF16 opt({ParamGroup{{"w"}, {p}, 1e-2, 1.0}}, at::make_generator<at::CPUGeneratorImpl>(5));
    p.mutable_grad() = at::zeros({64}, at::kBFloat16);  // no Adam update: only the decay moves w
    opt.step();
    const TensorMap st = opt.state_dict();
    const double w = (p.detach().to(at::kDouble) + st.at("w.shift").to(at::kDouble)).mean().item<double>();
    // decay = random start in [0, 5e-3) + wd * lr = 1e-2 > threshold: applied at once.
    EXPECT_GT(w, 1.0 - 0.015 - 1e-3);
    EXPECT_LT(w, 1.0 - 0.01 + 1e-3);
    EXPECT_EQ(st.at("w.accumulated_decay").item<double>(), 0.0);
    at::Tensor f = at::zeros({2}).requires_grad_(true);
    EXPECT_THROW(AdamWBF16({ParamGroup{{"f"}, {f}, 1e-2, 0.0}}, at::make_generator<at::CPUGeneratorImpl>(1)),
                 UsageError);
}

}  // namespace
}  // namespace test_optimizers_local
}  // namespace dtune::train
