// The captured-step protocol of Lion, SGD and Adafactor (optimizer_graph.cpp) on the CPU: under
// use_device_lr(), set_lr + upload_lr + step + after_step with a changing LR per group gives the same
// bits as the host-lr path (parameters and state_dict()), over enough steps that Adafactor's
// t^beta2_decay changes and its min(lr, 1/sqrt(t)) crosses from lr to 1/sqrt(t); checkpoints round
// trip mid-run (device -> device, host -> device) and continue identically; state the host path
// would not have yet (SGD buffers not started, Adafactor moments never stepped) is not saved;
// parameters that started at different steps (two cohorts) still match; a missing gradient is refused.
// fp16 (skip_step_on_overflow): an overflowed step changes no bit of the weights or state, clean
// steps keep today's bits, and skipped steps leave the run as if they never happened.
// On a CUDA device, a captured step() replays like eager device-lr steps, overflows included.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#ifdef DTUNE_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <functional>
#include <limits>
#include <memory>
#include <set>

#include "core/error.h"
#include "train/optimizer.h"

namespace dtune::train {
namespace test_optimizer_graph_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using Factory = std::function<std::unique_ptr<Optimizer>(std::vector<ParamGroup>)>;

// Two groups (different weight decays and base LRs) of matrices, a 3-D tensor (Adafactor factors
// its last two dims), a column and vectors.
struct Problem {
    std::vector<std::vector<std::string>> names{{"a.weight", "a.bias", "b.conv"}, {"c.weight", "c.bias"}};
    std::vector<std::vector<std::vector<int64_t>>> shapes{{{6, 5}, {7}, {2, 3, 4}}, {{9, 1}, {3}}};
    std::vector<double> base_lr{0.6, 0.05};
    std::vector<double> weight_decay{0.01, 0.0};
    std::vector<at::Tensor> init;                // flat over groups
    std::vector<std::vector<at::Tensor>> grads;  // [step][param], flat over groups

