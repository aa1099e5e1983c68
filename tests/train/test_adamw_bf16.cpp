// adamw_bf16 (flat-bucket AdamWBF16): the true weight p + shift against a float64 per-element
// reference of SimpleTuner's arithmetic, stochastic rounding through a whole step (unbiased, always
// a neighbour), determinism, resume exactness, the checkpoint layout, the captured-step protocol
// (use_device_lr / upload_lr / after_step) equal to plain steps, and repacking when the set of
// parameters with gradients changes. Small bucket sizes force several buckets and a parameter
// larger than a bucket. Each test runs on the CPU (the ATen path) and, where a CUDA device is present,
// on the GPU (the fused kernel when it was built, else the ATen path there).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <limits>
#include <set>
#include <string>

#include "core/error.h"
#include "train/optimizer.h"

namespace dtune::train {
namespace test_adamw_bf16_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

// The device a test runs on: GTest's parameter (see INSTANTIATE_TEST_SUITE_P at the end).
class AdamWBF16Flat : public ::testing::TestWithParam<c10::DeviceType> {
  protected:
    void SetUp() override {
        if (GetParam() == c10::kCUDA && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    }
    at::Device device() const { return at::Device(GetParam(), 0); }
};

// A generator where the weights live, seeded.
at::Generator make_gen(const at::Device& device, uint64_t seed) {
    if (device.is_cpu()) return at::make_generator<at::CPUGeneratorImpl>(seed);
    at::Generator gen = at::globalContext().defaultGenerator(device).clone();
    gen.set_current_seed(seed);
    return gen;
}

constexpr double kB1 = 0.9, kB2 = 0.999, kEps = 1e-6;

struct Problem {
    std::vector<std::string> names{"a.weight", "a.bias", "b.conv", "c.big"};
    std::vector<std::vector<int64_t>> shapes{{6, 5}, {7}, {2, 3, 3, 3}, {97}};
    std::vector<at::Tensor> init;                // float32 values, exactly representable in bf16
    std::vector<std::vector<at::Tensor>> grads;  // [step][param], bf16
    explicit Problem(int steps) {
        at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1234);
        for (const auto& s : shapes) init.push_back(at::randn(s, gen).to(at::kBFloat16).to(at::kFloat));
        for (int t = 0; t < steps; ++t) {
            grads.emplace_back();
            for (const auto& s : shapes)
                grads.back().push_back((at::randn(s, gen) * 1e-2).to(at::kBFloat16));  // varied magnitudes
        }
    }
    std::vector<at::Tensor> params(const at::Device& device) const {
        std::vector<at::Tensor> out;
        for (const auto& t : init) out.push_back(t.to(device, at::kBFloat16).requires_grad_(true));
        return out;
    }
};

AdamWBF16Options small_buckets() {
    AdamWBF16Options o;
    o.bucket_elements = 40;  // a.weight (30) + a.bias (7) | b.conv (54) | c.big (97)
    return o;
}

std::unique_ptr<AdamWBF16> make(const at::Device& device, const Problem& pr, std::vector<at::Tensor>& params,
                                double lr, double wd, uint64_t seed, AdamWBF16Options o = small_buckets()) {
    params = pr.params(device);
    return std::make_unique<AdamWBF16>(std::vector<ParamGroup>{ParamGroup{pr.names, params, lr, wd}},
                                       make_gen(device, seed), o);
}

void run(AdamWBF16& opt, std::vector<at::Tensor>& params, const Problem& pr, int from, int to) {
    for (int t = from; t < to; ++t) {
        for (size_t i = 0; i < params.size(); ++i)
            params[i].mutable_grad() = pr.grads[t][i].to(params[i].device());
        opt.step();
    }
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
    return (a.cpu().to(at::kDouble) - b.cpu().to(at::kDouble)).abs().max().item<double>();
}

// Several steps of every parameter against a float64 mirror of SimpleTuner's update without any
// rounding; parameter 0's decay accumulator is loaded just below the threshold, so it decays at
// step 1 (by 4.95e-3 + lr wd), the others keep accumulating.
TEST_P(AdamWBF16Flat, TrueWeightTracksFloat64Reference) {
    for (const auto& [quirk, fused] :
         {std::pair{true, true}, std::pair{false, true}, std::pair{true, false}}) {
        SCOPED_TRACE(std::string(quirk ? "simpletuner momentum" : "textbook momentum") +
                     (fused ? ", fused update" : ", ATen update"));
        const Problem pr(5);
        const double lr = 1e-2, wd = 1e-2;
        AdamWBF16Options o = small_buckets();
        o.simpletuner_momentum = quirk;
        o.fused_kernel = fused;
        std::vector<at::Tensor> params;
        auto opt = make(device(), pr, params, lr, wd, 3, o);
        TensorMap start;
        for (size_t i = 0; i < params.size(); ++i) {
            for (const char* k : {"exp_avg", "exp_avg_sq", "shift"})
                start[pr.names[i] + "." + k] = at::zeros(pr.shapes[i], at::kBFloat16);
            start[pr.names[i] + ".step"] = at::scalar_tensor(0.0, at::kDouble);
            start[pr.names[i] + ".accumulated_decay"] =
                at::scalar_tensor(i == 0 ? 4.95e-3 : 0.0, at::kDouble);
        }
        opt->load_state_dict(start);
        std::vector<at::Tensor> w, m, v;
        for (const auto& t : pr.init) {
            w.push_back(t.to(at::kDouble));
            m.push_back(at::zeros_like(w.back()));
            v.push_back(at::zeros_like(w.back()));
        }
        for (int t = 1; t <= 5; ++t) {
            run(*opt, params, pr, t - 1, t);
            for (size_t i = 0; i < w.size(); ++i) {
                const at::Tensor g = pr.grads[t - 1][i].to(at::kDouble);
                m[i] = quirk ? g + (1 - kB1) * kB1 * m[i] : kB1 * m[i] + (1 - kB1) * g;
                v[i] = kB2 * v[i] + (1 - kB2) * g * g;
                w[i] = w[i] - lr * std::sqrt(1 - std::pow(kB2, t)) * m[i] / (v[i].sqrt() + kEps);
                if (i == 0 && t == 1) w[i] = w[i] * (1 - (4.95e-3 + lr * wd));
            }
        }
        const TensorMap st = opt->state_dict();
        for (size_t i = 0; i < w.size(); ++i) {
            SCOPED_TRACE(pr.names[i]);
            const at::Tensor true_w = params[i].detach().cpu().to(at::kDouble) +
                                      st.at(pr.names[i] + ".shift").cpu().to(at::kDouble);
            EXPECT_EQ(params[i].scalar_type(), at::kBFloat16);
            // m, v and the denominator are bf16 (2^-8 relative each), so each update is off by ~1%
            // at most; measured 0.4-0.8% of the largest movement (1-7e-2). Dropping the bias
            // correction or the decay would be off by tens of percent.
            const double moved = max_abs_diff(w[i], pr.init[i]);
            EXPECT_GT(moved, 1e-2);
            EXPECT_LE(max_abs_diff(true_w, w[i]), 0.02 * moved);
            EXPECT_EQ(st.at(pr.names[i] + ".step").item<double>(), 5.0);
        }
        EXPECT_NEAR(st.at("a.weight.accumulated_decay").item<double>(), 4 * lr * wd, 1e-15);
        EXPECT_NEAR(st.at("a.bias.accumulated_decay").item<double>(), 5 * lr * wd, 1e-15);
    }
}

// One step in closed form: beta2 = 0.75, eps = 0, g = 1 gives m = 1, v = 0.25, d = 0.5 exactly and an
// update of exactly -lr * sqrt(0.25) / 0.5 = -lr. From w = 1 with lr = 1e-3 the new bf16 weights
// must each be 1 or its lower neighbour 1 - 2^-8, averaging 1 - 1e-3; the compensated sum p + shift
// averages 1 - 1e-3 too.
TEST_P(AdamWBF16Flat, StochasticRoundingThroughAStepIsUnbiased) {
    for (bool fused : {true, false}) {
        SCOPED_TRACE(fused ? "fused update" : "ATen update");
        const int64_t n = 1 << 16;
        at::Tensor p = at::ones({n}, at::TensorOptions(device()).dtype(at::kBFloat16)).requires_grad_(true);
        AdamWBF16Options o;
        o.beta2 = 0.75, o.eps = 0;
        o.fused_kernel = fused;
        AdamWBF16 opt({ParamGroup{{"w"}, {p}, 1e-3, 0.0}}, make_gen(device(), 9), o);
        p.mutable_grad() = at::ones_like(p);
        opt.step();
        const at::Tensor w = p.detach().cpu().to(at::kDouble);
        const double lower = 1.0 - std::ldexp(1.0, -8);
        EXPECT_EQ(((w == 1.0) | (w == lower)).sum().item<int64_t>(), n);
        // P(lower) = 1e-3 / 2^-8 = 0.256; sd of the mean = 2^-8 sqrt(.256 * .744 / n) = 6.7e-6
        EXPECT_NEAR(w.mean().item<double>(), 1.0 - 1e-3, 3e-5);
        EXPECT_GT((w == lower).sum().item<int64_t>(), n / 8);
        const at::Tensor true_w = w + opt.state_dict().at("w.shift").cpu().to(at::kDouble);
        EXPECT_NEAR(true_w.mean().item<double>(), 1.0 - 1e-3, 2e-6);
        EXPECT_LE((true_w - (1.0 - 1e-3)).abs().max().item<double>(), 1e-5);  // shift: bf16 of < 2^-8
    }
}

TEST_P(AdamWBF16Flat, SameSeedSameBitsOtherSeedOtherBits) {
    const Problem pr(4);
    std::array<std::vector<at::Tensor>, 3> out;
    for (int r = 0; r < 3; ++r) {
        std::vector<at::Tensor> params;
        auto opt = make(device(), pr, params, 1e-2, 1.0, r == 2 ? 8 : 7);  // wd 1: decays every step
        run(*opt, params, pr, 0, 4);
        for (auto& p : params) out[r].push_back(p.detach().clone());
    }
    bool all_equal = true, any_diff = false;
    for (size_t i = 0; i < out[0].size(); ++i) {
        all_equal = all_equal && at::equal(out[0][i], out[1][i]);
        any_diff = any_diff || !at::equal(out[0][i], out[2][i]);
    }
    EXPECT_TRUE(all_equal);
    EXPECT_TRUE(any_diff);
}

// 6 steps straight == 3 steps, state_dict + generator state into a new optimizer, 3 more; the state
// keeps the per-parameter layout older checkpoints have.
TEST_P(AdamWBF16Flat, ResumeIsBitExactAndKeepsTheCheckpointLayout) {
    const Problem pr(6);
    const double lr = 1e-2, wd = 0.3;  // lr wd = 3e-3: decays land on different steps per parameter
    std::vector<at::Tensor> straight_params;
    auto straight = make(device(), pr, straight_params, lr, wd, 21);
    run(*straight, straight_params, pr, 0, 6);

    std::vector<at::Tensor> first_params = pr.params(device());
    at::Generator gen = make_gen(device(), 21);  // a handle: shares the state
    auto first = std::make_unique<AdamWBF16>(
        std::vector<ParamGroup>{ParamGroup{pr.names, first_params, lr, wd}}, gen, small_buckets());
    run(*first, first_params, pr, 0, 3);
    const TensorMap saved = first->state_dict();
    std::set<std::string> keys;
    for (const auto& [k, t] : saved) keys.insert(k);
    for (size_t i = 0; i < pr.names.size(); ++i) {
        const std::string& n = pr.names[i];
        for (const char* k : {"exp_avg", "exp_avg_sq", "shift"}) {
            const at::Tensor& t = saved.at(n + "." + k);
            EXPECT_EQ(t.scalar_type(), at::kBFloat16) << n << "." << k;
            EXPECT_EQ(t.sizes(), at::IntArrayRef(pr.shapes[i])) << n << "." << k;
            keys.erase(n + "." + k);
        }
        for (const char* k : {"step", "accumulated_decay"}) {
            const at::Tensor& t = saved.at(n + "." + k);
            EXPECT_EQ(t.scalar_type(), at::kDouble);
            EXPECT_EQ(t.dim(), 0);
            EXPECT_TRUE(t.device().is_cpu());
            keys.erase(n + "." + k);
        }
    }
    EXPECT_TRUE(keys.empty()) << *keys.begin();
    const auto gen_state = gen.get_state();

    // A fresh process: new parameters holding the saved weights, state and generator.
    std::vector<at::Tensor> resumed_params;
    for (const auto& p : first_params) resumed_params.push_back(p.detach().clone().requires_grad_(true));
    at::Generator gen2 = make_gen(device(), 999);
    gen2.set_state(gen_state);
    AdamWBF16 resumed({ParamGroup{pr.names, resumed_params, lr, wd}}, gen2, small_buckets());
    TensorMap copy;
    for (const auto& [k, t] : saved) copy[k] = t.clone();  // separate tensors, as read from a file
    resumed.load_state_dict(copy);
    run(resumed, resumed_params, pr, 3, 6);

    const TensorMap a = straight->state_dict(), b = resumed.state_dict();
    ASSERT_EQ(a.size(), b.size());
    for (const auto& [k, t] : a) EXPECT_TRUE(at::equal(t, b.at(k))) << k;
    for (size_t i = 0; i < straight_params.size(); ++i)
        EXPECT_TRUE(at::equal(straight_params[i], resumed_params[i])) << pr.names[i];
}

// The captured-step protocol on the CPU: set_lr, upload_lr, step, after_step under use_device_lr()
// with a changing LR gives the same bits as plain steps (decays included).
TEST_P(AdamWBF16Flat, DeviceLrProtocolEqualsPlainSteps) {
    const Problem pr(5);
    const std::vector<double> lrs{1e-2, 8e-3, 6e-3, 4e-3, 2e-3};
    std::vector<at::Tensor> plain_params, graph_params;
    auto plain = make(device(), pr, plain_params, lrs[0], 0.5, 5);
    auto graph = make(device(), pr, graph_params, lrs[0], 0.5, 5);
    graph->use_device_lr();
    for (int t = 0; t < 5; ++t) {
        plain->set_lr(lrs[t]);
        run(*plain, plain_params, pr, t, t + 1);
        graph->set_lr(lrs[t]);
        graph->upload_lr();
        run(*graph, graph_params, pr, t, t + 1);
        graph->after_step();
    }
    const TensorMap a = plain->state_dict(), b = graph->state_dict();
    for (const auto& [k, t] : a) EXPECT_TRUE(at::equal(t, b.at(k))) << k;
    for (size_t i = 0; i < plain_params.size(); ++i) EXPECT_TRUE(at::equal(plain_params[i], graph_params[i]));
    // A parameter without a gradient cannot be skipped by a captured step.
    graph->upload_lr();
    graph_params[1].mutable_grad().reset();
    EXPECT_THROW(graph->step(), Error);
}

// A parameter without a gradient is skipped with its state untouched; the others repack and go on.
TEST_P(AdamWBF16Flat, ParametersWithoutGradientKeepTheirState) {
    const Problem pr(3);
    std::vector<at::Tensor> params;
    auto opt = make(device(), pr, params, 1e-2, 0.0, 4);
    run(*opt, params, pr, 0, 1);
    const TensorMap before = opt->state_dict();
    const at::Tensor bias_before = params[1].detach().clone();
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = pr.grads[1][i].to(device());
    params[1].mutable_grad().reset();
    opt->step();
    const TensorMap after = opt->state_dict();
    for (const char* k : {"exp_avg", "exp_avg_sq", "shift", "step", "accumulated_decay"})
        EXPECT_TRUE(at::equal(before.at(std::string("a.bias.") + k), after.at(std::string("a.bias.") + k)))
            << k;
    EXPECT_TRUE(at::equal(bias_before, params[1]));
    EXPECT_EQ(after.at("a.weight.step").item<double>(), 2.0);
    EXPECT_FALSE(at::equal(before.at("a.weight.exp_avg_sq"), after.at("a.weight.exp_avg_sq")));
    // Back to all four: a.bias (step 1) gets a bucket apart from its neighbours (step 2).
    run(*opt, params, pr, 2, 3);
    const TensorMap last = opt->state_dict();
    EXPECT_EQ(last.at("a.bias.step").item<double>(), 2.0);
    EXPECT_EQ(last.at("c.big.step").item<double>(), 3.0);
}

// The fused CUDA kernel reads each gradient and weight in place (chunks of up to 2^20 elements, up
// to 100 per launch) unless a gradient is not contiguous, when the bucket goes through flat copies.
// Both give the same bits: an element's random numbers depend on its index in the bucket only.
// Sizes: 130 small parameters and one of 2.5 M elements (several chunks, several launches), and odd
// sizes that shift the state arrays off 16-byte alignment (the one-element loop).
TEST(AdamWBF16Cuda, InPlaceAndCopiedBucketsGiveTheSameBits) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const at::Device cuda(at::kCUDA, 0);
    std::vector<std::string> names;
    std::vector<std::vector<int64_t>> shapes;
    for (int i = 0; i < 130; ++i) {
        names.push_back("small" + std::to_string(i));
        shapes.push_back(i % 7 == 3 ? std::vector<int64_t>{3, 5} : std::vector<int64_t>{24, 40});
    }
    names.push_back("big");
    shapes.push_back({1250, 2000});
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(99);
    std::vector<at::Tensor> init, grads;
    for (const auto& s : shapes) {
        init.push_back(at::randn(s, gen).to(at::kBFloat16));
        grads.push_back((at::randn(s, gen) * 1e-2).to(at::kBFloat16));
    }
    std::array<std::vector<at::Tensor>, 2> out;
    for (int copied = 0; copied < 2; ++copied) {
        std::vector<at::Tensor> params;
        for (const auto& t : init) params.push_back(t.to(cuda).requires_grad_(true));
        AdamWBF16 opt({ParamGroup{names, params, 1e-1, 1e-2}}, make_gen(cuda, 5), AdamWBF16Options{});
        for (int step = 0; step < 2; ++step) {
            for (size_t i = 0; i < params.size(); ++i) {
                at::Tensor g = grads[i].to(cuda) * (step + 1);
                // copied: the big gradient as a transposed view (same values, not contiguous)
                if (copied && names[i] == "big") g = g.t().contiguous().t();
                params[i].mutable_grad() = g;
            }
            opt.step();
        }
        for (auto& p : params) out[copied].push_back(p.detach().cpu());
        for (const auto& [key, value] : opt.state_dict())
            if (value.numel() > 1) out[copied].push_back(value.cpu());
    }
    ASSERT_EQ(out[0].size(), out[1].size());
    for (size_t i = 0; i < out[0].size(); ++i) EXPECT_TRUE(at::equal(out[0][i], out[1][i])) << i;
    // And the step moved every weight's bits somewhere (the kernel ran on every chunk).
    for (size_t i = 0; i < init.size(); ++i) EXPECT_FALSE(at::equal(out[0][i], init[i])) << names[i];
}

