// cuda_graph on the CPU (tiny SDXL fixture): the conditions cuda_graph_blocker reports, GraphedStep's
// gradient-accumulation path (eager on the CPU) against the eager accumulation loop, and a CPU
// run with cuda_graph true trains eagerly, warns why once, and gives bit-identical weights to the
// same run with cuda_graph false; left at auto (the default) a CPU run says nothing.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <vector>

#include "core/log.h"
#include "models/adapters/lora.h"
#include "train/graph_step.h"
#include "train/loss_scaler.h"
#include "train/optimizer.h"
#include "train/step.h"
#include "train/trainer_graph.h"
#include "trainer_test_util.h"

namespace dtune::train {
namespace test_trainer_graph_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using testutil::tiny_config;

// A configuration every condition accepts (on a CUDA device, one process).
TrainConfig graph_friendly(const std::filesystem::path& out, const nlohmann::json& extra = {}) {
    nlohmann::json j{{"deterministic", false},    {"grad_clip_method", "norm"}, {"max_grad_norm", 1.0},
                     {"mixed_precision", "bf16"}, {"model_type", "lora"},       {"lora_dropout", 0.0},
                     {"cuda_graph", true}};
    if (!extra.is_null()) j.update(extra);
    return tiny_config(out, 2, j);
}

TEST(CudaGraphConditions, NamesTheFirstUnmetCondition) {
    test::TempDir dir;
    const c10::Device cuda(c10::kCUDA, 0);  // a Device value only: no CUDA needed
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path()), cuda, 1), "");
    EXPECT_EQ(
        cuda_graph_blocker(
            graph_friendly(dir.path(), {{"grad_clip_method", "value"}, {"max_grad_norm", 0.0}}), cuda, 1),
        "");  // no clipping at all: nothing to clip by value
    const std::vector<std::pair<nlohmann::json, std::string>> cases = {
        {{{"offload_optimizer_device", "cpu"}}, "offload_optimizer_device is cpu"},
    };
    for (const auto& [extra, expected] : cases) {
        const std::string got = cuda_graph_blocker(graph_friendly(dir.path(), extra), cuda, 1);
        EXPECT_EQ(got.rfind(expected, 0), 0u) << extra.dump() << " gave: " << got;
    }
    // Offset noise, input perturbation, min-SNR and the Huber losses are graphed: device draws, and
    // huber_c and the min-SNR weights from the device timesteps (tests/train/test_step_noise_loss.cpp).
    // So are a timestep bias (inverse CDF on the device) and Diff2Flow's conversion
    // (tests/train/test_graphed_draws.cpp).
    for (const nlohmann::json& extra :
         {nlohmann::json{{"offset_noise", true}, {"noise_offset", 0.1}},
          nlohmann::json{{"input_perturbation", 0.1}}, nlohmann::json{{"snr_gamma", 5.0}},
          nlohmann::json{{"loss_type", "huber"}, {"huber_schedule", "snr"}},
          nlohmann::json{{"loss_type", "smooth_l1"}, {"huber_schedule", "exponential"}},
          nlohmann::json{{"timestep_bias_strategy", "later"}, {"timestep_bias_multiplier", 3.0}},
          nlohmann::json{{"timestep_bias_strategy", "earlier"}, {"timestep_bias_portion", 0.1}},
          nlohmann::json{
              {"timestep_bias_strategy", "range"}, {"timestep_bias_begin", 200}, {"timestep_bias_end", 500}},
          nlohmann::json{{"diff2flow_enabled", true}, {"diff2flow_loss", true}},
          // The per-tensor AdamW keeps its counts on the device; the rollout is masked on the device,
          // its (ramped) probability read from there (tests/train/test_graphed_rollout.cpp).
          nlohmann::json{{"deterministic", true}},
          nlohmann::json{{"scheduled_sampling_max_step_offset", 20}, {"scheduled_sampling_probability", 0.5}},
          nlohmann::json{{"scheduled_sampling_max_step_offset", 20},
                         {"scheduled_sampling_ramp_steps", 100},
                         {"scheduled_sampling_prob_start", 0.1},
                         {"scheduled_sampling_prob_end", 0.6}}})
        EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path(), extra), cuda, 1), "") << extra.dump();
    // SimpleTuner's defaults (clip by value at 2, lora_dropout 0.1) are graphed: the clamp and the
    // dropout seed are device work inside the step.
    EXPECT_EQ(cuda_graph_blocker(
                  tiny_config(dir.path(), 2, {{"deterministic", false}, {"model_type", "lora"}}), cuda, 1),
              "");
    EXPECT_EQ(
        cuda_graph_blocker(graph_friendly(dir.path(), {{"grad_clip_method", "value"}, {"lora_dropout", 0.1}}),
                           cuda, 1),
        "");
    // fp16: the loss scaler and fused AdamW's overflow skip run on the device (loss_scaler.h).
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path(), {{"mixed_precision", "fp16"}}), cuda, 1), "");
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path(), {{"mixed_precision", "fp16"},
                                                             {"gradient_accumulation_steps", 2}}),
                                 cuda, 2, 1),
              "");
    // Every other optimizer skips an overflowed fp16 step on the device too (skip_step_on_overflow).
    for (const char* opt : {"optimi-lion", "torch-sgd", "torch-adafactor", "adamw_bf16"})
        EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path(), {{"mixed_precision", "fp16"},
                                                                 {"optimizer", opt},
                                                                 {"model_type", "full"}}),
                                     cuda, 1),
                  "")
            << opt;
    // optimi-adamw is the same fused AdamW.
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path(), {{"optimizer", "optimi-adamw"}}), cuda, 1), "");
    // Lion, SGD and Adafactor read their LR and step terms from the device (optimizer_graph.cpp).
    for (const char* opt : {"optimi-lion", "torch-sgd", "torch-adafactor"})
        EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path(), {{"optimizer", opt}}), cuda, 1), "") << opt;
    // adamw_bf16 keeps its LR and bias correction on the device and never reads back (#6).
    EXPECT_EQ(cuda_graph_blocker(
                  graph_friendly(dir.path(), {{"optimizer", "adamw_bf16"}, {"model_type", "full"}}), cuda, 1),
              "");
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path()), cuda, 2), "");  // the all-reduce is captured
    // Gradient accumulation: a micro graph and a final graph per shape (graph_step.h), with one
    // process and with the data-parallel reducer's buckets.
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path(), {{"gradient_accumulation_steps", 2}}), cuda, 1),
              "");
    EXPECT_EQ(
        cuda_graph_blocker(graph_friendly(dir.path(), {{"gradient_accumulation_steps", 3}}), cuda, 2, 1), "");
    // ZeRO-1 graphs (the same all-reduce; broadcasts after the replay); ZeRO-2 too (other ranks'
    // buckets in staging slots), but not with accumulation, fp16 or the flat all-reduce; ZeRO-3 not.
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path()), cuda, 2, 1), "");
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path()), cuda, 2, 2), "");
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path(), {{"gradient_accumulation_steps", 2}}), cuda, 2, 2)
                  .rfind("zero_stage is 2 with 2 ranks and gradient_accumulation_steps 2", 0),
              0u);
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path(), {{"mixed_precision", "fp16"}}), cuda, 2, 2)
                  .rfind("zero_stage is 2 with 2 ranks and mixed_precision fp16", 0),
              0u);
    ::setenv("DTUNE_GRAPH_REDUCER", "0", 1);
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path()), cuda, 2, 2)
                  .rfind("zero_stage is 2 with 2 ranks and DTUNE_GRAPH_REDUCER=0", 0),
              0u);
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path()), cuda, 2, 1), "");
    ::unsetenv("DTUNE_GRAPH_REDUCER");
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path()), cuda, 1, 2), "");  // one rank: no sharding
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path()), cuda, 4, 3).rfind("zero_stage is 3", 0), 0u);
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path()), cuda, 1, 1), "");  // one rank: no sharding
    EXPECT_EQ(
        cuda_graph_blocker(graph_friendly(dir.path()), c10::Device(c10::kCPU), 1).rfind("device is cpu", 0),
        0u);
}