    explicit Problem(int steps) {
        at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(77);
        for (const auto& group : shapes)
            for (const auto& s : group) init.push_back(at::randn(s, gen));
        for (int t = 0; t < steps; ++t) {
            grads.emplace_back();
            for (const auto& p : init) grads.back().push_back(at::randn(p.sizes(), gen) * (0.1 + 0.3 * t));
        }
    }
    // Fresh leaf parameters at the initial values on `device`, and the groups over them.
    std::vector<ParamGroup> groups(std::vector<at::Tensor>& params, at::Device device = at::kCPU) const {
        params.clear();
        for (const auto& t : init) params.push_back(t.clone().to(device).requires_grad_(true));
        std::vector<ParamGroup> out;
        size_t k = 0;
        for (size_t g = 0; g < names.size(); ++g) {
            ParamGroup group{names[g], {}, base_lr[g], weight_decay[g]};
            for (size_t i = 0; i < names[g].size(); ++i) group.params.push_back(params[k++]);
            out.push_back(std::move(group));
        }
        return out;
    }
};

// The LR multiplier of step t: falls, then rises (a warm restart), so no two neighbours are equal.
double multiplier(int t) {
    static const double m[] = {1.0, 0.9, 0.7, 0.45, 0.3, 0.5, 0.8, 0.6, 0.25, 0.1};
    return m[t % 10];
}

// Steps [from, to): `skip` names a parameter (flat index) without a gradient at step `skip_at`.
void run(Optimizer& opt, std::vector<at::Tensor>& params, const Problem& pr, bool device, int from, int to,
         int skip = -1, int skip_at = -1) {
    for (int t = from; t < to; ++t) {
        for (size_t g = 0; g < opt.param_groups().size(); ++g)
            opt.param_groups()[g].lr = pr.base_lr[g] * multiplier(t);
        for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = pr.grads[t][i].clone();
        if (t == skip_at) params[skip].mutable_grad().reset();
        if (device) opt.upload_lr();
        opt.step();
        if (device) opt.after_step();
        opt.zero_grad();
    }
}

// Same keys, same bits.
void expect_same(const Optimizer& a, const std::vector<at::Tensor>& pa, const Optimizer& b,
                 const std::vector<at::Tensor>& pb, const std::string& where) {
    SCOPED_TRACE(where);
    for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(at::equal(pa[i], pb[i])) << "parameter " << i;
    const TensorMap sa = a.state_dict(), sb = b.state_dict();
    std::set<std::string> ka, kb;
    for (const auto& [k, v] : sa) ka.insert(k);
    for (const auto& [k, v] : sb) kb.insert(k);
    ASSERT_EQ(ka, kb);
    for (const auto& [k, v] : sa) {
        EXPECT_EQ(v.scalar_type(), sb.at(k).scalar_type()) << k;
        EXPECT_TRUE(at::equal(v, sb.at(k))) << k;
    }
}

struct Case {
    const char* name;
    Factory make;
};

const std::vector<Case>& cases() {
    static const std::vector<Case> all = {
        {"lion", [](std::vector<ParamGroup> g) { return std::make_unique<Lion>(std::move(g)); }},
        {"lion_betas",
         [](std::vector<ParamGroup> g) {
             return std::make_unique<Lion>(std::move(g), LionOptions{0.95, 0.98});
         }},
        {"sgd_plain", [](std::vector<ParamGroup> g) { return std::make_unique<SGD>(std::move(g)); }},
        {"sgd_momentum",
         [](std::vector<ParamGroup> g) {
             return std::make_unique<SGD>(std::move(g), SGDOptions{0.9, 0.0, false});
         }},
        {"sgd_dampening",
         [](std::vector<ParamGroup> g) {
             return std::make_unique<SGD>(std::move(g), SGDOptions{0.8, 0.3, false});
         }},
        {"sgd_nesterov",
         [](std::vector<ParamGroup> g) {
             return std::make_unique<SGD>(std::move(g), SGDOptions{0.9, 0.0, true});
         }},
        {"adafactor", [](std::vector<ParamGroup> g) { return std::make_unique<Adafactor>(std::move(g)); }},
        {"adafactor_clipped",
         [](std::vector<ParamGroup> g) {
             AdafactorOptions o;
             o.d = 0.5;  // clips most updates: the device-side max(1, RMS / d) is exercised
             o.eps1 = 1e-20;
             return std::make_unique<Adafactor>(std::move(g), o);
         }},
    };
    return all;
}

// Adafactor: group a's min(lr, 1/sqrt(t)) is lr up to t = 6, 1/sqrt(t) at t = 7 and 8, lr at t = 9.
constexpr int kSteps = 9;

TEST(OptimizerDeviceLr, EqualsTheHostLrPathBitForBit) {
    const Problem pr(kSteps);
    for (const Case& c : cases()) {
        std::vector<at::Tensor> host_params, device_params;
        auto host = c.make(pr.groups(host_params));
        auto device = c.make(pr.groups(device_params));
        device->use_device_lr();
        for (int t = 0; t < kSteps; ++t) {
            run(*host, host_params, pr, false, t, t + 1);
            run(*device, device_params, pr, true, t, t + 1);
            expect_same(*host, host_params, *device, device_params,
                        std::string(c.name) + " step " + std::to_string(t + 1));
        }
        // The run moved the weights (a step that did nothing would also be equal).
        EXPECT_FALSE(at::equal(device_params[0], pr.init[0])) << c.name;
    }
}

// A checkpoint mid-run, loaded into a fresh optimizer on the device path, continues like the run
// that never stopped: saved by the device path, and saved by the host path (an eager run resumed
// with graphs).
TEST(OptimizerDeviceLr, CheckpointMidRunContinuesIdentically) {
    const Problem pr(kSteps);
    for (const Case& c : cases()) {
        SCOPED_TRACE(c.name);
        std::vector<at::Tensor> straight_params;
        auto straight = c.make(pr.groups(straight_params));
        straight->use_device_lr();
        run(*straight, straight_params, pr, true, 0, kSteps);
        for (bool saved_by_device : {true, false}) {
            SCOPED_TRACE(saved_by_device ? "saved by the device path" : "saved by the host path");
            std::vector<at::Tensor> params;
            TensorMap saved;
            {
                auto first = c.make(pr.groups(params));
                if (saved_by_device) first->use_device_lr();
                run(*first, params, pr, saved_by_device, 0, 4);
                saved = first->state_dict();
            }
            std::vector<at::Tensor> resumed_params;
            auto resumed = c.make(pr.groups(resumed_params));
            for (size_t i = 0; i < params.size(); ++i) {
                at::NoGradGuard no_grad;
                resumed_params[i].copy_(params[i]);  // the checkpoint's weights
            }
            resumed->use_device_lr();
            resumed->load_state_dict(saved);
            run(*resumed, resumed_params, pr, true, 4, kSteps);
            expect_same(*straight, straight_params, *resumed, resumed_params, "after the resume");
        }
    }
}

// Parameters whose state started at different steps (one had no gradient at step 2 of a host-path
// run): after a load, the device path keeps them apart (SGD: one buffer started, one not; Adafactor:
// two step counts) and matches the host path step for step. Before its first step the device path
// saves no state the host path would not have.
TEST(OptimizerDeviceLr, StateStartedAtDifferentStepsMatchesTheHostPath) {
    const Problem pr(kSteps);
    for (const Case& c : cases()) {
        SCOPED_TRACE(c.name);
        std::vector<at::Tensor> host_params, device_params;
        auto host = c.make(pr.groups(host_params));
        run(*host, host_params, pr, false, 0, 1, /*skip=*/1, /*skip_at=*/0);  // a.bias: no state yet
        const TensorMap after_one = host->state_dict();
        auto device = c.make(pr.groups(device_params));
        for (size_t i = 0; i < host_params.size(); ++i) {
            at::NoGradGuard no_grad;
            device_params[i].copy_(host_params[i]);
        }
        device->use_device_lr();
        device->load_state_dict(after_one);
        device->upload_lr();  // creates the missing state, outside any capture
        const TensorMap before = device->state_dict();
        // Lion's zero moment for a.bias is what its first step starts from either way.
        if (std::string(c.name).rfind("lion", 0) != 0) {
            EXPECT_EQ(before.size(), after_one.size());
        }
        for (const auto& [k, v] : after_one) EXPECT_TRUE(before.count(k) && at::equal(v, before.at(k))) << k;
        for (int t = 1; t < kSteps; ++t) {
            run(*host, host_params, pr, false, t, t + 1);
            run(*device, device_params, pr, true, t, t + 1);
            expect_same(*host, host_params, *device, device_params, "step " + std::to_string(t + 1));
        }
    }
}

// A captured step updates a fixed set of parameters: one without a gradient is refused, by name.
TEST(OptimizerDeviceLr, RefusesAMissingGradient) {
    const Problem pr(2);
    for (const Case& c : cases()) {
        SCOPED_TRACE(c.name);
        std::vector<at::Tensor> params;
        auto opt = c.make(pr.groups(params));
        opt->use_device_lr();
        run(*opt, params, pr, true, 0, 1);
        for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = pr.grads[1][i].clone();
        params[4].mutable_grad().reset();
        opt->upload_lr();
        try {
            opt->step();
            ADD_FAILURE() << "no error";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("\"c.bias\" has no gradient"), std::string::npos)
                << e.what();
        }
    }
}

