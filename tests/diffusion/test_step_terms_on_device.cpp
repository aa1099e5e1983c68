// The noise and loss terms a CUDA-graphed step computes on the device (offset noise, input
// perturbation, min-SNR weights, huber_c), checked on the CPU:
// - min-SNR weights (epsilon and v-prediction divisors, zero-terminal SNR) and huber_c for every
//   huber_schedule against the formulas evaluated here in double from the schedule's table;
// - the same calls on meta tensors, which hold no data: any host read (.item(), a copy to the CPU)
//   throws there, as it would break a CUDA graph capture, so passing means none is made;
// - draw_training_noise: its documented draw order from a generator and from a device's default
//   generator (the same numbers), a draw count that never depends on the offset gate or the step,
//   its shapes and the statistics of the offset and the perturbation.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "diffusion/loss.h"
#include "diffusion/noise_schedule.h"
#include "diffusion/training_sampling.h"

namespace dtune::diffusion {
namespace test_step_terms_on_device_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

at::Generator seeded(uint64_t seed) {
    return at::make_generator<at::CPUGeneratorImpl>(seed);
}

const std::vector<int64_t> kTimesteps{0, 1, 37, 250, 500, 777, 998, 999};

NoiseSchedule schedule_for(PredictionType prediction, bool zero_snr = false) {
    NoiseScheduleConfig c = NoiseScheduleConfig::sdxl();
    c.prediction_type = prediction;
    c.rescale_betas_zero_snr = zero_snr;
    return NoiseSchedule(c);
}

// alphas_cumprod[t] in double, read from the schedule's own float32 table.
double alpha_bar(const NoiseSchedule& s, int64_t t) {
    return s.alphas_cumprod()[t].item<double>();
}

// min(SNR, gamma) / SNR, or / (SNR + 1) for a v-prediction schedule; SNR = a / (1 - a).
double min_snr_weight(double a, double gamma, bool v) {
    const double snr = a / (1 - a);
    return std::min(snr, gamma) / (v ? snr + 1 : snr);
}

double huber_c(HuberSchedule schedule, double c, double t, double a, int64_t T, bool flow) {
    switch (schedule) {
        case HuberSchedule::kConstant: return c;
        case HuberSchedule::kExponential: return std::pow(c, t / static_cast<double>(flow ? 1000 : T));
        case HuberSchedule::kSnr: {
            double sigma;
            if (flow) {
                const double s = t / 1000;
                sigma = std::sqrt((1 - s) / (s + 1e-4));
            } else {
                sigma = std::sqrt((1 - a) / a);
            }
            return (1 - c) / ((1 + sigma) * (1 + sigma)) + c;
        }
    }
    return NAN;
}

at::Tensor timesteps_on(const at::Device& device) {
    return at::tensor(kTimesteps, at::kLong).to(device);
}

// A prediction that misses its target by `d` everywhere in sample i: l2 per sample is d_i^2. Both
// are multiples of 1/64, so pred - target is exactly d in float32.
struct Miss {
    at::Tensor pred, target;
    std::vector<double> d;
};
Miss miss(int64_t b) {
    Miss m;
    for (int64_t i = 0; i < b; ++i) m.d.push_back(0.0625 * static_cast<double>(1 + 4 * i));
    m.target = at::round(at::randn({b, 4, 3, 3}, seeded(1), at::kFloat) * 64) / 64;
    m.pred = m.target + at::tensor(m.d, at::kFloat).view({b, 1, 1, 1});
    return m;
}

TEST(StepTermsOnDevice, MinSnrWeightsFollowTheFormulaForEpsilonAndV) {
    const int64_t b = static_cast<int64_t>(kTimesteps.size());
    const Miss m = miss(b);
    LossOptions o;
    for (const double gamma : {1.0, 5.0}) {
        o.snr_gamma = gamma;
        for (const PredictionType p : {PredictionType::kEpsilon, PredictionType::kVPrediction}) {
            const bool v = p == PredictionType::kVPrediction;
            for (const bool zero_snr : {false, true}) {
                if (zero_snr && !v) continue;  // refused (RejectsMinSnrWhereUndefined)
                const NoiseSchedule s = schedule_for(p, zero_snr);
                const at::Tensor got = per_sample_loss(m.pred, m.target, timesteps_on(at::kCPU), p, &s, o);
                const at::Tensor snr = s.snr(timesteps_on(at::kCPU));
                for (int64_t i = 0; i < b; ++i) {
                    const double a = alpha_bar(s, kTimesteps[i]);
                    const double w = min_snr_weight(a, gamma, v);
                    const double d2 = m.d[i] * m.d[i];
                    EXPECT_NEAR(got[i].item<double>(), w * d2, 2e-5 * w * d2 + 1e-9)
                        << "t " << kTimesteps[i] << " gamma " << gamma << " v " << v << " zero_snr "
                        << zero_snr;
                    if (a < 1e-12) continue;  // zero terminal SNR: SNR 0, weight 0 (checked above)
                    EXPECT_NEAR(snr[i].item<double>(), a / (1 - a), 2e-5 * a / (1 - a)) << kTimesteps[i];
                }
            }
        }
    }
}

TEST(StepTermsOnDevice, HuberCFollowsEveryScheduleAndReachesTheLoss) {
    const int64_t b = static_cast<int64_t>(kTimesteps.size());
    const Miss m = miss(b);
    const NoiseSchedule s = schedule_for(PredictionType::kEpsilon);
    for (const double c : {0.1, 0.35}) {
        for (const HuberSchedule hs :
             {HuberSchedule::kConstant, HuberSchedule::kExponential, HuberSchedule::kSnr}) {
            LossOptions o;
            o.huber_c = c;
            o.huber_schedule = hs;
            const at::Tensor t = timesteps_on(at::kCPU);
            const at::Tensor ddpm = scheduled_huber_c(t, o, &s, false);
            const at::Tensor flow = scheduled_huber_c(t.to(at::kFloat), o, nullptr, true);
            ASSERT_EQ(ddpm.sizes(), at::IntArrayRef({b}));
            ASSERT_EQ(ddpm.scalar_type(), at::kFloat);
            o.loss_type = LossType::kHuber;
            const at::Tensor huber = per_sample_loss(m.pred, m.target, t, PredictionType::kEpsilon, &s, o);
            o.loss_type = LossType::kSmoothL1;
            const at::Tensor smooth = per_sample_loss(m.pred, m.target, t, PredictionType::kEpsilon, &s, o);
            o.snr_gamma = 5.0;  // min-SNR multiplies the Huber loss too
            const at::Tensor weighted = per_sample_loss(m.pred, m.target, t, PredictionType::kEpsilon, &s, o);
            for (int64_t i = 0; i < b; ++i) {
                const double ti = static_cast<double>(kTimesteps[i]);
                const double a = alpha_bar(s, kTimesteps[i]);
                const double want = huber_c(hs, c, ti, a, 1000, false);
                const std::string where = "t " + std::to_string(kTimesteps[i]) + " c " + std::to_string(c) +
                                          " schedule " + std::to_string(static_cast<int>(hs));
                EXPECT_NEAR(ddpm[i].item<double>(), want, 1e-6 * want) << where;
                const double want_flow = huber_c(hs, c, ti, 0, 0, true);
                EXPECT_NEAR(flow[i].item<double>(), want_flow, 1e-5 * want_flow) << where << " (flow)";
                // sqrt(d^2 + c^2) - c cancels when d << c: float32 keeps about 1e-5 of it.
                const double root = std::sqrt(m.d[i] * m.d[i] + want * want) - want;
                EXPECT_NEAR(huber[i].item<double>(), 2 * want * root, 1e-4 * 2 * want * root) << where;
                EXPECT_NEAR(smooth[i].item<double>(), 2 * root, 1e-4 * 2 * root) << where;
                const double w = min_snr_weight(a, 5.0, false);
                EXPECT_NEAR(weighted[i].item<double>(), w * 2 * root, 1e-4 * w * 2 * root) << where;
            }
        }
    }
    // The exponential schedule's ends: 1 at t = 0, c at t = T.
    LossOptions o;
    o.huber_schedule = HuberSchedule::kExponential;
    EXPECT_NEAR(scheduled_huber_c(at::tensor({0, 1000}, at::kLong), o, &s, false)[1].item<double>(), 0.1,
                1e-7);
}

TEST(StepTermsOnDevice, LossTermsMakeNoHostRead) {
    const at::Device meta(at::kMeta);
    // The probe itself: a meta tensor refuses to be read on the host.
    EXPECT_ANY_THROW(at::empty({2}, at::TensorOptions().device(meta)).to(at::kCPU));
    EXPECT_ANY_THROW(at::empty({}, at::TensorOptions().device(meta)).item<double>());
    const int64_t b = static_cast<int64_t>(kTimesteps.size());
    const at::Tensor t = at::empty({b}, at::TensorOptions().dtype(at::kLong).device(meta));
    const at::Tensor pred = at::empty({b, 4, 3, 3}, at::TensorOptions().device(meta));
    const at::Tensor target = at::empty_like(pred);
    for (const PredictionType p : {PredictionType::kEpsilon, PredictionType::kVPrediction}) {
        const NoiseSchedule s = schedule_for(p);
        EXPECT_TRUE(s.snr(t).is_meta());
        for (const HuberSchedule hs :
             {HuberSchedule::kConstant, HuberSchedule::kExponential, HuberSchedule::kSnr}) {
            for (const LossType lt : {LossType::kL2, LossType::kHuber, LossType::kSmoothL1}) {
                LossOptions o;
                o.loss_type = lt;
                o.huber_schedule = hs;
                o.snr_gamma = 5.0;
                at::Tensor loss;
                ASSERT_NO_THROW(loss = diffusion_loss(pred, target, t, p, &s, o)) << static_cast<int>(hs);
                EXPECT_TRUE(loss.is_meta());
                EXPECT_EQ(loss.dim(), 0);
                const at::Tensor c = scheduled_huber_c(t, o, &s, false);
                EXPECT_TRUE(c.is_meta());
                EXPECT_EQ(c.sizes(), at::IntArrayRef({b}));
                EXPECT_TRUE(scheduled_huber_c(t.to(at::kFloat), o, nullptr, true).is_meta());
            }
        }
    }
    // The refusals are decided from the configuration, before any tensor: the same on the device.
    LossOptions o;
    o.snr_gamma = 5.0;
    const NoiseSchedule zero_eps = schedule_for(PredictionType::kEpsilon, true);
    EXPECT_THROW(diffusion_loss(pred, target, t, PredictionType::kEpsilon, &zero_eps, o), UsageError);
    const NoiseSchedule eps = schedule_for(PredictionType::kEpsilon);
    EXPECT_THROW(diffusion_loss(pred, target, t, PredictionType::kSample, &eps, o), UsageError);
}

NoiseOptions every_option(double probability) {
    NoiseOptions o;
    o.offset_noise = true;
    o.noise_offset = 0.1;
    o.noise_offset_probability = probability;
    o.input_perturbation = 0.2;
    return o;
}

TEST(StepNoise, DrawsInItsDocumentedOrderFromAGeneratorOrTheDefaultOne) {
    const std::vector<int64_t> shape{3, 4, 5, 6};
    const at::Device cpu(at::kCPU);
    int applied = 0;
    for (uint64_t seed = 0; seed < 24; ++seed) {
        const NoiseOptions o = every_option(0.5);
        at::Generator g = seeded(seed);
        const TrainingNoise n = draw_training_noise(shape, o, 0, g, cpu);
        // The replay: noise, the gate's uniform, the per-channel offset, the perturbation.
        at::Generator r = seeded(seed);
        const at::Tensor base = at::randn(shape, r);
        const bool gate = at::rand({1}, r).item<double>() < 0.5;
        const at::Tensor offset = at::randn({3, 4, 1, 1}, r);
        const at::Tensor perturb = at::randn(shape, r);
        applied += gate ? 1 : 0;
        EXPECT_TRUE(at::allclose(n.noise, gate ? base + 0.1 * offset : base, 0, 1e-7)) << seed;
        EXPECT_TRUE(at::allclose(n.input_noise, n.noise + 0.2 * perturb, 0, 1e-7)) << seed;
        // Whether the offset applied or not, the same numbers were drawn: a CUDA graph replays the
        // same kernels and a resumed run continues the same stream.
        EXPECT_TRUE(at::equal(g.get_state(), r.get_state())) << seed;
        // No generator: the device's default one draws the same stream (here the CPU's).
        at::manual_seed(seed);
        const TrainingNoise d = draw_training_noise(shape, o, 0, std::nullopt, cpu);
        EXPECT_TRUE(at::equal(d.noise, n.noise)) << seed;
        EXPECT_TRUE(at::equal(d.input_noise, n.input_noise)) << seed;
    }
    EXPECT_GT(applied, 4);  // both branches of the gate were taken
    EXPECT_LT(applied, 20);
    // Probability 1 makes no uniform draw; the perturbation's decay keeps its draw (times 0).
    NoiseOptions o = every_option(1.0);
    o.input_perturbation_steps = 10;
    at::Generator g = seeded(3);
    const TrainingNoise late = draw_training_noise(shape, o, 12, g, cpu);
    at::Generator r = seeded(3);
    const at::Tensor base = at::randn(shape, r);
    const at::Tensor offset = at::randn({3, 4, 1, 1}, r);
    at::randn(shape, r);
    EXPECT_TRUE(at::allclose(late.noise, base + 0.1 * offset, 0, 1e-7));
    EXPECT_TRUE(at::equal(late.input_noise, late.noise));
    EXPECT_TRUE(at::equal(g.get_state(), r.get_state()));
    EXPECT_DOUBLE_EQ(input_perturbation_scale(o, 0), 0.2);
    EXPECT_DOUBLE_EQ(input_perturbation_scale(o, 5), 0.1);
    EXPECT_DOUBLE_EQ(input_perturbation_scale(o, 10), 0.0);
    EXPECT_DOUBLE_EQ(input_perturbation_scale(o, 11), 0.0);
    // Flow matching never takes the offset (SimpleTuner); its draws are plain noise.
    at::Generator f = seeded(3);
    NoiseOptions offset_only;
    offset_only.offset_noise = true;
    const TrainingNoise flow = draw_training_noise(shape, offset_only, 0, f, cpu, true);
    EXPECT_TRUE(at::equal(flow.noise, base));
}

TEST(StepNoise, OffsetAndPerturbationHaveTheirStatisticsAndMakeNoHostRead) {
    // 1024 channels of 32 x 32: a channel's mean has variance 1 / 1024 plus noise_offset^2 when the
    // offset is always on.
    const std::vector<int64_t> shape{256, 4, 32, 32};
    NoiseOptions o = every_option(1.0);
    o.noise_offset = 0.3;
    at::Generator g = seeded(11);
    const TrainingNoise n = draw_training_noise(shape, o, 0, g, at::kCPU);
    EXPECT_EQ(n.noise.sizes(), at::IntArrayRef(shape));
    EXPECT_EQ(n.input_noise.sizes(), at::IntArrayRef(shape));
    EXPECT_EQ(n.noise.scalar_type(), at::kFloat);
    const double channel_var = n.noise.mean({2, 3}).var().item<double>();
    EXPECT_NEAR(channel_var, 1.0 / 1024 + 0.09, 0.15 * 0.09);
    const at::Tensor perturbation = n.input_noise - n.noise;  // 0.2 * N(0, 1), independent of the noise
    EXPECT_NEAR(perturbation.std().item<double>(), 0.2, 0.002);
    EXPECT_NEAR(perturbation.mean().item<double>(), 0.0, 0.001);
    const double corr =
        ((perturbation * n.noise).mean() / (perturbation.std() * n.noise.std())).item<double>();
    EXPECT_NEAR(corr, 0.0, 0.01);
    // Without the offset a channel's mean is plain noise: the offset's variance is what it adds.
    at::Generator p = seeded(11);
    const TrainingNoise plain = draw_training_noise(shape, NoiseOptions{}, 0, p, at::kCPU);
    EXPECT_NEAR(plain.noise.mean({2, 3}).var().item<double>(), 1.0 / 1024, 0.15 / 1024);
    // On a device with its default generator (meta: no data, any host read throws) and the gate on.
    const at::Device meta(at::kMeta);
    TrainingNoise m;
    ASSERT_NO_THROW(m = draw_training_noise(shape, every_option(0.25), 0, std::nullopt, meta));
    EXPECT_TRUE(m.noise.is_meta());
    EXPECT_TRUE(m.input_noise.is_meta());
    EXPECT_EQ(m.input_noise.sizes(), at::IntArrayRef(shape));
}

}  // namespace
}  // namespace test_step_terms_on_device_local
}  // namespace dtune::diffusion