// grad_clip_method value inside the update (clamp_gradients_in_step) gives the bits of clamping the
// gradients first (clip_grad_value) and stepping; the gradients themselves stay unclamped. A bound
// that is not a bf16 value (0.007) is rounded as the in-place clamp of a bf16 gradient rounds it.
TEST_P(AdamWBF16Flat, ClampInsideTheStepEqualsClippingFirst) {
    const Problem pr(3);
    for (double clip : {0.007, 0.01}) {
        std::vector<at::Tensor> a_params, b_params;
        auto a = make(device(), pr, a_params, 1e-2, 0.1, 7);
        auto b = make(device(), pr, b_params, 1e-2, 0.1, 7);
        ASSERT_TRUE(b->clamp_gradients_in_step(clip));
        for (int t = 0; t < 3; ++t) {
            for (size_t i = 0; i < a_params.size(); ++i) {
                a_params[i].mutable_grad() = pr.grads[t][i].to(device());
                b_params[i].mutable_grad() = pr.grads[t][i].to(device());
            }
            clip_grad_value(a_params, clip);
            a->step();
            b->step();
            // b's gradients were read clamped, not written clamped
            EXPECT_TRUE(at::equal(b_params[0].grad().cpu(), pr.grads[t][0])) << "step " << t;
        }
        for (size_t i = 0; i < a_params.size(); ++i)
            EXPECT_TRUE(at::equal(a_params[i].detach().cpu(), b_params[i].detach().cpu()))
                << clip << " " << i;
        const TensorMap sa = a->state_dict(), sb = b->state_dict();
        for (const auto& [key, value] : sa) EXPECT_TRUE(at::equal(value.cpu(), sb.at(key).cpu())) << key;
    }
    // The gradients this problem draws reach beyond both bounds: the clamp is exercised.
    EXPECT_GT(pr.grads[0][2].abs().max().item<double>(), 0.01);
}

