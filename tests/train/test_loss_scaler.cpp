// fp16's device-resident loss scaler (loss_scaler.h) on the CPU: torch.amp.GradScaler's sequence of
// scales on a scripted series of finite and overflowing gradients (a hand-checked table), AdamW
// skipping an overflowed step on the device (fused and per-tensor: weights, moments and step counts
// untouched, the next step equal to that of an AdamW that never saw the bad one), and the trainer
// with a scale that overflows its fp16 backward (the frozen base runs in float16 on the CPU, so the
// overflows are real): skipped steps leave the weights alone (fused AdamW and the per-tensor loop on
// the device, Lion by the trainer reading the flag), metrics.jsonl logs each step's scale and the
// skipped count a step late, and a resumed run ends bit-identical.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>

#include "core/error.h"
#include "train/callbacks.h"
#include "train/loss_scaler.h"
#include "train/optimizer.h"
#include "trainer_test_util.h"

namespace dtune::train {
namespace test_loss_scaler_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Gradient values (before scaling) of one scripted step; `bad` puts an inf or a NaN in.
struct ScriptedStep {
    bool bad;
    bool nan = false;
};

// bfloat16 gradients on CUDA (adamw_bf16's full fine-tunes) take check_and_unscale_by_norms, since
// ATen's fused CUDA kernel lacks that dtype: on the CPU, where the fused kernel has it, both give the
// same flag and the same bits, for finite lists and for an inf or a NaN in any tensor.
TEST(LossScalerDevice, Bf16NormCheckEqualsTheFusedKernel) {
    const at::Tensor inv_scale = at::full({}, 1.0f / 1024.0f);
    for (int bad = -1; bad < 4; ++bad) {  // -1: all finite; 0-1: an inf in tensor 0 / 1; 2-3: a NaN
        std::vector<at::Tensor> a, b;
        for (int64_t n : {37, 1000}) {
            at::Tensor g = (at::randn({n}, at::TensorOptions().dtype(at::kFloat)) * 3000).to(at::kBFloat16);
            a.push_back(g.clone());
            b.push_back(g.clone());
        }
        if (bad >= 0) {
            const float v = bad < 2 ? -kInf : std::nanf("");
            a[bad % 2][5] = v;
            b[bad % 2][5] = v;
        }
        at::Tensor fa = at::zeros({}), fb = at::zeros({});
        at::_amp_foreach_non_finite_check_and_unscale_(a, fa, inv_scale);
        check_and_unscale_by_norms(b, fb, inv_scale);
        EXPECT_EQ(fb.item<float>(), bad >= 0 ? 1.0f : 0.0f) << bad;
        EXPECT_EQ(fa.item<float>(), fb.item<float>()) << bad;
        for (std::size_t i = 0; i < a.size(); ++i)
            EXPECT_TRUE(at::equal(a[i].nan_to_num(0, 0, 0), b[i].nan_to_num(0, 0, 0))) << bad << " " << i;
    }
}

TEST(LossScalerDevice, FollowsGradScalerOnAScriptedSeries) {
    // init 1024, x2 after 3 clean steps in a row, x0.5 on an overflow (GradScaler's rules): the
    // scale each step is multiplied by, worked out by hand.
    LossScaler scaler(LossScalerOptions{1024.0, 2.0, 0.5, 3});
    const std::vector<ScriptedStep> steps = {{false}, {false}, {false}, {true},  {false}, {true, true},
                                             {true},  {false}, {false}, {false}, {false}};
    const std::vector<double> scale_used = {1024, 1024, 1024, 2048, 1024, 1024, 512, 256, 256, 256, 512};
    const std::vector<int64_t> skipped = {0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 3};
    const std::vector<int64_t> tracker_after = {1, 2, 0, 0, 1, 0, 0, 1, 2, 0, 1};
    at::Tensor p = at::zeros({4}, at::TensorOptions().requires_grad(true));
    at::Tensor q = at::zeros({2}, at::TensorOptions().dtype(at::kDouble).requires_grad(true));
    for (size_t i = 0; i < steps.size(); ++i) {
        SCOPED_TRACE("step " + std::to_string(i + 1));
        const double s = scaler.scale();
        EXPECT_EQ(s, scale_used[i]);
        const at::Tensor g = at::tensor({0.5f, -3.0f, 1.0f / 64, 0.0f});
        p.mutable_grad() = g * static_cast<float>(s);
        // A second dtype group: the flag must cover every group.
        q.mutable_grad() = at::tensor({1.0, 2.0}, at::kDouble) * s;
        if (steps[i].bad) q.mutable_grad()[1] = steps[i].nan ? std::nan("") : static_cast<double>(kInf);
        scaler.unscale({p, q});
        EXPECT_EQ(scaler.overflowed(), steps[i].bad);
        if (!steps[i].bad) {
            EXPECT_TRUE(at::equal(p.grad(), g));  // exact: powers of two
        }
        const at::Tensor values = scaler.update();  // [found_inf, scale used, skipped]
        ASSERT_EQ(values.scalar_type(), at::kDouble);
        EXPECT_EQ(values[0].item<double>(), steps[i].bad ? 1.0 : 0.0);
        EXPECT_EQ(values[1].item<double>(), scale_used[i]);
        EXPECT_EQ(values[2].item<int64_t>(), skipped[i]);
        EXPECT_EQ(scaler.skipped_steps(), skipped[i]);
        EXPECT_EQ(scaler.growth_tracker(), tracker_after[i]);
    }
    EXPECT_EQ(scaler.scale(), 512.0);
    // Checkpoint round trip, the JSON layout unchanged.
    LossScaler restored(LossScalerOptions{1024.0, 2.0, 0.5, 3});
    restored.load_state(scaler.state());
    EXPECT_EQ(restored.state(), scaler.state());
    EXPECT_EQ(scaler.state().at("growth_tracker").get<int64_t>(), 1);
    EXPECT_EQ(scaler.state().at("skipped_steps").get<int64_t>(), 3);
    EXPECT_THROW(restored.load_state({{"scale", -1.0}, {"growth_tracker", 0}}), DataError);
}

// The state of every parameter as copies, "<name>.<key>" -> tensor.
TensorMap snapshot(const Optimizer& opt) {
    TensorMap out = opt.state_dict();
    for (auto& [k, v] : out) v = v.clone();
    return out;
}

void expect_same(const TensorMap& a, const TensorMap& b) {
    ASSERT_EQ(a.size(), b.size());
    for (const auto& [k, v] : a) {
        ASSERT_TRUE(b.count(k)) << k;
        EXPECT_TRUE(at::equal(v, b.at(k))) << k;
    }
}

class LossScalerAdamW : public ::testing::TestWithParam<bool> {};  // fused?

TEST_P(LossScalerAdamW, SkipsAnOverflowedStepOnTheDevice) {
    const auto make = [&](at::Tensor& w0, at::Tensor& w1) {
        w0 = at::tensor({1.0f, -2.0f, 0.5f}).requires_grad_(true);
        w1 = at::tensor({0.25f, 4.0f, -1.0f, 3.0f}).view({2, 2}).requires_grad_(true);
        ParamGroup g;
        g.names = {"w0", "w1"};
        g.params = {w0, w1};
        g.lr = 0.1;
        g.weight_decay = 0.01;
        AdamWOptions o;
        o.fused = GetParam();
        return std::make_unique<AdamW>(std::vector<ParamGroup>{g}, o);
    };
    at::Tensor a0, a1, r0, r1;
    auto scaled = make(a0, a1);     // with the scaler, sees a bad step between two good ones
    auto reference = make(r0, r1);  // never sees the bad step
    LossScaler scaler(LossScalerOptions{256.0, 2.0, 0.5, 2000});
    ASSERT_TRUE(scaled->skip_step_on_overflow(scaler.found_inf()));
    const std::vector<at::Tensor> good1 = {at::tensor({0.1f, 0.2f, -0.3f}),
                                           at::tensor({1.0f, -1.0f, 0.5f, 2.0f}).view({2, 2})};
    const std::vector<at::Tensor> good2 = {at::tensor({-0.4f, 0.0f, 0.25f}),
                                           at::tensor({0.5f, 0.5f, -2.0f, 1.0f}).view({2, 2})};
    const auto step = [&](const std::vector<at::Tensor>& grads, bool bad) {
        const double s = scaler.scale();
        a0.mutable_grad() = grads[0] * static_cast<float>(s);
        a1.mutable_grad() = grads[1] * static_cast<float>(s);
        if (bad) a1.mutable_grad()[0][1] = kInf;
        scaler.unscale({a0, a1});
        scaled->step();  // always called: the skip happens inside
        scaled->zero_grad();
        scaler.update();
    };
    const auto reference_step = [&](const std::vector<at::Tensor>& grads) {
        r0.mutable_grad() = grads[0].clone();
        r1.mutable_grad() = grads[1].clone();
        reference->step();
        reference->zero_grad();
    };
    step(good1, false);
    reference_step(good1);
    const at::Tensor w0 = a0.detach().clone(), w1 = a1.detach().clone();
    const TensorMap state = snapshot(*scaled);
    EXPECT_EQ(state.at("w0.step").item<float>(), 1.0f);

    step(good1, true);  // overflow: nothing moves, the step count included
    EXPECT_TRUE(at::equal(a0, w0));
    EXPECT_TRUE(at::equal(a1, w1));
    expect_same(snapshot(*scaled), state);
    EXPECT_EQ(scaler.skipped_steps(), 1);
    EXPECT_EQ(scaler.scale(), 128.0);

    step(good2, false);
    reference_step(good2);
    EXPECT_TRUE(at::equal(a0, r0));
    EXPECT_TRUE(at::equal(a1, r1));
    expect_same(snapshot(*scaled), snapshot(*reference));
    EXPECT_EQ(snapshot(*scaled).at("w1.step").item<float>(), 2.0f);
    EXPECT_FALSE(at::equal(a0, w0));  // the last step did move the weights

    // Lion (like SGD, Adafactor and adamw_bf16) skips by itself too: on the device with device LRs,
    // else by reading the flag in step() (tests/train/test_optimizer_graph.cpp).
    at::Tensor l = at::zeros({2}).requires_grad_(true);
    Lion lion({ParamGroup{{"l"}, {l}, 0.1, 0.0}});
    EXPECT_TRUE(lion.skip_step_on_overflow(scaler.found_inf()));
}

INSTANTIATE_TEST_SUITE_P(FusedAndLoop, LossScalerAdamW, ::testing::Values(true, false),
                         [](const auto& info) { return std::string(info.param ? "Fused" : "PerTensor"); });

// ---- the trainer --------------------------------------------------------------------------------

// Records the trainable tensors before the first step and after each.
struct WeightRecorder : TrainCallback {
    std::vector<std::vector<at::Tensor>> weights;  // [0]: before step 1
    void record(Trainer& t) {
        std::vector<at::Tensor> now;
        for (const auto& p : t.trainable_parameters()) now.push_back(p.tensor.detach().clone());
        weights.push_back(std::move(now));
    }
    void on_train_start(Trainer& t) override { record(t); }
    void on_step_end(Trainer& t, const StepReport&) override { record(t); }
};

std::vector<nlohmann::json> metrics_rows(const std::filesystem::path& dir) {
    std::vector<nlohmann::json> rows;
    std::ifstream in(dir / "metrics.jsonl");
    for (std::string line; std::getline(in, line);)
        if (!line.empty()) rows.push_back(nlohmann::json::parse(line));
    return rows;
}

// The tiny UNet's frozen base in float16 on the CPU (LoRA adapters train in float32): its backward
// runs in fp16 and overflows for real once dL/dprediction passes 65504 (a scale of about 2^24 here).
// The scale starts at 2^20, grows x16 after every clean step and backs off /16, so the run
// alternates between clean and overflowing steps whatever the exact threshold.
const LossScalerOptions kSawtooth{std::ldexp(1.0, 20), 16.0, 1.0 / 16, 1};

// `keys`: the optimizer and deterministic (per-tensor AdamW) settings of the case.
std::unique_ptr<Trainer> fp16_trainer(const std::filesystem::path& dir, int64_t steps,
                                      const nlohmann::json& keys = {{"deterministic", true}}) {
    nlohmann::json j{{"mixed_precision", "fp16"}, {"model_type", "lora"}, {"lora_rank", 4}};
    j.update(keys);
    const TrainConfig config = testutil::tiny_config(dir, steps, j);
    auto unet = testutil::tiny_unet();
    unet->to(at::kHalf);
    auto trainer = std::make_unique<Trainer>(config, testutil::sdxl_model(unet), testutil::tiny_schedule(),
                                             testutil::synthetic());
    trainer->set_loss_scaler_options(kSawtooth);
    return trainer;
}

// (name, config keys as JSON)
class LossScalerTrainerOverflow : public ::testing::TestWithParam<std::pair<const char*, const char*>> {};

TEST_P(LossScalerTrainerOverflow, SkippedStepsLeaveTheWeightsAndAreLoggedLate) {
    constexpr int64_t kSteps = 4;
    test::TempDir dir;
    auto trainer = fp16_trainer(dir.path(), kSteps, nlohmann::json::parse(GetParam().second));
    auto recorder = std::make_shared<WeightRecorder>();
    trainer->add_callback(recorder);
    trainer->run();
    const auto rows = metrics_rows(dir.path());
    ASSERT_EQ(rows.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(recorder->weights.size(), static_cast<size_t>(kSteps + 1));
    int64_t skipped = 0, clean = 0;
    double scale = kSawtooth.init_scale;
    for (int64_t i = 0; i < kSteps; ++i) {
        SCOPED_TRACE("step " + std::to_string(i + 1) + ": " + rows[i].dump());
        ASSERT_TRUE(rows[i].contains("loss_scale") && rows[i].contains("skipped_steps"));
        EXPECT_EQ(rows[i].at("loss_scale").get<double>(), scale);
        const int64_t now = rows[i].at("skipped_steps").get<int64_t>();
        const bool was_skipped = now == skipped + 1;
        ASSERT_TRUE(was_skipped || now == skipped);
        bool moved = false;
        for (size_t k = 0; k < recorder->weights[i].size(); ++k)
            moved |= !at::equal(recorder->weights[i][k], recorder->weights[i + 1][k]);
        EXPECT_EQ(moved, !was_skipped);
        (was_skipped ? skipped : clean) += 1;
        // GradScaler's rule with growth_interval 1; a grown scale that is not finite in float32 is kept.
        const double grown = scale * kSawtooth.growth_factor;
        scale = was_skipped                                ? scale * kSawtooth.backoff_factor
                : std::isfinite(static_cast<float>(grown)) ? grown
                                                           : scale;
    }
    EXPECT_GT(skipped, 0) << "no step overflowed: the test does not exercise the skip";
    EXPECT_GT(clean, 0) << "every step overflowed";
    const auto state = nlohmann::json::parse(fs::read_file(dir / "checkpoint-4" / "loss_scaler.json"));
    EXPECT_EQ(state.at("skipped_steps").get<int64_t>(), skipped);
    EXPECT_EQ(state.at("scale").get<double>(), scale);
}

// Fused AdamW skips on the device, the per-tensor loop reads the flag itself, and so does Lion's
// eager (host-lr) step.
INSTANTIATE_TEST_SUITE_P(Optimizers, LossScalerTrainerOverflow,
                         ::testing::Values(std::pair{"FusedAdamW", R"({"deterministic": false})"},
                                           std::pair{"PerTensorAdamW", R"({"deterministic": true})"},
                                           std::pair{
                                               "LionReadOnTheHost",
                                               R"({"deterministic": true, "optimizer": "optimi-lion"})"}),
                         [](const auto& info) { return std::string(info.param.first); });

TEST(LossScalerTrainerOverflow, ResumesBitExactThroughSkippedSteps) {
    test::TempDir straight, split;
    fp16_trainer(straight.path(), 4)->run();
    fp16_trainer(split.path(), 2)->run();
    auto resumed = fp16_trainer(split.path(), 4);
    const TrainResult r = resumed->run();
    ASSERT_TRUE(r.resumed_from.has_value());
    for (const char* f : {"pytorch_lora_weights.safetensors", "checkpoint-4/loss_scaler.json"})
        EXPECT_EQ(fs::read_file(straight / f), fs::read_file(split / f)) << f;
    const auto a = metrics_rows(straight.path()), b = metrics_rows(split.path());
    ASSERT_EQ(a.size(), 4u);
    ASSERT_EQ(b.size(), 4u);
    for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i].at("loss_scale"), b[i].at("loss_scale")) << "row " << i;
        EXPECT_EQ(a[i].at("skipped_steps"), b[i].at("skipped_steps")) << "row " << i;
        EXPECT_EQ(a[i].at("loss"), b[i].at("loss")) << "row " << i;
    }
    EXPECT_GT(a.back().at("skipped_steps").get<int64_t>(), 0);
}

}  // namespace
}  // namespace test_loss_scaler_local
}  // namespace dtune::train
