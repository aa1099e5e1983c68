// Offset noise, input perturbation, min-SNR weighting and the Huber losses in the training step
// (tiny SDXL fixture, CPU):
// - with StepOptions::device_rng (what a CUDA graph captures; on the CPU the CPU's default generator
//   plays the device's), the micro-step draws noise, offset gate, offset, perturbation and timesteps
//   in its documented order from the default generator only, is reproducible from the seed, keeps a
//   data-parallel rank's rows of the global draws, and its loss is the formula evaluated here in
//   double from those draws (huber_c per sample from the schedule, min-SNR weights, epsilon and v);
// - an eager run with every one of these options resumes bit for bit, and each option changes
//   training.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "models/common/weights.h"
#include "train/step.h"
#include "trainer_test_util.h"

namespace dtune::train {
namespace test_step_noise_loss_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using testutil::tiny_schedule;
using testutil::tiny_unet;

diffusion::NoiseSchedule schedule_predicting(diffusion::PredictionType p) {
    diffusion::NoiseScheduleConfig c = tiny_schedule().config();
    c.prediction_type = p;
    return diffusion::NoiseSchedule(c);
}

StepOptions every_option(diffusion::PredictionType p) {
    StepOptions o;
    o.device_rng = true;
    o.prediction = p;
    o.noise.offset_noise = true;
    o.noise.noise_offset = 0.1;
    o.noise.noise_offset_probability = 0.5;
    o.noise.input_perturbation = 0.1;
    o.loss.loss_type = diffusion::LossType::kHuber;
    o.loss.huber_schedule = diffusion::HuberSchedule::kSnr;
    o.loss.huber_c = 0.1;
    o.loss.snr_gamma = 5.0;
    return o;
}

TEST(StepNoiseLoss, DeviceDrawsFollowTheirOrderAndTheLossItsFormula) {
    const TrainBatch batch = testutil::tiny_batch(3);
    const int64_t b = batch.latents.size(0);
    auto unet = tiny_unet();
    auto model = testutil::sdxl_model(unet);
    int gated = 0;
    for (const auto p : {diffusion::PredictionType::kEpsilon, diffusion::PredictionType::kVPrediction}) {
        const bool v = p == diffusion::PredictionType::kVPrediction;
        const diffusion::NoiseSchedule schedule = schedule_predicting(p);
        const StepOptions options = every_option(p);
        at::Generator gen = at::detail::createCPUGenerator(99);
        const at::Tensor gen_state = gen.get_state();
        for (const uint64_t seed : {1, 2, 3}) {
            at::manual_seed(seed);
            const MicroStep a = micro_step(*model, batch, schedule, options, 0, gen);
            if (seed == 1) {
                at::manual_seed(seed);
                const MicroStep again = micro_step(*model, batch, schedule, options, 0, gen);
                EXPECT_EQ(a.loss.item<double>(), again.loss.item<double>());
            }
            EXPECT_TRUE(at::equal(gen.get_state(), gen_state))
                << "device_rng drew from the generator passed in";

            // The draws in their documented order from the default generator: the noise
            // (draw_training_noise: noise, gate, offset, perturbation), then uniform timesteps.
            at::manual_seed(seed);
            const at::Tensor base = at::randn(batch.latents.sizes());
            const bool gate = at::rand({1}).item<double>() < 0.5;
            const at::Tensor offset = at::randn({b, 4, 1, 1});
            const at::Tensor perturb = at::randn(batch.latents.sizes());
            const at::Tensor t = at::randint(0, 1000, {b}, at::kLong);
            gated += gate ? 1 : 0;
            const at::Tensor noise = gate ? base + 0.1 * offset : base;
            const at::Tensor input_noise = noise + 0.1 * perturb;
            ASSERT_TRUE(at::equal(a.timesteps, t)) << seed;
            const at::Tensor x0 = batch.latents.to(at::kFloat);
            const at::Tensor ac = schedule.alphas_cumprod().index_select(0, t).to(at::kDouble);  // [B]
            const at::Tensor sa = ac.sqrt().view({b, 1, 1, 1}).to(at::kFloat);
            const at::Tensor s1a = (1 - ac).sqrt().view({b, 1, 1, 1}).to(at::kFloat);
            const at::Tensor target = v ? sa * noise - s1a * x0 : noise;
            EXPECT_TRUE(at::allclose(a.target, target, 1e-5, 1e-6)) << seed;
            at::Tensor pred;
            {
                at::NoGradGuard no_grad;
                pred = model->forward(sa * x0 + s1a * input_noise, t, batch.cond).to(at::kDouble);
            }
            // Per sample in double: c = 0.9 / (1 + sigma)^2 + 0.1, sigma = sqrt((1 - a) / a); the
            // pseudo-Huber 2c (sqrt(d^2 + c^2) - c) averaged, times min(SNR, 5) / SNR (or / (SNR + 1)).
            double expected = 0;
            for (int64_t i = 0; i < b; ++i) {
                const double a_t = ac[i].item<double>();
                const double sigma = std::sqrt((1 - a_t) / a_t), c = 0.9 / std::pow(1 + sigma, 2) + 0.1;
                const at::Tensor d = pred[i] - target[i].to(at::kDouble);
                const double huber = (2 * c * ((d * d + c * c).sqrt() - c)).mean().item<double>();
                const double snr = a_t / (1 - a_t);
                expected += huber * std::min(snr, 5.0) / (v ? snr + 1 : snr) / static_cast<double>(b);
            }
            EXPECT_NEAR(a.loss.item<double>(), expected, 1e-4 * expected) << seed << (v ? " v" : " epsilon");

            // Data parallelism: rank 1 of 3 with one row each keeps row 1 of the global draws.
            if (seed != 2) continue;
            StepOptions rank1 = options;
            rank1.rank = 1;
            rank1.world_size = 3;
            const TrainBatch row1 = testutil::batch_rows(batch, 1, 1);
            at::manual_seed(seed);
            const MicroStep r = micro_step(*model, row1, schedule, rank1, 0, gen);
            EXPECT_TRUE(at::equal(r.timesteps, a.timesteps.narrow(0, 1, 1))) << seed;
            EXPECT_TRUE(at::allclose(r.target, a.target.narrow(0, 1, 1), 1e-6, 1e-7)) << seed;
        }
    }
    EXPECT_GT(gated, 0);  // the offset gate went both ways
    EXPECT_LT(gated, 6);
    // A decaying perturbation cannot be frozen into a graph: refused with device draws.
    StepOptions decaying = every_option(diffusion::PredictionType::kEpsilon);
    decaying.noise.input_perturbation_steps = 100;
    at::Generator gen = at::detail::createCPUGenerator(1);
    EXPECT_THROW(micro_step(*model, batch, tiny_schedule(), decaying, 0, gen), UsageError);
}

io::TensorList run_trainer(const std::filesystem::path& out, int64_t steps, const nlohmann::json& extra,
                           TrainResult* result = nullptr) {
    Trainer trainer(testutil::tiny_config(out, steps, extra), testutil::sdxl_model(tiny_unet()),
                    tiny_schedule(), testutil::synthetic());
    const TrainResult r = trainer.run();
    if (result) *result = r;
    return models::state_dict(*testutil::unet_of(trainer));
}

double max_difference(const io::TensorList& a, const io::TensorList& b) {
    double d = 0;
    for (size_t i = 0; i < a.size(); ++i)
        d = std::max(d, (a[i].second - b[i].second).abs().max().item<double>());
    return d;
}

// The eager trainer (CPU generator): 4 steps straight equal 2 steps, a resume and 2 more, bit for
// bit, with offset noise (gated), input perturbation, min-SNR and a scheduled Huber loss; and each
// option moves the weights away from the plain run's. snr_gamma 0.5: a sample weighs less only where
// SNR > gamma, and SDXL's SNR falls below 1 from t ~ 370 on, so with 5 (or 1) both samples of both
// steps can weigh 1 and the run is the plain one, bit for bit.
TEST(StepNoiseLoss, EveryOptionResumesExactlyAndChangesTraining) {
    const nlohmann::json all{{"offset_noise", true},
                             {"noise_offset", 0.1},
                             {"noise_offset_probability", 0.5},
                             {"input_perturbation", 0.1},
                             {"snr_gamma", 0.5},
                             {"loss_type", "huber"},
                             {"huber_schedule", "snr"},
                             {"checkpoint_step_interval", 2}};
    test::TempDir straight, split, plain;
    nlohmann::json fresh = all;
    fresh["resume_from_checkpoint"] = "none";
    const io::TensorList a = run_trainer(straight.path(), 4, fresh);
    TrainResult first, second;
    run_trainer(split.path(), 2, all, &first);
    EXPECT_FALSE(first.resumed_from.has_value());
    const io::TensorList b = run_trainer(split.path(), 4, all, &second);
    ASSERT_TRUE(second.resumed_from.has_value());
    EXPECT_EQ(second.resumed_from->filename(), "checkpoint-2");
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;

    const nlohmann::json no_checkpoints{{"checkpoint_step_interval", 0}};
    const io::TensorList base = run_trainer(plain.path() / "base", 2, no_checkpoints);
    for (const nlohmann::json& option :
         {nlohmann::json{{"offset_noise", true}, {"noise_offset_probability", 1.0}},
          nlohmann::json{{"input_perturbation", 0.1}}, nlohmann::json{{"snr_gamma", 0.5}},
          nlohmann::json{{"loss_type", "smooth_l1"}, {"huber_schedule", "constant"}}}) {
        nlohmann::json keys = option;
        keys.update(no_checkpoints);
        EXPECT_GT(max_difference(base, run_trainer(plain.path() / "option", 2, keys)), 0.0) << option.dump();
        std::filesystem::remove_all(plain.path() / "option");
    }
}

}  // namespace
}  // namespace test_step_noise_loss_local
}  // namespace dtune::train