// ---- fp16: skip_step_on_overflow ------------------------------------------------------------------

// One step at multiplier(t) with step t's gradients; `overflow`: found_inf is 1 and every gradient
// holds an inf and a NaN (what an overflowed fp16 backward leaves after unscaling), at another LR.
void flagged_step(Optimizer& opt, std::vector<at::Tensor>& params, const Problem& pr, bool device, int t,
                  at::Tensor& found_inf, bool overflow) {
    for (size_t g = 0; g < opt.param_groups().size(); ++g)
        opt.param_groups()[g].lr = pr.base_lr[g] * (overflow ? 0.77 : multiplier(t));
    for (size_t i = 0; i < params.size(); ++i) {
        at::Tensor grad = pr.grads[t][i].clone();
        if (overflow) {
            grad.view(-1)[0] = std::numeric_limits<float>::infinity();
            grad.view(-1)[grad.numel() - 1] = std::numeric_limits<float>::quiet_NaN();
        }
        params[i].mutable_grad() = grad.to(params[i].device());
    }
    found_inf.fill_(overflow ? 1.0 : 0.0);
    if (device) opt.upload_lr();
    opt.step();
    if (device) opt.after_step();
    opt.zero_grad();
}

// Copies of the weights and the state, to compare against later.
struct Snapshot {
    std::vector<at::Tensor> params;
    TensorMap state;
    Snapshot(const Optimizer& opt, const std::vector<at::Tensor>& p) : state(opt.state_dict()) {
        for (const auto& t : p) params.push_back(t.detach().clone());
    }
    void expect_equal(const Optimizer& opt, const std::vector<at::Tensor>& p,
                      const std::string& where) const {
        SCOPED_TRACE(where);
        for (size_t i = 0; i < p.size(); ++i) EXPECT_TRUE(at::equal(params[i], p[i])) << "parameter " << i;
        const TensorMap now = opt.state_dict();
        ASSERT_EQ(now.size(), state.size());
        for (const auto& [k, v] : state) EXPECT_TRUE(now.count(k) && at::equal(v, now.at(k))) << k;
    }
};

