// Training-side diffusion math against closed forms computed here in double: beta schedules, the
// zero-SNR rescale, noising, min-SNR and Huber weights, timestep bias and segmented sampling, offset
// noise and input perturbation, flow-matching shifts. Plus determinism from an explicit generator.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "diffusion/loss.h"
#include "diffusion/noise_schedule.h"
#include "diffusion/training_sampling.h"

namespace dtune::diffusion {
namespace test_training_math_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

at::Generator seeded(uint64_t seed) {
    return at::make_generator<at::CPUGeneratorImpl>(seed);
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
    return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

TEST(BetaSchedules, LinearAndScaledLinearClosedForms) {
    const int64_t n = 1000;
    const at::Tensor lin = make_betas(BetaSchedule::kLinear, n, 1e-4, 0.02);
    const at::Tensor scaled = make_betas(BetaSchedule::kScaledLinear, n, 0.00085, 0.012);
    for (int64_t i : {0, 1, 421, 998, 999}) {
        const double f = static_cast<double>(i) / static_cast<double>(n - 1);
        EXPECT_NEAR(lin[i].item<double>(), 1e-4 + f * (0.02 - 1e-4), 1e-8);
        const double r = std::sqrt(0.00085) + f * (std::sqrt(0.012) - std::sqrt(0.00085));
        EXPECT_NEAR(scaled[i].item<double>(), r * r, 1e-8);
    }
}

TEST(BetaSchedules, CosineStaysBelowCapAndFollowsAlphaBar) {
    const at::Tensor betas = make_betas(BetaSchedule::kSquaredCosCapV2, 1000, 0, 0);
    EXPECT_LE(betas.max().item<double>(), 0.999 + 1e-7);
    // prod(1 - beta) over the first k steps telescopes to alpha_bar(k / T) / alpha_bar(0).
    const auto abar = [](double t) { return std::pow(std::cos((t + 0.008) / 1.008 * M_PI / 2), 2); };
    const at::Tensor ac = at::cumprod(1 - betas.to(at::kDouble), 0);
    for (int64_t k : {1, 100, 500, 900})
        EXPECT_NEAR(ac[k - 1].item<double>(), abar(k / 1000.0) / abar(0), 1e-6);
}

TEST(BetaSchedules, ZeroTerminalSnrRescale) {
    const at::Tensor betas = make_betas(BetaSchedule::kScaledLinear, 1000, 0.00085, 0.012);
    const at::Tensor old_root = at::cumprod(1 - betas.to(at::kDouble), 0).sqrt();
    const at::Tensor new_ac = at::cumprod(1 - rescale_zero_terminal_snr(betas).to(at::kDouble), 0);
    // sqrt(alphas_cumprod) is mapped affinely: first kept, last sent to 0.
    const double r0 = old_root[0].item<double>();
    const double rT = old_root[-1].item<double>();
    const at::Tensor expected = ((old_root - rT) * (r0 / (r0 - rT))).pow(2);
    EXPECT_LE(max_abs_diff(new_ac, expected), 1e-5);
    EXPECT_NEAR(new_ac[-1].item<double>(), 0.0, 1e-12);
}

TEST(NoiseScheduleMath, AddNoiseVelocityTargetsClosedForm) {
    const NoiseSchedule s;  // SDXL
    at::Generator g = seeded(3);
    const at::Tensor x0 = at::randn({2, 4, 3, 3}, g);
    const at::Tensor noise = at::randn({2, 4, 3, 3}, g);
    const at::Tensor t = at::tensor({10, 900}, at::kLong);
    const at::Tensor ac = s.alphas_cumprod().to(at::kDouble).index_select(0, t).view({2, 1, 1, 1});
    const at::Tensor x = x0.to(at::kDouble);
    const at::Tensor e = noise.to(at::kDouble);
    EXPECT_LE(max_abs_diff(s.add_noise(x0, noise, t), ac.sqrt() * x + (1 - ac).sqrt() * e), 1e-6);
    EXPECT_LE(max_abs_diff(s.target(PredictionType::kVPrediction, x0, noise, t),
                           ac.sqrt() * e - (1 - ac).sqrt() * x),
              1e-6);
    EXPECT_TRUE(at::equal(s.target(PredictionType::kEpsilon, x0, noise, t), noise));
    EXPECT_TRUE(at::equal(s.target(PredictionType::kSample, x0, noise, t), x0));
    EXPECT_TRUE(at::equal(s.target(PredictionType::kFlowMatching, x0, noise, t), noise - x0));
    const at::Tensor snr = s.snr(t).to(at::kDouble);
    EXPECT_LE(max_abs_diff(snr / (ac.view({2}) / (1 - ac.view({2}))), at::ones({2}, at::kDouble)), 1e-5);
}

TEST(LossMath, MinSnrWeights) {
    const at::Tensor snr = at::tensor({0.5, 5.0, 20.0}, at::kFloat);
    EXPECT_LE(max_abs_diff(min_snr_weights(snr, 5.0, PredictionType::kEpsilon), at::tensor({1.0, 1.0, 0.25})),
              1e-7);
    EXPECT_LE(max_abs_diff(min_snr_weights(snr, 5.0, PredictionType::kVPrediction),
                           at::tensor({0.5 / 1.5, 5.0 / 6.0, 5.0 / 21.0})),
              1e-7);
}

TEST(LossMath, L2HuberSmoothL1AndMinSnr) {
    const NoiseSchedule s;
    const at::Tensor pred = at::tensor({0.5, -1.0, 2.0, 0.0}, at::kFloat).view({2, 2, 1, 1});
    const at::Tensor target = at::tensor({0.0, 0.0, 1.0, 3.0}, at::kFloat).view({2, 2, 1, 1});
    const at::Tensor t = at::tensor({0, 999}, at::kLong);
    LossOptions o;  // l2, snr_weight 1
    EXPECT_LE(max_abs_diff(per_sample_loss(pred, target, t, PredictionType::kEpsilon, &s, o),
                           at::tensor({(0.25 + 1.0) / 2, (1.0 + 9.0) / 2})),
              1e-6);
    o.snr_weight = 0.5;
    EXPECT_NEAR(diffusion_loss(pred, target, t, PredictionType::kEpsilon, &s, o).item<double>(),
                0.5 * (0.625 + 5.0) / 2, 1e-6);
    o.snr_weight = 1.0;
    o.snr_gamma = 5.0;  // snr(0) ~ 1175 -> weight 5/1175; snr(999) ~ 0.0047 -> weight 1
    const at::Tensor snr = s.snr(t).to(at::kDouble);
    const at::Tensor w = at::clamp_max(snr, 5.0) / snr;
    EXPECT_LE(max_abs_diff(per_sample_loss(pred, target, t, PredictionType::kEpsilon, &s, o),
                           at::tensor({0.625, 5.0}, at::kDouble) * w),
              1e-6);
    // pseudo-Huber with constant c = 0.1: 2c (sqrt(d^2 + c^2) - c); smooth_l1 drops the leading c.
    o = LossOptions{};
    o.loss_type = LossType::kHuber;
    o.huber_schedule = HuberSchedule::kConstant;
    const auto huber = [](double d, double c) { return 2 * c * (std::sqrt(d * d + c * c) - c); };
    EXPECT_NEAR(per_sample_loss(pred, target, t, PredictionType::kEpsilon, &s, o)[0].item<double>(),
                (huber(0.5, 0.1) + huber(1.0, 0.1)) / 2, 1e-6);
    o.loss_type = LossType::kSmoothL1;
    EXPECT_NEAR(per_sample_loss(pred, target, t, PredictionType::kEpsilon, &s, o)[1].item<double>(),
                (huber(1.0, 0.1) + huber(3.0, 0.1)) / 2 / 0.1, 1e-6);
}

TEST(LossMath, ScheduledHuberC) {
    const NoiseSchedule s;
    const at::Tensor t = at::tensor({0, 500, 999}, at::kLong);
    LossOptions o;  // huber_schedule snr (SimpleTuner's default), c = 0.1
    o.loss_type = LossType::kHuber;
    const at::Tensor ac = s.alphas_cumprod().to(at::kDouble).index_select(0, t);
    const at::Tensor sigma = ((1 - ac) / ac).sqrt();
    EXPECT_LE(max_abs_diff(scheduled_huber_c(t, o, &s, false), 0.9 / (1 + sigma).pow(2) + 0.1), 1e-6);
    o.huber_schedule = HuberSchedule::kExponential;  // exp(-t ln(1/c) / T): 1 at t=0, c at t=T
    EXPECT_LE(max_abs_diff(scheduled_huber_c(t, o, &s, false),
                           at::tensor({1.0, std::pow(0.1, 0.5), std::pow(0.1, 0.999)})),
              1e-6);
    o.huber_schedule = HuberSchedule::kSnr;  // flow: s = t / 1000, sigma = sqrt((1 - s) / (s + 1e-4))
    const at::Tensor ft = at::tensor({250.0f});
    const double fs = std::sqrt(0.75 / (0.25 + 1e-4));
    EXPECT_NEAR(scheduled_huber_c(ft, o, nullptr, true).item<double>(), 0.9 / std::pow(1 + fs, 2) + 0.1,
                1e-6);
}

TEST(LossMath, RejectsMinSnrWhereUndefined) {
    NoiseScheduleConfig zc = NoiseScheduleConfig::sdxl();
    zc.rescale_betas_zero_snr = true;
    const NoiseSchedule zsnr(zc);
    LossOptions o;
    o.snr_gamma = 5.0;
    const at::Tensor p = at::zeros({1, 1, 1, 1});
    const at::Tensor t = at::tensor({999}, at::kLong);
    EXPECT_THROW(per_sample_loss(p, p, t, PredictionType::kEpsilon, &zsnr, o), UsageError);
    const NoiseSchedule s;
    EXPECT_THROW(per_sample_loss(p, p, t, PredictionType::kSample, &s, o), UsageError);
    EXPECT_THROW(parse_loss_type("l1"), UsageError);
}

TEST(TimestepBias, WeightsPerStrategy) {
    TimestepBiasOptions o;
    EXPECT_TRUE(at::equal(timestep_weights(o, 1000), at::ones({1000})));
    o.strategy = TimestepBiasStrategy::kLater;  // last 25% doubled
    o.multiplier = 2.0;
    at::Tensor w = timestep_weights(o, 1000);
    const double total = 750 + 250 * 2.0;
    EXPECT_NEAR(w[0].item<double>(), 1 / total, 1e-9);
    EXPECT_NEAR(w[749].item<double>(), 1 / total, 1e-9);
    EXPECT_NEAR(w[750].item<double>(), 2 / total, 1e-9);
    EXPECT_NEAR(w.sum().item<double>(), 1.0, 1e-5);
    o.strategy = TimestepBiasStrategy::kEarlier;
    w = timestep_weights(o, 1000);
    EXPECT_NEAR(w[249].item<double>(), 2 / total, 1e-9);
    EXPECT_NEAR(w[250].item<double>(), 1 / total, 1e-9);
    o.strategy = TimestepBiasStrategy::kRange;
    o.begin = 200;
    o.end = 500;
    o.multiplier = 3.0;
    w = timestep_weights(o, 1000);
    EXPECT_NEAR(w[199].item<double>(), 1 / 1600.0, 1e-9);
    EXPECT_NEAR(w[200].item<double>(), 3 / 1600.0, 1e-9);
    EXPECT_NEAR(w[500].item<double>(), 1 / 1600.0, 1e-9);
    o.end = 1001;
    EXPECT_THROW(timestep_weights(o, 1000), UsageError);
    o.end = 500;
    o.multiplier = 0;
    EXPECT_THROW(timestep_weights(o, 1000), UsageError);
    EXPECT_THROW(parse_timestep_bias_strategy("middle"), UsageError);
}

TEST(TimestepSampling, SegmentedGivesOneTimestepPerSegment) {
    at::Generator g = seeded(11);
    for (int rep = 0; rep < 50; ++rep) {
        const at::Tensor t = sample_timesteps(4, 1000, {}, g);
        ASSERT_EQ(t.scalar_type(), at::kLong);
        // Segments of 250 from the top, sharing boundaries: [749, 999], [499, 749], [249, 499], [0, 499].
        EXPECT_GE(t[0].item<int64_t>(), 749);
        EXPECT_LE(t[0].item<int64_t>(), 999);
        EXPECT_GE(t[1].item<int64_t>(), 499);
        EXPECT_LE(t[1].item<int64_t>(), 749);
        EXPECT_GE(t[2].item<int64_t>(), 249);
        EXPECT_LE(t[2].item<int64_t>(), 499);
        EXPECT_LE(t[3].item<int64_t>(), 249);
    }
}

TEST(TimestepSampling, BiasSteersTheDrawsAndSeedsRepeat) {
    TimestepSamplingOptions o;
    o.disable_segmented_timestep_sampling = true;
    o.bias.strategy = TimestepBiasStrategy::kLater;
    o.bias.multiplier = 1e7;  // unbiased mass 750 / (750 + 2.5e9): never drawn in 512 tries in practice
    at::Generator g = seeded(5);
    const at::Tensor t = sample_timesteps(512, 1000, o, g);
    EXPECT_GE(t.min().item<int64_t>(), 750);
    at::Generator a = seeded(42);
    at::Generator b = seeded(42);
    EXPECT_TRUE(at::equal(sample_timesteps(8, 1000, {}, a), sample_timesteps(8, 1000, {}, b)));
}

TEST(TrainingNoise, OffsetNoiseAndPerturbationFollowTheirDefinition) {
    const at::Tensor latents = at::zeros({2, 4, 8, 8});
    NoiseOptions o;
    o.offset_noise = true;
    o.noise_offset_probability = 1.0;
    o.input_perturbation = 0.1;
    at::Generator g = seeded(9);
    const TrainingNoise n = sample_training_noise(latents, o, 0, g);
    // Replay the draws: base noise, the per-channel offset, then the perturbation.
    at::Generator r = seeded(9);
    const at::Tensor base = at::randn({2, 4, 8, 8}, r);
    const at::Tensor offset = at::randn({2, 4, 1, 1}, r);
    const at::Tensor perturb = at::randn({2, 4, 8, 8}, r);
    EXPECT_LE(max_abs_diff(n.noise, base + 0.1 * offset), 1e-7);
    EXPECT_LE(max_abs_diff(n.input_noise, n.noise + 0.1 * perturb), 1e-7);
    // Defaults (SimpleTuner): offset noise off, no perturbation -> input_noise is the noise.
    at::Generator d = seeded(9);
    const TrainingNoise plain = sample_training_noise(latents, NoiseOptions{}, 0, d);
    EXPECT_TRUE(at::equal(plain.noise, base));
    EXPECT_TRUE(at::equal(plain.input_noise, plain.noise));
    // Perturbation decays to nothing at input_perturbation_steps.
    o.input_perturbation_steps = 10;
    at::Generator e = seeded(1);
    const TrainingNoise late = sample_training_noise(latents, o, 10, e);
    EXPECT_TRUE(at::equal(late.input_noise, late.noise));
}

TEST(TrainingNoise, ProbabilityGatesTheOffset) {
    NoiseOptions o;
    o.offset_noise = true;
    o.noise_offset_probability = 0.25;
    int applied = 0;
    at::Generator g = seeded(123);
    for (int i = 0; i < 400; ++i) {
        at::Generator replay = g.clone();
        const TrainingNoise n = sample_training_noise(at::zeros({1, 1, 2, 2}), o, 0, g);
        const at::Tensor base = at::randn({1, 1, 2, 2}, replay);
        applied += at::equal(n.noise, base) ? 0 : 1;
    }
    EXPECT_GT(applied, 60);  // binomial(400, 0.25): mean 100, sd 8.7
    EXPECT_LT(applied, 140);
}

TEST(FlowMatching, ShiftsSigmasAndTargets) {
    EXPECT_NEAR(apply_flow_shift(at::tensor({0.5}), 3.0).item<double>(), 0.75, 1e-7);
    EXPECT_NEAR(apply_flow_shift(at::tensor({1.0}), 3.0).item<double>(), 1.0, 1e-7);
    FlowMatchingOptions o;
    EXPECT_NEAR(flux_auto_shift(256, o), std::exp(0.5), 1e-9);
    EXPECT_NEAR(flux_auto_shift(4096, o), std::exp(1.15), 1e-9);
    at::Generator g = seeded(4);
    const at::Tensor s = sample_flow_sigmas(64, o, {64, 16, 32, 32}, g);
    EXPECT_GT(s.min().item<double>(), 0.0);
    EXPECT_LT(s.max().item<double>(), 1.0);
    // Replay: logit-normal then the static shift 3.
    at::Generator r = seeded(4);
    EXPECT_LE(max_abs_diff(s, apply_flow_shift(at::sigmoid(at::randn({64}, r)), 3.0)), 1e-7);
    o.shift = std::nullopt;
    o.auto_shift = true;  // 64x64 latents, patch 2 -> 1024 tokens
    at::Generator a = seeded(4);
    at::Generator b = seeded(4);
    EXPECT_LE(max_abs_diff(sample_flow_sigmas(8, o, {8, 16, 64, 64}, a),
                           apply_flow_shift(at::sigmoid(at::randn({8}, b)), flux_auto_shift(1024, o))),
              1e-7);
    const at::Tensor x0 = at::ones({2, 1, 1, 1});
    const at::Tensor noise = at::full({2, 1, 1, 1}, 3.0);
    EXPECT_LE(max_abs_diff(flow_noisy_latents(x0, noise, at::tensor({0.0f, 0.25f})),
                           at::tensor({1.0, 1.5}).view({2, 1, 1, 1})),
              1e-7);
    EXPECT_NEAR(flow_timesteps(at::tensor({0.25f})).item<double>(), 250.0, 1e-4);
}

}  // namespace
}  // namespace test_training_math_local
}  // namespace dtune::diffusion