std::string read_text(const std::filesystem::path& p) {
    std::ifstream in(p);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
}

// Trains 3 LoRA steps on the CPU; returns the trainable tensors and the run's log.
std::vector<at::Tensor> train_cpu(const nlohmann::json& cuda_graph, std::string& log_text) {
    test::TempDir dir;
    const auto log_file = dir.path() / "run.log";
    log::set_file(log_file);
    auto trainer = testutil::make_trainer(tiny_config(
        dir.path() / "out", 3,
        {{"model_type", "lora"}, {"lora_rank", 4}, {"lora_dropout", 0.0}, {"cuda_graph", cuda_graph}}));
    trainer->run();
    log::set_file({});
    log_text = read_text(log_file);
    EXPECT_EQ(trainer->graphed_step(), nullptr);
    std::vector<at::Tensor> out;
    bool trained = false;  // lora_B starts at zero: non-zero means the steps changed the weights
    for (const auto& p : trainer->trainable_parameters()) {
        out.push_back(p.tensor.detach().clone());
        if (p.name.find("lora_B") != std::string::npos) trained |= p.tensor.abs().max().item<double>() > 0;
    }
    EXPECT_TRUE(trained);
    return out;
}

TEST(CudaGraphTrainer, CpuRunTrainsEagerlyWithIdenticalWeights) {
    std::string log_off, log_on;
    std::string log_auto;
    const auto off = train_cpu(false, log_off);
    const auto on = train_cpu(true, log_on);
    const auto automatic = train_cpu("auto", log_auto);
    EXPECT_EQ(log_off.find("cuda_graph"), std::string::npos) << log_off;
    EXPECT_EQ(log_auto.find("cuda_graph"), std::string::npos) << log_auto;
    EXPECT_NE(log_on.find("cuda_graph: training eagerly because device is cpu"), std::string::npos) << log_on;
    EXPECT_NE(log_on.find(" warn: cuda_graph: training eagerly"), std::string::npos) << log_on;
    ASSERT_EQ(automatic.size(), on.size());
    for (size_t i = 0; i < on.size(); ++i) EXPECT_TRUE(at::equal(automatic[i], on[i])) << "tensor " << i;
    ASSERT_EQ(off.size(), on.size());
    ASSERT_FALSE(off.empty());
    for (size_t i = 0; i < off.size(); ++i) EXPECT_TRUE(at::equal(off[i], on[i])) << "tensor " << i;
}

