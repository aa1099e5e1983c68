// is_regularisation_data on the tiny SDXL fixture (CPU): a LoRA run's regularisation batch trains
// toward the base model's prediction (checked against a separately loaded UNet without adapters,
// with the step's draws reproduced), the adapters are back on afterwards and still get gradients;
// a full fine-tune trains such a batch exactly like any other.
#include <gtest/gtest.h>

#include "diffusion/training_sampling.h"
#include "models/adapters/lora.h"
#include "train/step.h"
#include "trainer_test_util.h"

namespace dtune::train {
namespace test_regularisation_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using testutil::tiny_schedule;
using testutil::tiny_unet;

double max_diff(const at::Tensor& a, const at::Tensor& b) {
    return (a - b).abs().max().item<double>();
}

// What micro_step draws with the generator seeded `seed` (StepOptions defaults, one process).
struct Draws {
    at::Tensor noise, noisy, t;
};
Draws reproduce_draws(const TrainBatch& batch, const diffusion::NoiseSchedule& schedule, uint64_t seed) {
    const StepOptions so;
    auto gen = at::detail::createCPUGenerator(seed);
    const diffusion::TrainingNoise n = diffusion::sample_training_noise(batch.latents, so.noise, 0, gen);
    Draws d;
    d.t =
        diffusion::sample_timesteps(batch.latents.size(0), schedule.num_train_timesteps(), so.timesteps, gen);
    d.noise = n.noise;
    d.noisy = schedule.add_noise(batch.latents, n.input_noise, d.t);  // [B, C, h, w]
    return d;
}

at::Tensor forward(models::UNet2DConditionModelImpl& unet, const TrainBatch& b, const Draws& d) {
    at::NoGradGuard no_grad;
    return unet.forward(d.noisy, d.t, b.cond.at("prompt_embeds"),
                        {b.cond.at("pooled_prompt_embeds"), b.cond.at("time_ids")});  // [B, C, h, w]
}

TEST(Regularisation, LoRABatchTrainsTowardTheBaseModelsPrediction) {
    auto unet = tiny_unet();
    models::LoRAConfig lc;
    lc.rank = 4;
    models::LoRAAdapters adapters = models::inject_lora(*unet, lc);
    {
        at::NoGradGuard no_grad;  // non-zero B, so that the adapters change the prediction
        auto gen = at::detail::createCPUGenerator(99);
        for (auto& t : adapters.parameters()) t.copy_(at::randn(t.sizes(), gen) * 0.1);
        for (auto& t : adapters.parameters()) t.set_requires_grad(true);
    }
    const auto schedule = tiny_schedule();
    TrainBatch batch = testutil::tiny_batch(2);
    batch.regularisation = true;
    StepHooks toggle;
    toggle.adapters = [&](bool on) { adapters.set_enabled(on); };
    auto gen = at::detail::createCPUGenerator(11);
    MicroStep m = micro_step(*testutil::sdxl_model(unet), batch, schedule, StepOptions{}, 0, gen, toggle);

    // The base model, loaded on its own (no adapters at all), on the step's own draws.
    const Draws d = reproduce_draws(batch, schedule, 11);
    auto base = tiny_unet();
    const at::Tensor base_pred = forward(*base, batch, d);
    EXPECT_TRUE(at::equal(m.timesteps, d.t));
    // Same weights, another module path (a disabled LoRA layer vs a plain one): float rounding only,
    // which differs between CPU kernels (1e-6 was exceeded on a machine with other SIMD kernels).
    EXPECT_LE(max_diff(m.target, base_pred), 2e-5);
    EXPECT_FALSE(m.target.requires_grad());
    EXPECT_GT(max_diff(m.target, d.noise), 0.1) << "the target is still the noise";

    // The adapters are on again: the trained prediction is the adapted one, and the loss reaches them.
    for (const auto& e : adapters.entries()) EXPECT_TRUE(e.layer->enabled()) << e.module;
    const at::Tensor adapted = forward(*unet, batch, d);
    EXPECT_GT(max_diff(adapted, base_pred), 1e-4) << "the adapters change nothing";
    const double mse = (adapted - base_pred).pow(2).mean().item<double>();
    EXPECT_NEAR(m.loss.item<double>(), mse, 1e-6 * std::max(1.0, mse));
    m.loss.backward();
    double grad = 0;
    for (const auto& t : adapters.parameters()) grad = std::max(grad, t.grad().abs().max().item<double>());
    EXPECT_GT(grad, 0);

    // An ordinary batch of the same run keeps the noise target.
    batch.regularisation = false;
    auto gen2 = at::detail::createCPUGenerator(11);
    EXPECT_LE(
        max_diff(
            micro_step(*testutil::sdxl_model(unet), batch, schedule, StepOptions{}, 0, gen2, toggle).target,
            d.noise),
        0);
}

TEST(Regularisation, FullFineTuneTrainsItAsOrdinaryData) {
    // SimpleTuner builds the parent-teacher target for LoRA runs only; a full fine-tune has no base
    // model to ask, so the batch keeps the usual target.
    auto unet = tiny_unet();
    const auto schedule = tiny_schedule();
    TrainBatch batch = testutil::tiny_batch(2);
    auto gen = at::detail::createCPUGenerator(11);
    const MicroStep ordinary =
        micro_step(*testutil::sdxl_model(unet), batch, schedule, StepOptions{}, 0, gen);
    batch.regularisation = true;
    gen = at::detail::createCPUGenerator(11);
    const MicroStep regularisation =
        micro_step(*testutil::sdxl_model(unet), batch, schedule, StepOptions{}, 0, gen);
    EXPECT_TRUE(at::equal(regularisation.target, ordinary.target));
    EXPECT_EQ(regularisation.loss.item<double>(), ordinary.loss.item<double>());
    EXPECT_TRUE(at::equal(regularisation.target, reproduce_draws(batch, schedule, 11).noise));
}

TEST(Regularisation, MergedAdaptersCannotBeSwitchedOff) {
    auto unet = tiny_unet();
    models::LoRAAdapters adapters = models::inject_lora(*unet, models::LoRAConfig{});
    adapters.merge();
    EXPECT_ANY_THROW(adapters.set_enabled(false));
    adapters.unmerge();
    EXPECT_NO_THROW(adapters.set_enabled(false));
    adapters.set_enabled(true);
}

}  // namespace
}  // namespace test_regularisation_local
}  // namespace dtune::train
