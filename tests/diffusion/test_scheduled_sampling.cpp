// Scheduled sampling (diffusion/scheduled_sampling.h):
// - the rollout plan equals SimpleTuner's build_rollout_schedule draw for draw
//   (tools/ref/scheduled_sampling_reference.py ran SimpleTuner's plan.py on the same seeds);
// - the probability ramp follows SimpleTuner's formula, its 0-means-fallback quirks included;
// - the rollout step descends: with a model that predicts the true noise (or v), stepping from
//   t + k down to t lands on the noised latent at t, for epsilon and v-prediction.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "diffusion/scheduled_sampling.h"

namespace dtune::diffusion {
namespace test_scheduled_sampling_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

TEST(ScheduledSampling, PlanEqualsSimpleTunersDrawForDraw) {
    std::ifstream in(DTUNE_TEST_DATA_DIR "/ref/scheduled_sampling_reference.json");
    ASSERT_TRUE(in.good()) << "tests/data/ref/scheduled_sampling_reference.json is missing";
    const auto ref = nlohmann::json::parse(in);
    for (const auto& c : ref.at("cases")) {
        SCOPED_TRACE(c.dump().substr(0, 80));
        ScheduledSamplingOptions o;
        o.max_step_offset = c.at("max_step_offset").get<int64_t>();
        o.strategy = parse_rollout_strategy(c.at("strategy").get<std::string>());
        at::Generator g = at::detail::createCPUGenerator(c.at("seed").get<uint64_t>());
        const at::Tensor base = at::tensor(c.at("base").get<std::vector<int64_t>>());
        const RolloutPlan plan = plan_rollout(base, 1000, o, c.at("probability").get<double>(), g);
        EXPECT_EQ(std::vector<int64_t>(plan.offsets.data_ptr<int64_t>(),
                                       plan.offsets.data_ptr<int64_t>() + plan.offsets.numel()),
                  c.at("offsets").get<std::vector<int64_t>>());
        EXPECT_EQ(std::vector<int64_t>(plan.source.data_ptr<int64_t>(),
                                       plan.source.data_ptr<int64_t>() + plan.source.numel()),
                  c.at("source").get<std::vector<int64_t>>());
    }
    EXPECT_THROW(parse_rollout_strategy("late"), UsageError);
}

// SimpleTuner (ModelFoundation.prepare_batch): p = probability; start = prob_start or p; end =
// prob_end or p; with ramp_steps > 0, from start_step on, start + (end - start) * progress (cosine:
// 0.5 - 0.5 cos(pi progress)), and start before it; without a ramp, p.
TEST(ScheduledSampling, ProbabilityRampsAsSimpleTunersFormula) {
    ScheduledSamplingOptions o;
    o.max_step_offset = 10;
    o.probability = 0.3;
    EXPECT_DOUBLE_EQ(rollout_probability(o, 0), 0.3);  // no ramp: prob_end's 0.5 is not used
    o.ramp_steps = 100;
    o.start_step = 20;
    EXPECT_DOUBLE_EQ(rollout_probability(o, 0), 0.3);    // before the ramp: prob_start 0 -> p
    EXPECT_DOUBLE_EQ(rollout_probability(o, 20), 0.3);   // progress 0
    EXPECT_DOUBLE_EQ(rollout_probability(o, 70), 0.4);   // halfway from 0.3 to prob_end 0.5
    EXPECT_DOUBLE_EQ(rollout_probability(o, 500), 0.5);  // clamped at the end
    o.prob_start = 0.1;
    o.prob_end = 0.9;
    o.cosine_ramp = true;
    EXPECT_NEAR(rollout_probability(o, 70), 0.5, 1e-12);  // cosine at half progress = 0.5
    EXPECT_NEAR(rollout_probability(o, 45), 0.1 + 0.8 * (0.5 - 0.5 * std::cos(M_PI * 0.25)), 1e-12);
    o.prob_end = 0.0;  // 0 falls back to probability (0.3)
    EXPECT_NEAR(rollout_probability(o, 120), 0.3, 1e-12);
}

TEST(ScheduledSampling, RolloutWithTheTrueNoiseLandsOnTheTargetTimestep) {
    const NoiseSchedule schedule(NoiseScheduleConfig::sdxl());
    const at::Tensor x0 = at::randn({1, 4, 3, 3}), noise = at::randn({1, 4, 3, 3});
    const auto at_t = [](int64_t t) { return at::full({1}, t, at::kLong); };
    for (const auto type : {PredictionType::kEpsilon, PredictionType::kVPrediction}) {
        for (const auto& [source, target] : {std::pair<int64_t, int64_t>{510, 500}, {999, 960}, {12, 0}}) {
            at::Tensor x = schedule.add_noise(x0, noise, at_t(source));
            for (int64_t t = source; t > target; --t) {
                const at::Tensor pred = schedule.target(type, x0, noise, at_t(t));  // the true eps or v
                x = rollout_step(schedule, type, x, pred, t, t - 1);
            }
            const at::Tensor want = schedule.add_noise(x0, noise, at_t(target));
            EXPECT_LE((x - want).abs().max().item<double>(), 2e-4) << source << " -> " << target;
        }
    }
    EXPECT_THROW(rollout_step(schedule, PredictionType::kSample, x0, x0, 5, 4), UsageError);
}

}  // namespace
}  // namespace test_scheduled_sampling_local
}  // namespace dtune::diffusion