// GraphedStep's accumulation path as it runs outside a capture (on the CPU every call is eager; on a
// GPU the same calls are what the warm-up runs and the graphs record): micro-steps through
// accumulate_gradients_async into its persistent gradients, the last through
// optimizer_step_async(..., accum). Two steps of 3 micro-batches with LoRA dropout (a seed per
// forward) and norm clipping must equal the trainer's eager accumulation loop written out by hand
// (loss / accum backward per micro-batch, clip, AdamW, zero_grad) bit for bit, micro-step losses
// included; the gradients end each step zeroed in place, as views of one buffer.
TEST(GraphedStepAccumulation, MatchesTheEagerAccumulationLoop) {
    constexpr int64_t kAccum = 3, kSteps = 2;
    constexpr double kClip = 0.05;
    SyntheticBatchSource source{SyntheticBatchOptions{}};
    auto data_gen = at::detail::createCPUGenerator(5);
    std::vector<TrainBatch> batches;
    for (int64_t i = 0; i < kAccum * kSteps; ++i) batches.push_back(source.next(data_gen));
    const auto schedule = testutil::tiny_schedule();
    struct Lora {
        models::UNet2DConditionModel unet = testutil::tiny_unet();
        std::optional<models::LoRAAdapters> adapters;
        std::unique_ptr<AdamW> opt;
        std::vector<at::Tensor> params;
        uint64_t seed = 100;  // LoRA dropout: a new seed per forward
        StepHooks hooks;
    };
    auto make = [] {
        auto l = std::make_unique<Lora>();
        models::LoRAConfig lc;
        lc.rank = 4;
        lc.dropout = 0.1;
        lc.init_seed = 3;
        l->adapters = models::inject_lora(*l->unet, lc);
        {
            at::NoGradGuard no_grad;
            auto gen = at::detail::createCPUGenerator(99);
            for (auto& t : l->adapters->parameters()) t.copy_(at::randn(t.sizes(), gen) * 0.1);  // non-zero B
        }
        l->unet->train();
        ParamGroup g;
        for (const auto& [name, t] : l->adapters->named_parameters())
            g.names.push_back(name), g.params.push_back(t);
        g.lr = 1e-3;
        l->params = g.params;
        l->opt = std::make_unique<AdamW>(std::vector<ParamGroup>{g});
        Lora* raw = l.get();
        l->hooks.before_forward = [raw] { raw->adapters->set_dropout_seed(raw->seed++); };
        return l;
    };
    // accum micro-steps per optimizer step, through GraphedStep; returns every micro-step's loss.
    auto graphed = [&](Lora& l, int64_t accum) {
        GraphedStep step;
        auto model = testutil::sdxl_model(l.unet);
        auto gen = at::detail::createCPUGenerator(11);
        std::vector<double> losses;
        for (int64_t s = 0; s < kSteps; ++s)
            for (int64_t micro = 0; micro < accum; ++micro) {
                const TrainBatch& batch = batches[s * kAccum + (kAccum - accum) + micro];
                const StepTensors out = step.run(*model, batch, schedule, StepOptions{}, s, gen, *l.opt,
                                                 l.params, kClip, l.hooks, micro, accum);
                losses.push_back(out.loss.item<double>());
                EXPECT_EQ(out.grad_norm.defined(), micro == accum - 1) << "step " << s << " micro " << micro;
            }
        EXPECT_EQ(step.eager_steps(), kSteps);
        EXPECT_EQ(step.replays(), 0);
        EXPECT_EQ(step.micro_replays(), 0);
        return losses;
    };
    auto by_hand = [&](Lora& l) {
        auto model = testutil::sdxl_model(l.unet);
        auto gen = at::detail::createCPUGenerator(11);
        std::vector<double> losses;
        for (int64_t s = 0; s < kSteps; ++s) {
            for (int64_t micro = 0; micro < kAccum; ++micro) {
                const MicroStep m =
                    micro_step(*model, batches[s * kAccum + micro], schedule, StepOptions{}, s, gen, l.hooks);
                (m.loss / static_cast<double>(kAccum)).backward();
                losses.push_back(m.loss.item<double>());
            }
            clip_gradients(l.params, kClip, false);
            l.opt->step();
            l.opt->zero_grad();
        }
        return losses;
    };
    const auto a = make(), hand = make(), single = make();
    const std::vector<double> losses = graphed(*a, kAccum);
    const std::vector<double> hand_losses = by_hand(*hand);
    EXPECT_EQ(losses, hand_losses);
    double diff = 0, moved = 0;
    for (std::size_t i = 0; i < a->params.size(); ++i) {
        diff = std::max(diff, (a->params[i] - hand->params[i]).abs().max().item<double>());
        moved = std::max(moved, (a->params[i] - single->params[i]).abs().max().item<double>());
    }
    EXPECT_EQ(diff, 0.0);
    EXPECT_GT(moved, 0.0);  // (single has not trained yet: the steps moved the weights)
    // Every gradient is defined, zero, and lives in one buffer (consecutive views of one storage).
    ASSERT_FALSE(a->params.empty());
    const void* storage = a->params[0].grad().storage().data();
    for (const auto& p : a->params) {
        ASSERT_TRUE(p.grad().defined());
        EXPECT_EQ(p.grad().abs().max().item<double>(), 0.0);
        EXPECT_EQ(p.grad().storage().data(), storage);
    }
    // The micro-steps count: the same last micro-batches without the earlier ones train other weights.
    graphed(*single, 1);
    double accum_effect = 0;
    for (std::size_t i = 0; i < a->params.size(); ++i)
        accum_effect = std::max(accum_effect, (a->params[i] - single->params[i]).abs().max().item<double>());
    EXPECT_GT(accum_effect, 0.0);
}

