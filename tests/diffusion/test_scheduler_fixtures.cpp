// Parity with the shared fixture scheduler_io.safetensors (diffusers' DDPM / Euler / DDIM, see
// ../shared/fixtures/gen/gen_fixtures.py): ≤ 1e-5 on values, exact integer timesteps.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "diffusion/ddim.h"
#include "diffusion/euler.h"
#include "diffusion/noise_schedule.h"
#include "diffusion/sampler.h"
#include "io/safetensors.h"
#include "support/test_support.h"

namespace dtune::diffusion {
namespace test_scheduler_fixtures_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

constexpr double kTol = 1e-5;

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
    return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

class SchedulerFixture : public ::testing::Test {
  protected:
    void SetUp() override {
        const auto ref = test::fixtures_dir() / "reference";
        file_ = std::make_unique<io::SafetensorsFile>(ref / "scheduler_io.safetensors");
        config_ = read_scheduler_config(ref / "euler_scheduler_config.json");
    }
    at::Tensor get(const std::string& key) const { return file_->get(key).clone(); }

    std::unique_ptr<io::SafetensorsFile> file_;
    nlohmann::json config_;
};

// gen_fixtures.py builds DDPMScheduler(beta_start=0.00085, beta_end=0.012, scaled_linear, 1000).
NoiseSchedule fixture_ddpm() {
    NoiseScheduleConfig c;
    c.beta_start = 0.00085;
    c.beta_end = 0.012;
    c.beta_schedule = BetaSchedule::kScaledLinear;
    return NoiseSchedule(c);
}

TEST_F(SchedulerFixture, AlphasCumprodMatchDDPM) {
    const at::Tensor expected = get("alphas_cumprod");
    const NoiseSchedule s = fixture_ddpm();
    ASSERT_EQ(s.alphas_cumprod().sizes(), expected.sizes());
    EXPECT_LE(max_abs_diff(s.alphas_cumprod(), expected), kTol);
    // The same schedule read from the Euler config (which holds the DDPM keys) agrees too.
    const NoiseSchedule from_json(NoiseScheduleConfig::from_json(config_, "euler_scheduler_config.json"));
    EXPECT_LE(max_abs_diff(from_json.alphas_cumprod(), expected), kTol);
}

TEST_F(SchedulerFixture, AddNoiseVelocityAndSnrMatchDiffusers) {
    const NoiseSchedule s = fixture_ddpm();
    const at::Tensor x0 = get("x0");
    const at::Tensor noise = get("noise");
    const at::Tensor t = get("timesteps");
    EXPECT_LE(max_abs_diff(s.add_noise(x0, noise, t), get("noisy")), kTol);
    EXPECT_LE(max_abs_diff(s.velocity(x0, noise, t), get("velocity")), kTol);
    EXPECT_LE(max_abs_diff(s.target(PredictionType::kVPrediction, x0, noise, t), get("velocity")), kTol);
    // SNR spans 1e-5 .. 1e3: compare relatively (float32 carries ~7 digits).
    const at::Tensor snr = s.snr(t);
    const at::Tensor expected = get("snr_at_timesteps");
    EXPECT_LE(((snr.to(at::kDouble) - expected.to(at::kDouble)).abs() / expected.to(at::kDouble))
                  .max()
                  .item<double>(),
              kTol);
}

TEST_F(SchedulerFixture, EulerAndDDIMTimestepsAndSigmas) {
    for (int64_t n : {20, 30}) {
        SCOPED_TRACE(n);
        auto euler = make_sampler(config_);  // _class_name: EulerDiscreteScheduler
        ASSERT_STREQ(euler->name(), "euler");
        euler->set_timesteps(n);
        const at::Tensor et = get(dtune::str("euler", n, "_timesteps"));
        EXPECT_TRUE(at::equal(euler->timesteps(), et)) << euler->timesteps() << et;
        EXPECT_LE(max_abs_diff(euler->sigmas(), get(dtune::str("euler", n, "_sigmas"))), kTol);

        auto ddim = make_sampler(config_, "ddim");
        ddim->set_timesteps(n);
        const at::Tensor dt = get(dtune::str("ddim", n, "_timesteps"));
        ASSERT_EQ(ddim->timesteps().scalar_type(), at::kLong);
        EXPECT_TRUE(at::equal(ddim->timesteps(), dt.to(at::kLong))) << ddim->timesteps() << dt;
    }
}

TEST_F(SchedulerFixture, OneEulerStep) {
    auto euler = make_sampler(config_);
    euler->set_timesteps(20);
    const at::Tensor x = get("euler_step_sample");
    EXPECT_LE(max_abs_diff(euler->scale_model_input(x, 0), get("euler_step_scaled_input")), kTol);
    EXPECT_LE(max_abs_diff(euler->step(get("euler_step_model_output"), 0, x), get("euler_step_prev")), kTol);
}

TEST_F(SchedulerFixture, InitNoiseSigmaIsLeadingFormula) {
    // leading spacing: sqrt(max_sigma^2 + 1); the fixture's sample is randn * init_noise_sigma, so the
    // fixture's own sigma table gives the independent value.
    auto euler = make_sampler(config_);
    euler->set_timesteps(20);
    const double max_sigma = get("euler20_sigmas").max().item<double>();
    EXPECT_NEAR(euler->init_noise_sigma(), std::sqrt(max_sigma * max_sigma + 1), 1e-5);
}

}  // namespace
}  // namespace test_scheduler_fixtures_local
}  // namespace dtune::diffusion