// ---- fp16: skip_step_on_overflow ------------------------------------------------------------------

// One step with step t's gradients at `lr`; `overflow`: found_inf is 1 and the gradients hold an inf
// and a NaN (an overflowed fp16 backward after unscaling). device_lr: the captured-step protocol.
void flagged_step(AdamWBF16& opt, std::vector<at::Tensor>& params, const Problem& pr, int t, double lr,
                  const at::Tensor& found_inf, bool overflow, bool device_lr) {
    opt.set_lr(lr);
    for (size_t i = 0; i < params.size(); ++i) {
        at::Tensor grad = pr.grads[t][i].to(params[i].device()).clone();
        if (overflow) {
            grad.view(-1)[0] = std::numeric_limits<float>::infinity();
            grad.view(-1)[grad.numel() - 1] = std::numeric_limits<float>::quiet_NaN();
        }
        params[i].mutable_grad() = grad;
    }
    found_inf.fill_(overflow ? 1.0 : 0.0);
    if (device_lr) opt.upload_lr();
    opt.step();
    if (device_lr) opt.after_step();
}

void expect_same_state(const AdamWBF16& a, const std::vector<at::Tensor>& pa, const AdamWBF16& b,
                       const std::vector<at::Tensor>& pb, const std::string& where) {
    SCOPED_TRACE(where);
    for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(at::equal(pa[i], pb[i])) << "parameter " << i;
    const TensorMap sa = a.state_dict(), sb = b.state_dict();
    ASSERT_EQ(sa.size(), sb.size());
    for (const auto& [k, t] : sa) EXPECT_TRUE(sb.count(k) && at::equal(t, sb.at(k))) << k;
}