// fp16 through the graphed step's definition on the CPU (GraphedStep runs it eagerly there; a GPU
// captures the same calls): backward on loss x scale, the unscale after backward (found_inf), the
// clip, and Lion, SGD and Adafactor with device LRs skipping on found_inf themselves, as
// Trainer::train_graphed_step wires them. Step 2 of 4 overflows (an inf put into a gradient before
// the unscale, where a real fp16 overflow lands): it must leave the weights as they were, and the
// whole run must equal the eager loop (Trainer::train_one_step's order, the host-lr step) bit for bit.
TEST(GraphedStepFp16, OptimizersSkipAnOverflowLikeTheEagerLoop) {
    constexpr int64_t kSteps = 4, kOverflowAt = 1;
    constexpr double kClip = 0.05;
    SyntheticBatchSource source{SyntheticBatchOptions{}};
    auto data_gen = at::detail::createCPUGenerator(5);
    std::vector<TrainBatch> batches;
    for (int64_t i = 0; i < kSteps; ++i) batches.push_back(source.next(data_gen));
    const auto schedule = testutil::tiny_schedule();
    using Factory = std::function<std::unique_ptr<Optimizer>(std::vector<ParamGroup>)>;
    const std::vector<std::pair<const char*, Factory>> optimizers = {
        {"lion", [](std::vector<ParamGroup> g) { return std::make_unique<Lion>(std::move(g)); }},
        {"sgd", [](std::vector<ParamGroup> g) { return std::make_unique<SGD>(std::move(g)); }},
        {"adafactor", [](std::vector<ParamGroup> g) { return std::make_unique<Adafactor>(std::move(g)); }},
    };
    struct Run {
        models::UNet2DConditionModel unet = testutil::tiny_unet();
        std::optional<models::LoRAAdapters> adapters;
        std::unique_ptr<Optimizer> opt;
        std::vector<at::Tensor> params;
        LossScaler scaler;
    };
    auto make = [](const Factory& factory) {
        auto r = std::make_unique<Run>();
        models::LoRAConfig lc;
        lc.rank = 4;
        lc.init_seed = 3;
        r->adapters = models::inject_lora(*r->unet, lc);
        {
            at::NoGradGuard no_grad;
            auto gen = at::detail::createCPUGenerator(99);
            for (auto& t : r->adapters->parameters()) t.copy_(at::randn(t.sizes(), gen) * 0.1);  // non-zero B
        }
        r->unet->train();
        ParamGroup g;
        for (const auto& [name, t] : r->adapters->named_parameters())
            g.names.push_back(name), g.params.push_back(t);
        g.lr = 1e-3;
        r->params = g.params;
        r->opt = factory(std::vector<ParamGroup>{g});
        EXPECT_TRUE(r->opt->skip_step_on_overflow(r->scaler.found_inf()));
        return r;
    };
    auto poison = [](Run& r, int64_t s) {
        if (s == kOverflowAt) r.params[0].grad().view(-1)[0] = std::numeric_limits<float>::infinity();
    };
    auto weights = [](const Run& r) {
        std::vector<at::Tensor> out;
        for (const auto& p : r.params) out.push_back(p.detach().clone());
        return out;
    };
    auto same = [](const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
        for (size_t i = 0; i < a.size(); ++i)
            if (!at::equal(a[i], b[i])) return false;
        return true;
    };
    for (const auto& [name, factory] : optimizers) {
        SCOPED_TRACE(name);
        const auto graphed = make(factory), eager = make(factory);
        // The graphed step: device LRs, the scaler in the hooks (Trainer::train_graphed_step).
        {
            Run& r = *graphed;
            r.opt->use_device_lr();
            GraphedStep step;
            step.set_lr_on_device(true);
            auto model = testutil::sdxl_model(r.unet);
            auto gen = at::detail::createCPUGenerator(11);
            StepHooks hooks;
            hooks.scale_loss = [&r](const at::Tensor& loss) { return r.scaler.scale_loss(loss); };
            int64_t s = 0;
            hooks.after_backward = [&r, &s, &poison] {
                poison(r, s);
                r.scaler.unscale(r.params);
            };
            for (; s < kSteps; ++s) {
                const std::vector<at::Tensor> before = weights(r);
                r.opt->set_lr(1e-3 * (1.0 - 0.2 * static_cast<double>(s)));
                r.opt->upload_lr();
                step.run(*model, batches[s], schedule, StepOptions{}, s, gen, *r.opt, r.params, kClip, hooks);
                r.opt->after_step();
                r.scaler.update();
                EXPECT_EQ(same(before, weights(r)), s == kOverflowAt) << "step " << s;
            }
            EXPECT_EQ(r.scaler.skipped_steps(), 1);
            EXPECT_EQ(r.scaler.scale(), 32768.0);  // backed off once
        }
        // The eager loop (Trainer::train_one_step, then the host-lr step).
        {
            Run& r = *eager;
            auto model = testutil::sdxl_model(r.unet);
            auto gen = at::detail::createCPUGenerator(11);
            for (int64_t s = 0; s < kSteps; ++s) {
                const MicroStep m = micro_step(*model, batches[s], schedule, StepOptions{}, s, gen, {});
                r.scaler.scale_loss(m.loss).backward();
                poison(r, s);
                r.scaler.unscale(r.params);
                clip_gradients(r.params, kClip, false, {}, r.opt.get());
                r.opt->set_lr(1e-3 * (1.0 - 0.2 * static_cast<double>(s)));
                r.opt->step();
                r.opt->zero_grad();
                r.scaler.update();
            }
        }
        for (size_t i = 0; i < graphed->params.size(); ++i)
            EXPECT_TRUE(at::equal(graphed->params[i], eager->params[i])) << "tensor " << i;
        const TensorMap a = graphed->opt->state_dict(), b = eager->opt->state_dict();
        ASSERT_EQ(a.size(), b.size());
        for (const auto& [k, v] : a) EXPECT_TRUE(b.count(k) && at::equal(v, b.at(k))) << k;
    }
}

}  // namespace
}  // namespace test_trainer_graph_local
}  // namespace dtune::train
