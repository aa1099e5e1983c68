// Scheduled sampling with the graph's settings (StepOptions::device_rng), on the CPU (where the
// "device" generator is the CPU's default one), on the tiny SDXL fixture:
// - the fixed-length rollout masked per sample (train/step.cpp, roll_out_on_device) gives each sample
//   the rollout of its own drawn length, written out here sample by sample with the host-indexed
//   rollout_step, from the same draws (noise, timesteps, then diffusion::draw_rollout_offsets);
// - a ramped probability is read from the device (refresh_rollout_probability), as a capture needs;
// - GraphedStep (every call eager on the CPU, what a GPU's warm-up runs and its graphs record) trains
//   with scheduled sampling and the deterministic per-tensor AdamW reading its lr from a device
//   tensor, bit for bit as the step written out by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include "core/error.h"
#include "diffusion/loss.h"
#include "diffusion/scheduled_sampling.h"
#include "train/graph_step.h"
#include "train/step.h"
#include "trainer_test_util.h"

namespace dtune::train {
namespace test_graphed_rollout_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using diffusion::PredictionType;

constexpr int64_t kBatch = 4;

StepOptions rollout_options(PredictionType type) {
    StepOptions o;
    o.device_rng = true;
    o.prediction = type;
    o.scheduled_sampling.max_step_offset = 6;
    o.scheduled_sampling.probability = 0.7;
    return o;
}

struct Draws {
    at::Tensor noise, t, offsets;
};

// The step's draws from the default generator seeded with `seed`, in the step's order.
Draws draws_for(uint64_t seed, const TrainBatch& batch, int64_t t_count, const StepOptions& o) {
    at::manual_seed(seed);
    Draws d;
    d.noise = at::randn(batch.latents.sizes(), at::kFloat);
    d.t = at::randint(0, t_count, {kBatch}, at::kLong);
    // The device path always draws the mask.
    d.offsets = diffusion::draw_rollout_offsets(kBatch, o.scheduled_sampling,
                                                at::full({}, o.scheduled_sampling.probability, at::kFloat),
                                                true, std::nullopt, c10::Device(c10::kCPU));
    return d;
}

TEST(RolloutOnDevice, MaskedRolloutIsEachSamplesOwnRollout) {
    const TrainBatch batch = testutil::tiny_batch(kBatch);
    auto model = testutil::sdxl_model(testutil::tiny_unet());
    const diffusion::NoiseSchedule schedule = testutil::tiny_schedule();
    const int64_t t_count = schedule.num_train_timesteps();
    for (PredictionType type : {PredictionType::kEpsilon, PredictionType::kVPrediction}) {
        const StepOptions options = rollout_options(type);
        // A seed whose plan has a sample without rollout and two of different lengths.
        uint64_t seed = 11;
        Draws d;
        for (;; ++seed) {
            d = draws_for(seed, batch, t_count, options);
            const at::Tensor rolled = d.offsets.gt(0);
            if (rolled.sum().item<int64_t>() >= 2 && !rolled.all().item<bool>() &&
                d.offsets.max().item<int64_t>() != d.offsets.masked_select(rolled).min().item<int64_t>())
                break;
        }
        at::Generator gen = at::detail::createCPUGenerator(3);
        at::manual_seed(seed);
        const MicroStep m = micro_step(*model, batch, schedule, options, 0, gen);
        ASSERT_TRUE(at::equal(m.timesteps, d.t));

        // The reference: each rolled-out sample alone, one host-indexed step at a time.
        const at::Tensor latents = batch.latents.to(at::kFloat);
        const at::Tensor noisy = schedule.add_noise(latents, d.noise, d.t);
        at::Tensor rolled = noisy.clone();
        at::NoGradGuard no_grad;
        for (int64_t i = 0; i < kBatch; ++i) {
            const int64_t target = d.t[i].item<int64_t>();
            const int64_t source = std::min(target + d.offsets[i].item<int64_t>(), t_count - 1);
            if (source <= target) continue;
            family::Conditioning one;
            for (const auto& [name, c] : batch.cond) one[name] = c.narrow(0, i, 1);
            at::Tensor x = schedule.add_noise(latents.narrow(0, i, 1), d.noise.narrow(0, i, 1),
                                              at::full({1}, source, at::kLong));
            for (int64_t step = source; step > target && step > 0; --step) {
                const at::Tensor pred = model->forward(x, at::full({1}, step, at::kLong), one);
                x = diffusion::rollout_step(schedule, type, x, pred, step, step - 1);
            }
            rolled[i].copy_(x[0]);
        }
        const at::Tensor target = schedule.target(type, latents, d.noise, d.t);
        const auto loss_on = [&](const at::Tensor& input) {
            const at::Tensor pred = model->forward(input, d.t, batch.cond);
            return diffusion::diffusion_loss(pred, target, d.t, type, &schedule, options.loss).item<double>();
        };
        const double expected = loss_on(rolled), plain = loss_on(noisy);
        const double got = m.loss.item<double>();
        // Float rounding only: the masked rollout calls the model on the whole batch.
        std::cout << "type " << static_cast<int>(type) << ": masked " << got << " reference " << expected
                  << " without rollout " << plain << "\n";
        EXPECT_NEAR(got, expected, 1e-6 * std::abs(expected)) << "type " << static_cast<int>(type);
        EXPECT_GT(std::abs(got - plain), 1e-4 * std::abs(plain)) << "the rollout changed nothing";
    }
}

// A ramp under CUDA graphs: refresh_rollout_probability puts each step's probability on the device
// in place (the address a capture holds), and the step draws its mask with it, not with the
// probability of the global_step it was called (or captured) with.
TEST(RolloutOnDevice, FollowsARampThroughTheDeviceProbability) {
    const TrainBatch batch = testutil::tiny_batch(kBatch);
    auto model = testutil::sdxl_model(testutil::tiny_unet());
    const diffusion::NoiseSchedule schedule = testutil::tiny_schedule();
    StepOptions options = rollout_options(PredictionType::kEpsilon);
    options.scheduled_sampling.ramp_steps = 10;
    options.scheduled_sampling.prob_start = 0.2;
    options.scheduled_sampling.prob_end = 1.0;
    const c10::Device cpu(c10::kCPU);
    refresh_rollout_probability(options, 0, cpu);
    const at::Tensor slot = *options.rollout_probability;
    ASSERT_TRUE(slot.defined());
    EXPECT_FLOAT_EQ(slot.item<float>(), 0.2f);
    refresh_rollout_probability(options, 5, cpu);
    EXPECT_FLOAT_EQ(slot.item<float>(), 0.6f);
    EXPECT_TRUE(options.rollout_probability->is_same(slot)) << "refilled in place";

    at::Generator gen = at::detail::createCPUGenerator(3);
    const auto loss = [&](const StepOptions& o, int64_t global_step) {
        at::manual_seed(31);
        return micro_step(*model, batch, schedule, o, global_step, gen).loss.item<double>();
    };
    refresh_rollout_probability(options, 10, cpu);  // 1: every sample in the mask
    const double ramped = loss(options, 0);         // called with step 0, whose probability is 0.2
    StepOptions host = options;
    host.rollout_probability = std::make_shared<at::Tensor>();  // no slot: the step's own probability
    EXPECT_EQ(ramped, loss(host, 10));
    EXPECT_NE(ramped, loss(host, 0));
}

struct FullRun {
    models::UNet2DConditionModel unet = testutil::tiny_unet();
    std::vector<at::Tensor> params;
    std::unique_ptr<AdamW> opt;
    FullRun() {
        ParamGroup g;
        for (const auto& item : unet->named_parameters()) {
            g.names.push_back(item.key());
            g.params.push_back(item.value());
        }
        g.lr = 1e-3;
        g.weight_decay = 1e-2;
        params = g.params;
        opt = std::make_unique<AdamW>(std::vector<ParamGroup>{g}, AdamWOptions{.fused = false});
        opt->use_device_lr();  // the graph's settings
    }
};

// GraphedStep with scheduled sampling and deterministic's AdamW loop, as a graphed trainer runs it
// (set_lr, upload_lr, the step, after_step; a changing lr), against the same written out by hand.
TEST(RolloutOnDevice, GraphedStepTrainsWithRolloutsAndTheDeterministicLoop) {
    constexpr int64_t kSteps = 2;
    constexpr double kClip = 1.0;
    const diffusion::NoiseSchedule schedule = testutil::tiny_schedule();
    const TrainBatch batch = testutil::tiny_batch(2);
    const auto lr = [](int64_t s) { return 1e-3 / (1.0 + static_cast<double>(s)); };
    const auto graphed = [&](const StepOptions& options) {
        auto r = std::make_unique<FullRun>();
        GraphedStep step;
        step.set_lr_on_device(true);
        auto model = testutil::sdxl_model(r->unet);
        at::Generator gen = at::detail::createCPUGenerator(11);
        at::manual_seed(21);
        for (int64_t s = 0; s < kSteps; ++s) {
            r->opt->set_lr(lr(s));
            r->opt->upload_lr();
            const StepTensors out =
                step.run(*model, batch, schedule, options, s, gen, *r->opt, r->params, kClip);
            EXPECT_TRUE(std::isfinite(out.loss.item<double>()));
            r->opt->after_step();
        }
        EXPECT_EQ(step.eager_steps(), kSteps);
        return r;
    };
    StepOptions options = rollout_options(PredictionType::kEpsilon);
    options.scheduled_sampling.max_step_offset = 3;
    options.scheduled_sampling.probability = 1.0;  // with offsets 0 to 3: some samples idle anyway
    const auto a = graphed(options);
    StepOptions plain_options = options;
    plain_options.scheduled_sampling.max_step_offset = 0;
    const auto plain = graphed(plain_options);

    FullRun hand;
    auto model = testutil::sdxl_model(hand.unet);
    at::Generator gen = at::detail::createCPUGenerator(11);
    at::manual_seed(21);
    for (int64_t s = 0; s < kSteps; ++s) {
        hand.opt->set_lr(lr(s));
        hand.opt->upload_lr();
        const MicroStep m = micro_step(*model, batch, schedule, options, s, gen);
        m.loss.backward();
        clip_gradients(hand.params, kClip, false);
        hand.opt->step();
        hand.opt->zero_grad();
    }
    double moved = 0;
    for (size_t i = 0; i < a->params.size(); ++i) {
        EXPECT_TRUE(at::equal(a->params[i], hand.params[i])) << "tensor " << i;
        moved = std::max(moved, (a->params[i] - plain->params[i]).abs().max().item<double>());
    }
    EXPECT_GT(moved, 0.0) << "scheduled sampling did not change training";
}

}  // namespace
}  // namespace test_graphed_rollout_local
}  // namespace dtune::train