// An overflowed step leaves the weights, m, v, shift, the step counts and the decay accumulators
// bit for bit as they were (plain steps and the captured-step protocol; the first step, and one
// after two clean steps with decays due every step: lr wd = 5e-3).
TEST_P(AdamWBF16Flat, OverflowedStepChangesNothing) {
    const Problem pr(4);
    for (bool device_lr : {false, true}) {
        SCOPED_TRACE(device_lr ? "device lr" : "plain");
        std::vector<at::Tensor> params, reference_params;
        auto opt = make(device(), pr, params, 1e-2, 0.5, 3);
        auto reference = make(device(), pr, reference_params, 1e-2, 0.5, 3);  // never stepped
        const at::Tensor found_inf = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device()));
        ASSERT_TRUE(opt->skip_step_on_overflow(found_inf));
        if (device_lr) opt->use_device_lr();
        flagged_step(*opt, params, pr, 0, 1e-2, found_inf, true, device_lr);
        for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i], reference_params[i]));
        // State made for the first step (zeros, the decay starts) may exist; it must be untouched.
        for (const auto& [k, t] : opt->state_dict()) {
            if (k.find(".step") != std::string::npos) {
                EXPECT_EQ(t.item<double>(), 0.0) << k;
            }
            if (k.find("exp_avg") != std::string::npos || k.find("shift") != std::string::npos) {
                EXPECT_EQ(t.abs().max().item<float>(), 0.0f) << k;
            }
        }
        for (int t = 0; t < 2; ++t) flagged_step(*opt, params, pr, t, 1e-2, found_inf, false, device_lr);
        std::vector<at::Tensor> before;
        for (const auto& p : params) before.push_back(p.detach().clone());
        const TensorMap state = opt->state_dict();
        EXPECT_EQ(state.at("a.weight.step").item<double>(), 2.0);
        flagged_step(*opt, params, pr, 2, 2e-2, found_inf, true, device_lr);
        for (size_t i = 0; i < params.size(); ++i)
            EXPECT_TRUE(at::equal(before[i], params[i])) << pr.names[i];
        const TensorMap after = opt->state_dict();
        ASSERT_EQ(after.size(), state.size());
        for (const auto& [k, t] : state) EXPECT_TRUE(at::equal(t, after.at(k))) << k;
    }
}