// An overflowed step (found_inf 1, non-finite gradients) leaves the weights and every state tensor,
// step counts included, bit for bit as they were, on the host-lr path (which reads the flag) and the
// device-lr path (which selects on the device); the first step overflowing included (SGD's buffers
// and Adafactor's moments stay unstarted), and a later one.
TEST(OptimizerOverflowSkip, OverflowedStepChangesNothing) {
    const Problem pr(kSteps);
    for (const Case& c : cases()) {
        for (bool device : {false, true}) {
            SCOPED_TRACE(std::string(c.name) + (device ? " device-lr" : " host-lr"));
            std::vector<at::Tensor> params;
            auto opt = c.make(pr.groups(params));
            at::Tensor found_inf = at::zeros({}, at::kFloat);
            ASSERT_TRUE(opt->skip_step_on_overflow(found_inf));
            if (device) {
                opt->use_device_lr();
                opt->upload_lr();  // Lion's zero moments exist from here on, stepped or not
            }
            const Snapshot fresh(*opt, params);
            flagged_step(*opt, params, pr, device, 0, found_inf, true);
            fresh.expect_equal(*opt, params, "a first step that overflowed");
            for (int t = 0; t < 3; ++t) flagged_step(*opt, params, pr, device, t, found_inf, false);
            const Snapshot before(*opt, params);
            EXPECT_FALSE(at::equal(before.params[0], pr.init[0])) << "the clean steps trained";
            flagged_step(*opt, params, pr, device, 3, found_inf, true);
            before.expect_equal(*opt, params, "an overflow after 3 steps");
        }
    }
}

// With the flag set up but 0 at every step, both paths give the bits of the host-lr path without
// it (today's path), step for step.
TEST(OptimizerOverflowSkip, CleanStepsEqualThePathWithoutTheFlag) {
    const Problem pr(kSteps);
    for (const Case& c : cases()) {
        for (bool device : {false, true}) {
            SCOPED_TRACE(std::string(c.name) + (device ? " device-lr" : " host-lr"));
            std::vector<at::Tensor> plain_params, flagged_params;
            auto plain = c.make(pr.groups(plain_params));
            auto flagged = c.make(pr.groups(flagged_params));
            at::Tensor found_inf = at::zeros({}, at::kFloat);
            flagged->skip_step_on_overflow(found_inf);
            if (device) flagged->use_device_lr();
            for (int t = 0; t < kSteps; ++t) {
                run(*plain, plain_params, pr, false, t, t + 1);
                flagged_step(*flagged, flagged_params, pr, device, t, found_inf, false);
                expect_same(*plain, plain_params, *flagged, flagged_params, "step " + std::to_string(t + 1));
            }
        }
    }
}

// Overflows first, after 3 clean steps and twice in a row later: the run equals the clean steps
// alone (Adafactor's t and min(lr, 1/sqrt(t)), SGD's buffer start, the moments), and a checkpoint
// after it resumes like one without overflows.
TEST(OptimizerOverflowSkip, SkippedStepsAreAsIfTheyNeverHappened) {
    const Problem pr(kSteps);
    const std::set<int> overflow_before{0, 3, 6};
    for (const Case& c : cases()) {
        for (bool device : {false, true}) {
            SCOPED_TRACE(std::string(c.name) + (device ? " device-lr" : " host-lr"));
            std::vector<at::Tensor> plain_params, flagged_params;
            auto plain = c.make(pr.groups(plain_params));
            if (device) plain->use_device_lr();
            auto flagged = c.make(pr.groups(flagged_params));
            at::Tensor found_inf = at::zeros({}, at::kFloat);
            flagged->skip_step_on_overflow(found_inf);
            if (device) flagged->use_device_lr();
            for (int t = 0; t < kSteps; ++t) {
                if (overflow_before.count(t)) {
                    flagged_step(*flagged, flagged_params, pr, device, t, found_inf, true);
                    if (t == 6) flagged_step(*flagged, flagged_params, pr, device, t, found_inf, true);
                }
                run(*plain, plain_params, pr, device, t, t + 1);
                flagged_step(*flagged, flagged_params, pr, device, t, found_inf, false);
                expect_same(*plain, plain_params, *flagged, flagged_params, "step " + std::to_string(t + 1));
            }
        }
    }
}

#ifdef DTUNE_WITH_CUDA

