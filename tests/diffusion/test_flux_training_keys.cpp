// SimpleTuner's flow-matching sigma schedules and Flux's embedded training guidance
// (diffusion/training_sampling.h) against tools/ref/gen_flux_training_keys_ref.py, which computed
// SimpleTuner's formulas with torch, scipy and diffusers into tests/data/ref/flux_training_keys_ref.json:
// seeded draws must equal torch's for the same seed (logit-normal, uniform, Beta; static and auto
// shift, auto winning over a static shift), many Beta draws must follow scipy's quantiles, the fast
// list its frequencies, and the guidance range Python's random.uniform.
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "diffusion/training_sampling.h"

namespace dtune::diffusion {
namespace test_flux_training_keys_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

nlohmann::json reference() {
    std::ifstream in(DTUNE_TEST_DATA_DIR "/ref/flux_training_keys_ref.json");
    EXPECT_TRUE(in.good()) << "tests/data/ref/flux_training_keys_ref.json is missing";
    return nlohmann::json::parse(in);
}

at::Generator seeded(uint64_t seed) {
    return at::detail::createCPUGenerator(seed);
}

FlowMatchingOptions options_of(const nlohmann::json& c) {
    FlowMatchingOptions o;
    const std::string kind = c.at("schedule");
    o.uniform = kind == "uniform";
    o.beta = kind == "beta";
    if (o.beta) {
        o.beta_alpha = c.at("alpha");
        o.beta_beta = c.at("beta");
    }
    o.sigmoid_scale = c.value("sigmoid_scale", 1.0);
    o.shift = c.at("shift").is_null() ? std::nullopt : std::optional<double>(c.at("shift").get<double>());
    o.auto_shift = c.value("auto_shift", false);
    return o;
}

// The empirical p-quantile of a 1-D tensor.
double empirical_quantile(const at::Tensor& x, double p) {
    const at::Tensor sorted = std::get<0>(x.to(at::kDouble).sort());
    const auto i = static_cast<int64_t>(std::floor(p * static_cast<double>(x.numel() - 1)));
    return sorted[i].item<double>();
}

TEST(FluxTrainingKeys, SigmaDrawsEqualSimpleTunersForTheSameSeed) {
    const nlohmann::json ref = reference();
    ASSERT_GE(ref.at("sigma_cases").size(), 7u);
    for (const auto& c : ref.at("sigma_cases")) {
        SCOPED_TRACE(c.at("name").get<std::string>());
        const FlowMatchingOptions o = options_of(c);
        const std::vector<int64_t> shape = c.at("latent_shape");
        at::Generator g = seeded(c.at("seed"));
        const at::Tensor got = sample_flow_sigmas(c.at("n"), o, shape, g);
        const std::vector<double> want = c.at("expected");
        ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size()));
        EXPECT_EQ(got.scalar_type(), at::kFloat);
        for (size_t i = 0; i < want.size(); ++i)
            EXPECT_NEAR(got[static_cast<int64_t>(i)].item<double>(), want[i], 2e-6) << "sample " << i;
        const std::optional<double> shift = flow_shift_for(o, shape);
        if (c.at("applied_shift").is_null()) {
            EXPECT_FALSE(shift.has_value());
        } else {
            ASSERT_TRUE(shift.has_value());
            EXPECT_NEAR(*shift, c.at("applied_shift").get<double>(), 1e-12);
        }
    }
}

TEST(FluxTrainingKeys, AutoShiftIsDiffusersCalculateShift) {
    const nlohmann::json ref = reference();
    FlowMatchingOptions o;  // Flux's anchors, as the tiny pipeline's scheduler config has them
    const auto& a = ref.at("anchors");
    EXPECT_EQ(o.base_image_seq_len, a.at("base_image_seq_len").get<int64_t>());
    EXPECT_EQ(o.max_image_seq_len, a.at("max_image_seq_len").get<int64_t>());
    for (const auto& s : ref.at("auto_shift"))
        EXPECT_NEAR(flux_auto_shift(s.at("image_seq_len"), o), s.at("shift").get<double>(), 1e-12)
            << s.dump();
    // The token count is (H / 2)(W / 2) of the latents: 128x96 latents are 3072 tokens.
    o.auto_shift = true;
    EXPECT_NEAR(*flow_shift_for(o, std::vector<int64_t>{1, 16, 128, 96}), flux_auto_shift(3072, o), 1e-12);
}

TEST(FluxTrainingKeys, BetaScheduleFollowsScipysQuantiles) {
    for (const auto& q : reference().at("beta_quantiles")) {
        SCOPED_TRACE(q.dump());
        FlowMatchingOptions o;
        o.beta = true;
        o.beta_alpha = q.at("alpha");
        o.beta_beta = q.at("beta");
        o.shift = 0.0;  // unshifted, to compare with the distribution itself
        at::Generator g = seeded(2024);
        const at::Tensor s = sample_flow_sigmas(40000, o, std::vector<int64_t>{1, 16, 8, 8}, g);
        EXPECT_GE(s.min().item<double>(), 0.0);
        EXPECT_LE(s.max().item<double>(), 1.0);
        const std::vector<double> probs = q.at("probs"), want = q.at("quantiles");
        // 40000 draws: a quantile's standard error is below 0.004 here; a swapped alpha/beta or a
        // uniform draw misses by 0.05 or more.
        for (size_t i = 0; i < probs.size(); ++i)
            EXPECT_NEAR(empirical_quantile(s, probs[i]), want[i], 0.012) << "p = " << probs[i];
    }
}

