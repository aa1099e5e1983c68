// The training loss and timestep bias against SimpleTuner's own code: tools/ref/loss_reference.py
// runs SimpleTuner's ModelFoundation.loss (l2 / pseudo-Huber / smooth-L1, huber_schedule snr /
// exponential / constant, min-SNR with the epsilon and v_prediction divisors, snr_weight) and
// generate_timestep_weights on fixed inputs, and tests/data/ref/loss_reference.json holds what they
// returned. dtune's per_sample_loss and timestep_weights must give the same values.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "diffusion/loss.h"
#include "diffusion/noise_schedule.h"
#include "diffusion/training_sampling.h"

namespace dtune::diffusion {
namespace test_loss_reference_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

nlohmann::json reference() {
    std::ifstream in(DTUNE_TEST_DATA_DIR "/ref/loss_reference.json");
    EXPECT_TRUE(in.good()) << "tests/data/ref/loss_reference.json is missing";
    return nlohmann::json::parse(in);
}

at::Tensor tensor_of(const nlohmann::json& values, const std::vector<int64_t>& shape) {
    return at::tensor(values.get<std::vector<float>>(), at::kFloat).view(shape);
}

TEST(LossReference, EveryLossTypeScheduleAndWeightingMatchesSimpleTuner) {
    const nlohmann::json ref = reference();
    const auto shape = ref.at("shape").get<std::vector<int64_t>>();
    const at::Tensor pred = tensor_of(ref.at("pred"), shape), target = tensor_of(ref.at("target"), shape);
    const at::Tensor t = at::tensor(ref.at("timesteps").get<std::vector<int64_t>>(), at::kLong);
    ASSERT_GE(ref.at("loss_cases").size(), 100u);
    for (const auto& c : ref.at("loss_cases")) {
        NoiseScheduleConfig sc = NoiseScheduleConfig::sdxl();
        const std::string prediction = c.at("prediction_type");
        sc.prediction_type =
            prediction == "v_prediction" ? PredictionType::kVPrediction : PredictionType::kEpsilon;
        const NoiseSchedule schedule(sc);
        LossOptions o;
        o.loss_type = parse_loss_type(c.at("loss_type"));
        o.huber_schedule = parse_huber_schedule(c.at("huber_schedule"));
        o.huber_c = c.at("huber_c");
        if (!c.at("snr_gamma").is_null()) o.snr_gamma = c.at("snr_gamma").get<double>();
        o.snr_weight = c.at("snr_weight");
        const double got = diffusion_loss(pred, target, t, sc.prediction_type, &schedule, o).item<double>();
        const double want = c.at("loss");
        EXPECT_NEAR(got, want, 2e-6 * std::max(1.0, std::abs(want))) << c.dump();
    }
}

TEST(LossReference, TimestepBiasWeightsMatchSimpleTuner) {
    for (const auto& c : reference().at("timestep_bias")) {
        TimestepBiasOptions o;
        o.strategy = parse_timestep_bias_strategy(c.at("strategy"));
        o.multiplier = c.at("multiplier");
        o.portion = c.at("portion");
        o.begin = c.at("begin");
        o.end = c.at("end");
        const at::Tensor w = timestep_weights(o, 1000);
        EXPECT_NEAR(w.sum().item<double>(), c.at("sum").get<double>(), 1e-5) << c.dump();
        const auto probes = c.at("probes").get<std::vector<int64_t>>();
        const auto values = c.at("values").get<std::vector<double>>();
        for (size_t i = 0; i < probes.size(); ++i)
            EXPECT_NEAR(w[probes[i]].item<double>(), values[i], 1e-9) << c.dump() << " at t=" << probes[i];
    }
}

// diff2flow_loss: SimpleTuner's loss through its DiffusionToFlowBridge (with huber, min-SNR and
// snr_weight set, which that branch ignores) equals the MSE of diff2flow_prediction against
// noise - latents, the loss dtune's micro_step computes with StepOptions::diff2flow_loss.
TEST(LossReference, Diff2FlowLossMatchesSimpleTunersBridge) {
    const nlohmann::json ref = reference();
    const auto shape = ref.at("shape").get<std::vector<int64_t>>();
    const at::Tensor pred = tensor_of(ref.at("pred"), shape), noisy = tensor_of(ref.at("noisy"), shape);
    const at::Tensor flow_target = tensor_of(ref.at("noise"), shape) - tensor_of(ref.at("latents"), shape);
    const at::Tensor t = at::tensor(ref.at("timesteps").get<std::vector<int64_t>>(), at::kLong);
    ASSERT_EQ(ref.at("diff2flow_cases").size(), 2u);
    for (const auto& c : ref.at("diff2flow_cases")) {
        NoiseScheduleConfig sc = NoiseScheduleConfig::sdxl();
        sc.prediction_type = c.at("prediction_type") == "v_prediction" ? PredictionType::kVPrediction
                                                                       : PredictionType::kEpsilon;
        const NoiseSchedule schedule(sc);
        const at::Tensor flow = diff2flow_prediction(pred, noisy, t, sc.prediction_type, schedule);
        const double got =
            (flow - flow_target).pow(2).mean(std::vector<int64_t>{1, 2, 3}).mean().item<double>();
        const double want = c.at("loss");
        EXPECT_NEAR(got, want, 2e-6 * std::max(1.0, std::abs(want))) << c.dump();
    }
    const NoiseSchedule s;
    EXPECT_THROW(diff2flow_prediction(pred, noisy, t, PredictionType::kSample, s), UsageError);
}

}  // namespace
}  // namespace test_loss_reference_local
}  // namespace dtune::diffusion