// With the flag 0, steps keep the bits of the optimizer without it (no decay due: wd 0); with
// decays due at every step (lr wd = 5e-3) the counts, accumulators, weights and moments keep their
// bits and the decayed shift stays within a bf16 rounding of the host path's.
TEST_P(AdamWBF16Flat, CleanStepsKeepTheBitsOfThePathWithoutTheFlag) {
    const Problem pr(5);
    const std::vector<double> lrs{1e-2, 8e-3, 6e-3, 4e-3, 2e-3};
    for (bool device_lr : {false, true}) {
        SCOPED_TRACE(device_lr ? "device lr" : "plain");
        std::vector<at::Tensor> plain_params, flagged_params;
        auto plain = make(device(), pr, plain_params, lrs[0], 0.0, 5);
        auto flagged = make(device(), pr, flagged_params, lrs[0], 0.0, 5);
        const at::Tensor found_inf = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device()));
        flagged->skip_step_on_overflow(found_inf);
        if (device_lr) flagged->use_device_lr();
        for (int t = 0; t < 5; ++t) {
            plain->set_lr(lrs[t]);
            run(*plain, plain_params, pr, t, t + 1);
            flagged_step(*flagged, flagged_params, pr, t, lrs[t], found_inf, false, device_lr);
            expect_same_state(*plain, plain_params, *flagged, flagged_params,
                              "step " + std::to_string(t + 1));
        }
    }
    std::vector<at::Tensor> plain_params, flagged_params;
    auto plain = make(device(), pr, plain_params, 1e-2, 0.5, 6);
    auto flagged = make(device(), pr, flagged_params, 1e-2, 0.5, 6);
    const at::Tensor found_inf = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device()));
    flagged->skip_step_on_overflow(found_inf);
    run(*plain, plain_params, pr, 0, 1);
    flagged_step(*flagged, flagged_params, pr, 0, 1e-2, found_inf, false, false);
    for (size_t i = 0; i < plain_params.size(); ++i)
        EXPECT_TRUE(at::equal(plain_params[i], flagged_params[i]));
    const TensorMap a = plain->state_dict(), b = flagged->state_dict();
    for (const auto& [k, t] : a) {
        if (k.find("shift") == std::string::npos) {
            EXPECT_TRUE(at::equal(t, b.at(k))) << k;
        } else {
            EXPECT_LE(max_abs_diff(t, b.at(k)), t.abs().max().item<double>() * 0x1p-7) << k;
            EXPECT_GT(t.abs().max().item<double>(), 0.0) << k;
        }
    }
}