TEST(FluxTrainingKeys, FastScheduleDrawsSimpleTunersListUnshifted) {
    const std::vector<double> list = reference().at("fast_schedule");
    FlowMatchingOptions o;
    o.flux_fast_schedule = true;
    o.shift = 3.0;        // never applied to the fast list
    o.auto_shift = true;  // nor this
    EXPECT_EQ(flow_sigma_schedule(o), FlowSigmaSchedule::kFluxFast);
    EXPECT_FALSE(flow_shift_for(o, std::vector<int64_t>{1, 16, 64, 64}).has_value());
    at::Generator g = seeded(5);
    const at::Tensor s = sample_flow_sigmas(20000, o, std::vector<int64_t>{1, 16, 64, 64}, g);
    std::map<double, double> expected;
    for (const double v : list) expected[v] += 1.0 / static_cast<double>(list.size());
    ASSERT_EQ(expected.size(), 4u);
    double seen = 0;
    for (const auto& [value, p] : expected) {
        const double share = s.eq(value).to(at::kDouble).mean().item<double>();
        seen += share;
        EXPECT_NEAR(share, p, 0.012) << "sigma " << value;  // binomial sd <= 0.0033
    }
    EXPECT_NEAR(seen, 1.0, 1e-12) << "the fast schedule drew a sigma outside SimpleTuner's list";
}

// SimpleTuner's if/elif: logit-normal only when no other schedule is on; then uniform, Beta, fast.
TEST(FluxTrainingKeys, ScheduleOrderFollowsSimpleTuner) {
    FlowMatchingOptions o;
    EXPECT_EQ(flow_sigma_schedule(o), FlowSigmaSchedule::kLogitNormal);
    o.flux_fast_schedule = true;
    o.beta = true;
    EXPECT_EQ(flow_sigma_schedule(o), FlowSigmaSchedule::kBeta);
    o.uniform = true;
    EXPECT_EQ(flow_sigma_schedule(o), FlowSigmaSchedule::kUniform);
    // ... and the draw is the uniform one: torch.rand then the shift.
    o.shift = 2.0;
    at::Generator a = seeded(3), b = seeded(3);
    const at::Tensor got = sample_flow_sigmas(16, o, std::vector<int64_t>{16, 16, 8, 8}, a);
    const at::Tensor u = at::rand({16}, b);
    EXPECT_TRUE(at::allclose(got, 2 * u / (1 + u), 1e-6, 1e-7));
    o.beta_alpha = 0;
    o.uniform = false;
    EXPECT_THROW(sample_flow_sigmas(2, o, std::vector<int64_t>{2, 16, 8, 8}, a), UsageError);
}

TEST(FluxTrainingKeys, EmbeddedGuidanceConstantAndRandomRange) {
    EmbeddedGuidanceOptions o;
    at::Generator g = seeded(1);
    const at::Generator before = g.clone();
    EXPECT_TRUE(at::equal(sample_embedded_guidance(3, o, g), at::full({3}, 1.0f)));
    o.value = 3.5;
    EXPECT_TRUE(at::equal(sample_embedded_guidance(2, o, g), at::full({2}, 3.5f)));
    // Constant draws nothing: the generator's stream is unchanged.
    at::Generator replay = before.clone();
    EXPECT_TRUE(at::equal(at::rand({4}, g), at::rand({4}, replay)));

    o.mode = parse_embedded_guidance_mode("random-range");
    o.min = 1.0;
    o.max = 4.0;
    at::Generator a = seeded(9), b = seeded(9);
    const at::Tensor got = sample_embedded_guidance(8, o, a);
    const at::Tensor u = at::rand({8}, b, at::kDouble);  // Python's random.uniform(a, b) = a + (b - a) U
    EXPECT_TRUE(at::allclose(got.to(at::kDouble), 1.0 + 3.0 * u, 0, 1e-6));
    at::Generator many = seeded(10);
    const at::Tensor d = sample_embedded_guidance(20000, o, many);
    EXPECT_GE(d.min().item<double>(), 1.0);
    EXPECT_LE(d.max().item<double>(), 4.0);
    EXPECT_NEAR(d.mean().item<double>(), 2.5, 0.03);  // U(1, 4): sd of the mean 0.006
    EXPECT_NEAR(empirical_quantile(d, 0.25), 1.75, 0.04);
    EXPECT_NEAR(empirical_quantile(d, 0.75), 3.25, 0.04);
    try {
        (void)parse_embedded_guidance_mode("random");
        FAIL() << "an unknown mode must be refused";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("flux_guidance_mode"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("random-range"), std::string::npos) << e.what();
    }
}

}  // namespace
}  // namespace test_flux_training_keys_local
}  // namespace dtune::diffusion
