// The flow-matching schedule and Euler sampler (diffusion/flow_match.h) against diffusers'
// FlowMatchEulerDiscreteScheduler and FluxPipeline's calculate_shift: tools/ref/gen_flow_match_ref.py
// wrote tests/data/ref/flow_match_ref.json for Flux.1 [dev]/[schnell], SD3 and the shift_terminal,
// invert_sigmas and linear-shift options. Timesteps and sigmas must match to float32 rounding, the
// Euler steps likewise; the options dtune does not implement are refused naming the file and key.
#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "diffusion/flow_match.h"

namespace dtune::diffusion {
namespace test_flow_match_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

nlohmann::json reference() {
    std::ifstream in(DTUNE_TEST_DATA_DIR "/ref/flow_match_ref.json");
    EXPECT_TRUE(in.good()) << "tests/data/ref/flow_match_ref.json is missing";
    return nlohmann::json::parse(in);
}

// Largest difference in units of the float32 spacing at the reference value.
double max_ulps(const at::Tensor& got, const std::vector<double>& want) {
    EXPECT_EQ(got.numel(), static_cast<int64_t>(want.size()));
    double worst = 0;
    for (size_t i = 0; i < want.size() && static_cast<int64_t>(i) < got.numel(); ++i) {
        const auto w = static_cast<float>(want[i]);
        const float ulp = std::nextafter(std::fabs(w), INFINITY) - std::fabs(w);
        worst = std::max(
            worst, std::fabs(static_cast<double>(got[static_cast<int64_t>(i)].item<float>()) - w) / ulp);
    }
    return worst;
}

TEST(FlowMatch, MuIsFluxPipelinesCalculateShift) {
    const auto ref = reference();
    const FlowMatchConfig c = FlowMatchConfig::from_json(ref.at("cases").at(3).at("config"));
    for (const auto& [seq, mu] : ref.at("mu").items())
        EXPECT_NEAR(flow_match_mu(c, std::stoll(seq)), mu.get<double>(), 1e-12) << seq;
}

TEST(FlowMatch, SchedulesMatchDiffusers) {
    for (const auto& k : reference().at("cases")) {
        SCOPED_TRACE(k.at("name").get<std::string>());
        FlowMatchEulerSampler s(FlowMatchConfig::from_json(k.at("config")));
        std::optional<std::vector<double>> sigmas;
        if (!k.at("sigmas_in").is_null()) sigmas = k.at("sigmas_in").get<std::vector<double>>();
        std::optional<double> mu;
        if (!k.at("mu").is_null()) mu = k.at("mu").get<double>();
        s.set_timesteps(k.at("num_inference_steps").get<int64_t>(), sigmas, mu);
        EXPECT_LE(max_ulps(s.sigmas(), k.at("sigmas").get<std::vector<double>>()), 1.0);
        EXPECT_LE(max_ulps(s.timesteps(), k.at("timesteps").get<std::vector<double>>()), 1.0);
    }
}

TEST(FlowMatch, TrainingSigmasMatchDiffusers) {
    FlowMatchConfig c;
    c.shift = 3.0;
    EXPECT_LE(max_ulps(FlowMatchEulerSampler::training_sigmas(c),
                       reference().at("training_sigmas_shift3").get<std::vector<double>>()),
              1.0);
}

TEST(FlowMatch, EulerStepsMatchDiffusers) {
    const auto ref = reference();
    const auto& k = ref.at("cases").at(4);  // flux dev 768x1344, 4 steps
    FlowMatchEulerSampler s(FlowMatchConfig::from_json(k.at("config")));
    s.set_timesteps(4, k.at("sigmas_in").get<std::vector<double>>(), k.at("mu").get<double>());
    const auto& st = ref.at("steps");
    const auto shape = st.at("shape").get<std::vector<int64_t>>();
    const auto tensor = [&](const nlohmann::json& v) {
        return at::tensor(v.get<std::vector<float>>()).view(shape);
    };
    at::Tensor x = tensor(st.at("x0"));
    for (int64_t i = 0; i < 4; ++i) {
        x = s.step(tensor(st.at("outputs").at(i)), i, x);
        EXPECT_LE((x - tensor(st.at("samples").at(i))).abs().max().item<double>(), 1e-6) << "step " << i;
    }
    EXPECT_THROW(s.step(x, 4, x), UsageError);
}

TEST(FlowMatch, NoiseIsTheStraightLineBetweenDataAndNoise) {
    const at::Tensor x0 = at::randn({3, 2, 4}), noise = at::randn({3, 2, 4});
    const at::Tensor sigma = at::tensor({0.0f, 0.25f, 1.0f});
    const at::Tensor y = flow_match_noise(x0, noise, sigma);
    EXPECT_TRUE(at::allclose(y[0], x0[0]));
    EXPECT_TRUE(at::allclose(y[1], 0.75 * x0[1] + 0.25 * noise[1]));
    EXPECT_TRUE(at::allclose(y[2], noise[2]));
}

TEST(FlowMatch, RefusesWhatItDoesNotImplementNamingTheKey) {
    const auto message = [](const nlohmann::json& j) {
        try {
            FlowMatchConfig::from_json(j, "scheduler/scheduler_config.json");
        } catch (const UsageError& e) {
            return std::string(e.what());
        }
        return std::string("accepted");
    };
    EXPECT_NE(
        message({{"use_karras_sigmas", true}}).find("scheduler/scheduler_config.json: use_karras_sigmas"),
        std::string::npos);
    EXPECT_NE(message({{"_class_name", "EulerDiscreteScheduler"}}).find("not a flow-matching scheduler"),
              std::string::npos);
    EXPECT_NE(message({{"time_shift_type", "cubic"}}).find("time_shift_type"), std::string::npos);
    FlowMatchConfig dynamic;
    dynamic.use_dynamic_shifting = true;
    FlowMatchEulerSampler s(dynamic);
    EXPECT_THROW(s.set_timesteps(4), UsageError);  // dynamic shifting needs mu
}

}  // namespace
}  // namespace test_flow_match_local
}  // namespace dtune::diffusion