// Overflows after one step and twice in a row later: the run equals one with the clean steps only
// (the overflowed steps still draw rounding noise, so the generator is set back after each), decays
// included. (An overflowed first step draws the decay starts too: OverflowedStepChangesNothing.)
TEST_P(AdamWBF16Flat, SkippedStepsAreAsIfTheyNeverHappened) {
    const Problem pr(6);
    const std::set<int> overflow_before{1, 4};
    for (bool device_lr : {false, true}) {
        SCOPED_TRACE(device_lr ? "device lr" : "plain");
        std::vector<at::Tensor> clean_params, skipping_params;
        auto clean = make(device(), pr, clean_params, 1e-2, 0.3, 8);
        auto skipping = make(device(), pr, skipping_params, 1e-2, 0.3, 8);
        const auto options = at::TensorOptions().dtype(at::kFloat).device(device());
        const at::Tensor clean_inf = at::zeros({}, options), skipping_inf = at::zeros({}, options);
        clean->skip_step_on_overflow(clean_inf);
        skipping->skip_step_on_overflow(skipping_inf);
        if (device_lr) {
            clean->use_device_lr();
            skipping->use_device_lr();
        }
        at::Generator gen = skipping->generators().front();
        for (int t = 0; t < 6; ++t) {
            const double lr = 1e-2 * (1.0 - 0.1 * t);
            if (overflow_before.count(t)) {
                const auto state = gen.get_state();
                for (int k = 0; k < (t == 4 ? 2 : 1); ++k)
                    flagged_step(*skipping, skipping_params, pr, t, 3 * lr, skipping_inf, true, device_lr);
                gen.set_state(state);
            }
            flagged_step(*clean, clean_params, pr, t, lr, clean_inf, false, device_lr);
            flagged_step(*skipping, skipping_params, pr, t, lr, skipping_inf, false, device_lr);
            expect_same_state(*clean, clean_params, *skipping, skipping_params,
                              "step " + std::to_string(t + 1));
        }
    }
}

