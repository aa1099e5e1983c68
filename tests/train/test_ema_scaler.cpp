// EMA (SimpleTuner's decay schedule and update, checked against closed forms and a recomputation
// from the recorded weights of a real run), the EMA weights guard, the fp16 dynamic loss scaler
// (torch.amp.GradScaler's rules, hand-checked), and both inside the trainer on the tiny fixture.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "train/callbacks.h"
#include "train/ema.h"
#include "train/loss_scaler.h"
#include "trainer_test_util.h"

namespace dtune::train {
namespace test_ema_scaler_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using testutil::make_trainer;
using testutil::tiny_config;

TEST(EMA, DecayScheduleMatchesSimpleTuner) {
    EMAOptions o;
    o.decay = 0.995;
    EMAModel ema({{"w", at::zeros({2})}}, o);
    EXPECT_EQ(ema.decay_at(1), 0.0);  // the first update copies
    EXPECT_DOUBLE_EQ(ema.decay_at(2), 2.0 / 11.0);
    EXPECT_DOUBLE_EQ(ema.decay_at(11), 11.0 / 20.0);
    EXPECT_DOUBLE_EQ(ema.decay_at(5000), 0.995);  // 5000/5009 > 0.995: capped
    o.warmup_steps = 3;
    EMAModel warm({{"w", at::zeros({2})}}, o);
    EXPECT_EQ(warm.decay_at(2), 0.0);
    EXPECT_DOUBLE_EQ(warm.decay_at(3), 0.995);
}

TEST(EMA, UpdatesByHandAndHonoursTheInterval) {
    at::Tensor w = at::tensor({1.0f, -2.0f});
    EMAOptions o;
    o.decay = 0.9;
    o.update_interval = 2;
    EMAModel ema({{"w", w}}, o);
    EXPECT_FALSE(ema.step(1));  // interval 2: odd steps skip
    {
        at::NoGradGuard g;
        w.copy_(at::tensor({3.0f, 0.0f}));
    }
    ASSERT_TRUE(ema.step(2));  // d = 2/11: s = 1 - (9/11)(1 - 3), -2 - (9/11)(-2 - 0)
    const auto s = ema.shadows()[0].second;
    EXPECT_NEAR(s[0].item<double>(), 1 + 2 * 9.0 / 11.0, 1e-6);
    EXPECT_NEAR(s[1].item<double>(), -2 + 2 * 9.0 / 11.0, 1e-6);
    EXPECT_EQ(ema.optimization_step(), 2);

    // The per-tensor path gives the same numbers as the foreach path.
    o.foreach = false;
    EMAModel loop({{"w", at::tensor({1.0f, -2.0f})}}, o);
    loop.step(1);
    EMAModel fe({{"w", at::tensor({1.0f, -2.0f})}}, EMAOptions{0.9, std::nullopt, 0, true, true});
    fe.step(1);
    EXPECT_TRUE(at::equal(loop.shadows()[0].second, fe.shadows()[0].second));
}

TEST(EMA, ShadowsAreFloat32AndTheGuardRestoresExactly) {
    at::Tensor w = at::tensor({1.5f, 2.25f}).to(at::kBFloat16);
    EMAModel ema({{"w", w}}, EMAOptions{});
    EXPECT_EQ(ema.shadows()[0].second.scalar_type(), at::kFloat);
    {
        at::NoGradGuard g;
        ema.shadows()[0].second.fill_(7.0f);
    }
    const at::Tensor before = w.clone();
    {
        EMAWeightsGuard swap(ema);
        EXPECT_TRUE(swap.active());
        EXPECT_TRUE(at::equal(w, at::full({2}, 7.0, at::kBFloat16)));
        EMAWeightsGuard moved = std::move(swap);  // the restore moves with the guard
        EXPECT_FALSE(swap.active());
    }
    EXPECT_TRUE(at::equal(w, before));
    EMAWeightsGuard none;
    EXPECT_FALSE(none.active());
}

TEST(LossScaler, ScalesUnscalesBacksOffAndGrows) {
    LossScaler scaler(LossScalerOptions{1024.0, 2.0, 0.5, 3});
    EXPECT_DOUBLE_EQ(scaler.scale_loss(at::scalar_tensor(0.5)).item<double>(), 512.0);
    at::Tensor p = at::zeros({3}, at::TensorOptions().requires_grad(true));
    p.mutable_grad() = at::tensor({1024.0f, -2048.0f, 3.0f});
    scaler.unscale({p});
    EXPECT_FALSE(scaler.overflowed());
    EXPECT_TRUE(at::equal(p.grad(), at::tensor({1.0f, -2.0f, 3.0f / 1024.0f})));
    scaler.update();
    scaler.update();
    EXPECT_DOUBLE_EQ(scaler.scale(), 1024.0);
    scaler.update();  // third clean step in a row: grow
    EXPECT_DOUBLE_EQ(scaler.scale(), 2048.0);
    EXPECT_EQ(scaler.growth_tracker(), 0);

    p.mutable_grad() = at::tensor({1.0f, std::numeric_limits<float>::infinity(), 0.0f});
    scaler.unscale({p});
    EXPECT_TRUE(scaler.overflowed());
    p.mutable_grad() = at::tensor({std::nanf(""), 1.0f, 0.0f});
    scaler.unscale({p});
    EXPECT_TRUE(scaler.overflowed());
    scaler.update();
    EXPECT_DOUBLE_EQ(scaler.scale(), 1024.0);
    EXPECT_EQ(scaler.skipped_steps(), 1);

    LossScaler restored;
    restored.load_state(scaler.state());
    EXPECT_DOUBLE_EQ(restored.scale(), 1024.0);
    EXPECT_EQ(restored.growth_tracker(), 0);
    EXPECT_EQ(restored.skipped_steps(), 1);
    EXPECT_THROW(LossScaler(LossScalerOptions{1.0, 0.5, 0.5, 1}), UsageError);
}

// Records every trainable tensor after each optimizer step.
class Recorder : public TrainCallback {
  public:
    std::vector<std::vector<at::Tensor>> steps;
    void on_step_end(Trainer& trainer, const StepReport&) override {
        std::vector<at::Tensor> now;
        for (const auto& p : trainer.trainable_parameters()) now.push_back(p.tensor.detach().clone());
        steps.push_back(std::move(now));
    }
};

TEST(EMATrainer, ShadowsFollowTheRecordedWeightsAndSwapIn) {
    test::TempDir dir;
    auto trainer = make_trainer(tiny_config(
        dir.path(), 3, {{"model_type", "lora"}, {"lora_rank", 2}, {"use_ema", true}, {"ema_decay", 0.5}}));
    auto recorder = std::make_shared<Recorder>();
    trainer->add_callback(recorder);
    trainer->run();
    ASSERT_EQ(recorder->steps.size(), 3u);
    ASSERT_NE(trainer->ema(), nullptr);
    // Recompute the EMA from the recorded weights: step 1 copies, then d = min((1+k)/(10+k), 0.5)
    // with k = step - 1, i.e. 2/11 and 3/12 here.
    std::vector<at::Tensor> expect = recorder->steps[0];
    for (int64_t step = 2; step <= 3; ++step) {
        const double k = static_cast<double>(step - 1), d = std::min((1 + k) / (10 + k), 0.5);
        for (std::size_t i = 0; i < expect.size(); ++i)
            expect[i] = d * expect[i] + (1 - d) * recorder->steps[static_cast<size_t>(step - 1)][i];
    }
    const auto& shadows = trainer->ema()->shadows();
    double worst = 0;
    for (std::size_t i = 0; i < expect.size(); ++i)
        worst = std::max(worst, (shadows[i].second - expect[i]).abs().max().item<double>());
    EXPECT_LE(worst, 1e-6);
    EXPECT_GT((shadows.back().second - recorder->steps.back().back()).abs().max().item<double>(), 1e-7)
        << "EMA equals the weights: nothing is averaged";

    const at::Tensor trained = trainer->trainable_parameters().back().tensor.clone();
    {
        EMAWeightsGuard swap = trainer->use_ema_weights();
        EXPECT_TRUE(at::equal(trainer->trainable_parameters().back().tensor, shadows.back().second));
    }
    EXPECT_TRUE(at::equal(trainer->trainable_parameters().back().tensor, trained));
    EXPECT_TRUE(std::filesystem::exists(dir / "checkpoint-3" / "unet_ema" / "ema_model.safetensors"));
    EXPECT_TRUE(std::filesystem::exists(dir / "ema" / "pytorch_lora_weights.safetensors"));
}

TEST(EMATrainer, FullFineTuneEMAIsALoadableUNetFolder) {
    test::TempDir dir;
    auto trainer =
        make_trainer(tiny_config(dir.path(), 1,
                                 {{"use_ema", true},
                                  {"ema_update_interval", 1},
                                  {"pretrained_model_name_or_path", testutil::tiny_model().string()},
                                  {"checkpoint_step_interval", 0}}));
    trainer->run();
    auto ema_unet = models::load_unet(dir / "checkpoint-1" / "unet_ema");
    const auto& shadows = trainer->ema()->shadows();
    std::map<std::string, at::Tensor> loaded;
    for (auto& [k, v] : models::state_dict(*ema_unet)) loaded[k] = v;
    ASSERT_EQ(loaded.size(), shadows.size());
    for (const auto& [k, v] : shadows) EXPECT_TRUE(at::equal(loaded.at(k), v)) << k;
    // The exported pipeline carries the EMA weights (SimpleTuner's behaviour for full + EMA).
    auto exported = models::load_unet(dir / "pipeline" / "unet");
    for (auto& [k, v] : models::state_dict(*exported)) EXPECT_TRUE(at::equal(v, loaded.at(k))) << k;
}

TEST(LossScalerTrainer, Fp16OnCpuMatchesNoMixedPrecisionAndCheckpointsTheScale) {
    // Power-of-two scaling is exact without overflow, and the CPU runs fp16 in float32: the weights
    // must equal a mixed_precision "no" run.
    test::TempDir fp16_dir, plain_dir;
    auto fp16 = make_trainer(tiny_config(fp16_dir.path(), 2, {{"mixed_precision", "fp16"}}));
    fp16->run();
    auto plain = make_trainer(tiny_config(plain_dir.path(), 2));
    plain->run();
    const auto a = models::state_dict(*testutil::unet_of(*fp16)),
               b = models::state_dict(*testutil::unet_of(*plain));
    double worst = 0;
    for (std::size_t i = 0; i < a.size(); ++i)
        worst = std::max(worst, (a[i].second - b[i].second).abs().max().item<double>());
    EXPECT_LE(worst, 1e-6);
    const auto state = nlohmann::json::parse(fs::read_file(fp16_dir / "checkpoint-2" / "loss_scaler.json"));
    EXPECT_DOUBLE_EQ(state.at("scale").get<double>(), 65536.0);
    EXPECT_EQ(state.at("growth_tracker").get<int64_t>(), 2);
    EXPECT_FALSE(std::filesystem::exists(plain_dir / "checkpoint-2" / "loss_scaler.json"));
}

}  // namespace
}  // namespace test_ema_scaler_local
}  // namespace dtune::train