// On a CUDA device: each optimizer's step() captured once (after one eager step, as GraphedStep
// warms up) and replayed with new gradients and LRs gives the weights and state of eager device-lr
// steps. SGD's momentum, dampening and nesterov are checked here only (the trainer's torch-sgd has
// no momentum key). fp16: with skip_step_on_overflow, steps 1 (eager, before the capture) and 5 (a
// replay) overflow, and the replay leaves the weights and state as they were. Skipped without CUDA.
TEST(OptimizerDeviceLrGpu, CapturedStepReplaysLikeEagerSteps) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const at::Device cuda(at::kCUDA, 0);
    const Problem pr(kSteps);
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, 0);  // captures need one
    const c10::cuda::CUDAStreamGuard on_side(side);
    for (bool fp16 : {false, true})
        for (const Case& c : cases()) {
            SCOPED_TRACE(std::string(c.name) + (fp16 ? " fp16" : ""));
            std::vector<at::Tensor> eager_params, graph_params;
            auto eager = c.make(pr.groups(eager_params, cuda));
            auto graphed = c.make(pr.groups(graph_params, cuda));
            const at::Tensor eager_inf = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(cuda));
            const at::Tensor graph_inf = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(cuda));
            if (fp16) {
                ASSERT_TRUE(eager->skip_step_on_overflow(eager_inf));
                ASSERT_TRUE(graphed->skip_step_on_overflow(graph_inf));
            }
            eager->use_device_lr();
            graphed->use_device_lr();
            std::vector<at::Tensor> grads;  // the captured step's gradients, at fixed addresses
            for (const auto& p : graph_params) grads.push_back(at::zeros_like(p));
            at::cuda::CUDAGraph graph;
            for (int t = 0; t < kSteps; ++t) {
                for (size_t g = 0; g < pr.base_lr.size(); ++g) {
                    eager->param_groups()[g].lr = pr.base_lr[g] * multiplier(t);
                    graphed->param_groups()[g].lr = pr.base_lr[g] * multiplier(t);
                }
                const bool overflow = fp16 && (t == 0 || t == 4);
                for (size_t i = 0; i < eager_params.size(); ++i) {
                    at::Tensor grad = pr.grads[t][i].clone();
                    if (overflow) grad.view(-1)[0] = std::numeric_limits<float>::infinity();
                    eager_params[i].mutable_grad() = grad.to(cuda);
                    grads[i].copy_(grad.to(cuda));
                    graph_params[i].mutable_grad() = grads[i];
                }
                eager_inf.fill_(overflow ? 1.0 : 0.0);
                graph_inf.fill_(overflow ? 1.0 : 0.0);
                std::vector<at::Tensor> before;
                for (const auto& p : graph_params) before.push_back(p.detach().clone());
                const TensorMap state_before = t == 4 ? graphed->state_dict() : TensorMap{};
                eager->upload_lr();
                eager->step();
                eager->after_step();
                graphed->upload_lr();  // outside the capture, before the replay
                if (t == 0) {
                    graphed->step();  // the warm-up: state and scalars exist before the capture
                } else {
                    if (t == 1) {
                        graph.capture_begin();
                        graphed->step();
                        graph.capture_end();
                    }
                    graph.replay();
                }
                graphed->after_step();
                if (overflow) {
                    for (size_t i = 0; i < graph_params.size(); ++i)
                        EXPECT_TRUE(at::equal(before[i], graph_params[i]))
                            << "step " << t + 1 << " parameter " << i;
                    if (t == 4) {
                        const TensorMap after = graphed->state_dict();
                        ASSERT_EQ(after.size(), state_before.size());
                        for (const auto& [k, v] : state_before) EXPECT_TRUE(at::equal(v, after.at(k))) << k;
                    }
                }
            }
            side.synchronize();
            auto close = [](const at::Tensor& a, const at::Tensor& b) {
                return at::allclose(a.cpu().to(at::kDouble), b.cpu().to(at::kDouble), 1e-5, 1e-6);
            };
            for (size_t i = 0; i < eager_params.size(); ++i)
                EXPECT_TRUE(close(eager_params[i], graph_params[i])) << "parameter " << i;
            const TensorMap se = eager->state_dict(), sg = graphed->state_dict();
            ASSERT_EQ(se.size(), sg.size());
            for (const auto& [k, v] : se) EXPECT_TRUE(sg.count(k) && close(v, sg.at(k))) << k;
            EXPECT_FALSE(at::equal(graph_params[0].cpu(), pr.init[0])) << "the replays trained";
        }
}

#endif

}  // namespace
}  // namespace test_optimizer_graph_local
}  // namespace dtune::train