// A checkpoint of a flagged run (counts read back from the device) resumes into a fresh flagged
// optimizer like the run that never stopped.
TEST_P(AdamWBF16Flat, FlaggedRunResumesExactly) {
    const Problem pr(6);
    const auto options = at::TensorOptions().dtype(at::kFloat).device(device());
    std::vector<at::Tensor> straight_params;
    auto straight = make(device(), pr, straight_params, 1e-2, 0.3, 9);
    const at::Tensor straight_inf = at::zeros({}, options);
    straight->skip_step_on_overflow(straight_inf);
    for (int t = 0; t < 6; ++t)
        flagged_step(*straight, straight_params, pr, t, 1e-2, straight_inf, false, true);

    std::vector<at::Tensor> first_params;
    auto first = make(device(), pr, first_params, 1e-2, 0.3, 9);
    const at::Tensor first_inf = at::zeros({}, options);
    first->skip_step_on_overflow(first_inf);
    for (int t = 0; t < 3; ++t) flagged_step(*first, first_params, pr, t, 1e-2, first_inf, false, true);
    const TensorMap saved = first->state_dict();
    const auto gen_state = first->generators().front().get_state();
    std::vector<at::Tensor> resumed_params;
    auto resumed = make(device(), pr, resumed_params, 1e-2, 0.3, 1);
    for (size_t i = 0; i < resumed_params.size(); ++i) {
        at::NoGradGuard no_grad;
        resumed_params[i].copy_(first_params[i]);
    }
    const at::Tensor resumed_inf = at::zeros({}, options);
    resumed->skip_step_on_overflow(resumed_inf);
    resumed->load_state_dict(saved);
    resumed->generators().front().set_state(gen_state);
    for (int t = 3; t < 6; ++t) flagged_step(*resumed, resumed_params, pr, t, 1e-2, resumed_inf, false, true);
    expect_same_state(*straight, straight_params, *resumed, resumed_params, "after the resume");
}

INSTANTIATE_TEST_SUITE_P(Devices, AdamWBF16Flat, ::testing::Values(c10::kCPU, c10::kCUDA),
                         [](const ::testing::TestParamInfo<c10::DeviceType>& info) {
                             return info.param == c10::kCPU ? std::string("Cpu") : std::string("Cuda");
                         });

// Older checkpoints lacking a key are refused with the key named.
TEST(AdamWBF16State, RefusesStateFromAnotherOptimizer) {
    at::Tensor p = at::zeros({3}, at::kBFloat16).requires_grad_(true);
    AdamWBF16 opt({ParamGroup{{"w"}, {p}, 1e-2, 0.0}}, at::make_generator<at::CPUGeneratorImpl>(1));
    const TensorMap adamw_state{{"w.exp_avg", at::zeros({3}, at::kBFloat16)},
                                {"w.exp_avg_sq", at::zeros({3}, at::kBFloat16)},
                                {"w.step", at::scalar_tensor(1.0, at::kFloat)}};
    try {
        opt.load_state_dict(adamw_state);
        FAIL() << "loaded AdamW state";
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("has no shift"), std::string::npos) << e.what();
    }
}

}  // namespace
}  // namespace test_adamw_bf16_local
}  // namespace dtune::train
