// The training step and loop on the tiny SDXL fixture (CPU, deterministic): caption dropout,
// loss decreasing on a fixed batch, checkpoint layout / guard / rotation / fallback, and the resume
// invariant (N steps straight == N/2 + resume + N/2, bit for bit).
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "core/error.h"
#include "core/fs.h"
#include "models/adapters/lora.h"
#include "models/common/quantize.h"
#include "models/common/weights.h"
#include "support/test_support.h"
#include "train/checkpoint.h"
#include "train/signals.h"
#include "train/step.h"
#include "train/trainer.h"
#include "trainer_test_util.h"

namespace dtune::train {
namespace test_trainer_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using testutil::synthetic;
using testutil::tiny_config;
using testutil::tiny_schedule;
using testutil::tiny_unet;

// The shared deterministic config with extra keys given as JSON text.
TrainConfig config_with(const std::filesystem::path& out, int64_t steps, const std::string& extra_json) {
    return testutil::tiny_config(out, steps, nlohmann::json::parse(extra_json));
}

io::TensorList run_trainer(const TrainConfig& config, TrainResult* result = nullptr) {
    Trainer trainer(config, testutil::sdxl_model(tiny_unet()), tiny_schedule(), synthetic());
    TrainResult r = trainer.run();
    if (result) *result = r;
    return models::state_dict(*testutil::unet_of(trainer));
}

TEST(TrainStep, CaptionDropoutUsesEmptyPromptZeroPooledAndTimeIds) {
    auto gen = at::detail::createCPUGenerator(3);
    SyntheticBatchOptions o;
    o.batch_size = 64;
    SyntheticBatchSource source(o);
    TrainBatch b = source.next(gen);
    PromptEmbedding empty{{"prompt_embeds", at::full({77, 64}, 7.0)},
                          {"pooled_prompt_embeds", at::ones({32})}};
    const int64_t dropped = apply_caption_dropout(family::sdxl_family(), b, empty, 0.5, gen);
    EXPECT_GT(dropped, 10);
    EXPECT_LT(dropped, 54);
    int64_t seen = 0;
    for (int64_t i = 0; i < 64; ++i) {
        const bool is_dropped = b.cond.at("prompt_embeds")[i].eq(7.0).all().item<bool>();
        if (!is_dropped) continue;
        ++seen;
        EXPECT_TRUE(b.cond.at("pooled_prompt_embeds")[i].eq(0).all().item<bool>());
        EXPECT_TRUE(b.cond.at("time_ids")[i].eq(0).all().item<bool>());
    }
    EXPECT_EQ(seen, dropped);
}

TEST(TrainStep, LossFallsOnAFixedBatch) {
    auto unet = tiny_unet();
    const auto schedule = tiny_schedule();
    SyntheticBatchOptions o;
    o.batch_size = 2;
    SyntheticBatchSource source(o);
    auto data_gen = at::detail::createCPUGenerator(5);
    const TrainBatch batch = source.next(data_gen);
    ParamGroup g;
    for (const auto& p : unet->named_parameters()) g.names.push_back(p.key()), g.params.push_back(p.value());
    g.lr = 1e-3;
    AdamW opt({g});
    StepOptions so;
    double first = 0, last = 0;
    for (int i = 0; i < 8; ++i) {
        auto gen = at::detail::createCPUGenerator(11);  // same noise and timesteps every step
        MicroStep m = micro_step(*testutil::sdxl_model(unet), batch, schedule, so, i, gen);
        m.loss.backward();
        opt.step();
        opt.zero_grad();
        (i == 0 ? first : last) = m.loss.item<double>();
    }
    EXPECT_TRUE(std::isfinite(first));
    EXPECT_LT(last, first * 0.9);
}

// The graphed step's body (optimizer_step_async, what a CUDA graph captures and what runs uncaptured
// on the CPU) with SimpleTuner's defaults: LoRA dropout seeded by the before_forward hook ahead of
// the noise draws, and grad_clip_method value clamping each gradient element. It must equal the
// same step written out by hand (seed, forward, backward, clamp, AdamW), and both options must act.
TEST(TrainStep, GraphedStepBodyClipsByValueAndSeedsLoRADropout) {
    const SyntheticBatchOptions so;
    SyntheticBatchSource source(so);
    auto data_gen = at::detail::createCPUGenerator(5);
    const TrainBatch batch = source.next(data_gen);
    const auto schedule = tiny_schedule();
    constexpr double kClip = 1e-5;
    struct Lora {
        models::UNet2DConditionModel unet = tiny_unet();
        std::optional<models::LoRAAdapters> adapters_;
        models::LoRAAdapters& adapters() { return *adapters_; }
        std::unique_ptr<AdamW> opt;
        std::vector<at::Tensor> params;
    };
    auto make = [&] {
        auto l = std::make_unique<Lora>();
        models::LoRAConfig lc;
        lc.rank = 4;
        lc.dropout = 0.1;
        lc.init_seed = 3;
        l->adapters_ = models::inject_lora(*l->unet, lc);
        {
            at::NoGradGuard no_grad;
            auto gen = at::detail::createCPUGenerator(99);
            for (auto& t : l->adapters().parameters())
                t.copy_(at::randn(t.sizes(), gen) * 0.1);  // non-zero B
        }
        l->unet->train();
        ParamGroup g;
        for (const auto& [name, t] : l->adapters().named_parameters())
            g.names.push_back(name), g.params.push_back(t);
        g.lr = 1e-3;
        l->params = g.params;
        l->opt = std::make_unique<AdamW>(std::vector<ParamGroup>{g});
        return l;
    };
    auto graphed = [&](bool by_value, uint64_t seed) {
        auto l = make();
        StepOptions o;
        o.clip_by_value = by_value;
        StepHooks hooks;
        hooks.before_forward = [&] { l->adapters().set_dropout_seed(seed); };
        auto gen = at::detail::createCPUGenerator(11);
        optimizer_step_async(*testutil::sdxl_model(l->unet), batch, schedule, o, 0, gen, *l->opt, l->params,
                             kClip, hooks);
        return l;
    };
    auto by_hand = [&] {
        auto l = make();
        l->adapters().set_dropout_seed(7);
        auto gen = at::detail::createCPUGenerator(11);
        micro_step(*testutil::sdxl_model(l->unet), batch, schedule, StepOptions{}, 0, gen).loss.backward();
        for (auto& p : l->params) p.grad().clamp_(-kClip, kClip);
        l->opt->step();
        return l;
    };
    const auto a = graphed(true, 7), hand = by_hand(), unclipped = graphed(false, 7),
               other = graphed(true, 8);
    double diff = 0, clip_effect = 0, seed_effect = 0;
    for (std::size_t i = 0; i < a->params.size(); ++i) {
        diff = std::max(diff, (a->params[i] - hand->params[i]).abs().max().item<double>());
        clip_effect = std::max(clip_effect, (a->params[i] - unclipped->params[i]).abs().max().item<double>());
        seed_effect = std::max(seed_effect, (a->params[i] - other->params[i]).abs().max().item<double>());
    }
    EXPECT_EQ(diff, 0.0);
    EXPECT_GT(clip_effect, 0.0);
    EXPECT_GT(seed_effect, 0.0);
}

// loss_type, huber_schedule, the timestep bias and snr_weight reach the step (their formulas are
// checked against SimpleTuner's in tests/diffusion/test_loss_reference.cpp); use_soft_min_snr
// changes nothing, as in SimpleTuner; a bad bias fails before the first step.
TEST(TrainStep, LossAndTimestepOptionsChangeTrainingAsConfigured) {
    test::TempDir dir;
    const auto weights = [&](const std::string& extra) {
        return run_trainer(config_with(dir.path() / "out", 2, extra));
    };
    const io::TensorList base = weights(R"({"checkpoint_step_interval": 0})");
    const auto differs = [&](const io::TensorList& other) {
        double d = 0;
        for (size_t i = 0; i < base.size(); ++i)
            d = std::max(d, (base[i].second - other[i].second).abs().max().item<double>());
        return d;
    };
    std::filesystem::remove_all(dir.path() / "out");
    EXPECT_EQ(differs(weights(R"({"checkpoint_step_interval": 0, "use_soft_min_snr": true})")), 0.0);
    std::filesystem::remove_all(dir.path() / "out");  // diff2flow_loss alone does nothing (as in SimpleTuner)
    EXPECT_EQ(differs(weights(R"({"checkpoint_step_interval": 0, "diff2flow_loss": true})")), 0.0);
    for (const char* extra :
         {R"({"checkpoint_step_interval": 0, "loss_type": "smooth_l1"})",
          R"({"checkpoint_step_interval": 0, "loss_type": "huber", "huber_schedule": "constant"})",
          R"({"checkpoint_step_interval": 0, "snr_weight": 0.25})",
          R"({"checkpoint_step_interval": 0, "timestep_bias_strategy": "earlier",
                                  "timestep_bias_multiplier": 50, "timestep_bias_portion": 0.1})"}) {
        std::filesystem::remove_all(dir.path() / "out");
        EXPECT_GT(differs(weights(extra)), 0.0) << extra;
    }
    std::filesystem::remove_all(dir.path() / "out");
    EXPECT_THROW(weights(R"({"timestep_bias_strategy": "later", "timestep_bias_multiplier": 0})"),
                 UsageError);
}

// scheduled_sampling_*: rolled-out inputs change training (the rollout math is checked in
// tests/diffusion/test_scheduled_sampling.cpp), and a resumed run draws the same plans as a straight
// one, so the weights are equal.
TEST(TrainStep, ScheduledSamplingChangesTrainingAndResumesExactly) {
    const std::string ss =
        R"({"scheduled_sampling_max_step_offset": 20, "scheduled_sampling_probability": 0.75,
        "scheduled_sampling_strategy": "biased_late", "checkpoint_step_interval": 1)";
    test::TempDir plain, straight, split;
    const io::TensorList base =
        run_trainer(config_with(plain.path(), 2, R"({"checkpoint_step_interval": 0})"));
    const io::TensorList a = run_trainer(config_with(straight.path(), 2, ss + "}"));
    run_trainer(config_with(split.path(), 1, ss + "}"));
    TrainResult second;
    const io::TensorList b = run_trainer(config_with(split.path(), 2, ss + "}"), &second);
    ASSERT_TRUE(second.resumed_from.has_value());
    double moved = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
        moved = std::max(moved, (a[i].second - base[i].second).abs().max().item<double>());
    }
    EXPECT_GT(moved, 0.0);
    EXPECT_THROW(config_with(plain.path(), 1, R"({"scheduled_sampling_strategy": "late"})"), UsageError);
}

TEST(TrainCheckpoint, LayoutGuardAndRotation) {
    test::TempDir dir;
    TrainResult r;
    run_trainer(config_with(dir.path(), 6, R"({"checkpoints_total_limit": 2})"), &r);
    EXPECT_EQ(r.global_step, 6);
    const auto all = list_checkpoints(dir.path());
    ASSERT_EQ(all.size(), 2u);  // steps 4 and 6; step 2 rotated away
    EXPECT_EQ(all[0].first, 4);
    EXPECT_EQ(all[1].first, 6);
    for (const char* f :
         {".guard", "checkpoint_manifest.json", "training_state.json", "optimizer.safetensors",
          "random_states.safetensors", "config.resolved.json", "unet/diffusion_pytorch_model.safetensors"})
        EXPECT_TRUE(std::filesystem::exists(all[1].second / f)) << f;
    EXPECT_TRUE(std::filesystem::exists(dir / "config.resolved.json"));
    EXPECT_TRUE(std::filesystem::exists(dir / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors"));
    std::ifstream metrics(dir / "metrics.jsonl");
    std::string line;
    int lines = 0;
    while (std::getline(metrics, line)) {
        const auto j = nlohmann::json::parse(line);
        EXPECT_TRUE(std::isfinite(j.at("loss").get<double>()));
        EXPECT_DOUBLE_EQ(j.at("lr").get<double>(), 1e-3);
        ++lines;
    }
    EXPECT_EQ(lines, 6);

    // An unguarded newer checkpoint is skipped for "latest" and refused when named.
    std::filesystem::create_directories(dir / "checkpoint-8");
    EXPECT_EQ(*resolve_resume_checkpoint(dir.path(), "latest"), all[1].second);
    EXPECT_EQ(*resolve_resume_checkpoint(dir.path(), (dir / "checkpoint-8").string()), all[1].second);
    std::filesystem::remove(all[1].second / "optimizer.safetensors");
    EXPECT_NE(checkpoint_problem(all[1].second).find("optimizer.safetensors"), std::string::npos);
    EXPECT_EQ(*resolve_resume_checkpoint(dir.path(), "latest"), all[0].second);
    EXPECT_FALSE(resolve_resume_checkpoint(dir.path(), "none").has_value());
    EXPECT_THROW(load_checkpoint(dir / "checkpoint-8"), DataError);
    // A checkpoint that does not exist at all (a typo) is refused, naming the ones there are;
    // before, it fell back to the newest complete checkpoint below its step.
    try {
        resolve_resume_checkpoint(dir.path(), "checkpoint-60");
        ADD_FAILURE() << "checkpoint-60 does not exist";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("checkpoint-60 does not exist"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("checkpoint-4, checkpoint-6"), std::string::npos) << e.what();
    }
}

TEST(TrainCheckpoint, ResumeIsBitExact) {
    test::TempDir straight, split;
    const io::TensorList a =
        run_trainer(config_with(straight.path(), 4, R"({"resume_from_checkpoint": "none"})"));
    TrainResult first, second;
    run_trainer(tiny_config(split.path(), 2), &first);
    EXPECT_FALSE(first.resumed_from.has_value());
    const io::TensorList b = run_trainer(tiny_config(split.path(), 4), &second);
    ASSERT_TRUE(second.resumed_from.has_value());
    EXPECT_EQ(second.resumed_from->filename(), "checkpoint-2");
    ASSERT_EQ(a.size(), b.size());
    int64_t differing = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_EQ(a[i].first, b[i].first);
        if (!at::equal(a[i].second, b[i].second)) ++differing;
    }
    EXPECT_EQ(differing, 0);
    // And training did change the weights (the comparison is not vacuous).
    const io::TensorList base = models::state_dict(*tiny_unet());
    int64_t changed = 0;
    for (size_t i = 0; i < a.size(); ++i) changed += at::equal(a[i].second, base[i].second) ? 0 : 1;
    EXPECT_GT(changed, static_cast<int64_t>(a.size()) / 2);
}

TEST(TrainCheckpoint, LoRAResumeIsBitExact) {
    // LoRA with dropout under gradient checkpointing, EMA and fp16 loss scaling: every piece of state
    // (adapters, optimizer, dropout seeds, EMA shadows, loss scale) must resume exactly.
    const std::string lora = R"({"model_type": "lora", "lora_rank": 4, "lora_dropout": 0.1,
        "gradient_checkpointing": true, "use_ema": true, "mixed_precision": "fp16",
        "checkpoint_step_interval": 1)";
    test::TempDir straight, split;
    const io::TensorList a =
        run_trainer(config_with(straight.path(), 2, lora + R"(, "resume_from_checkpoint": "none"})"));
    TrainResult second;
    run_trainer(config_with(split.path(), 1, lora + "}"));
    const io::TensorList b = run_trainer(config_with(split.path(), 2, lora + "}"), &second);
    ASSERT_TRUE(second.resumed_from.has_value());
    ASSERT_EQ(a.size(), b.size());
    int64_t differing = 0, adapters = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_EQ(a[i].first, b[i].first);
        if (!at::equal(a[i].second, b[i].second)) ++differing;
        adapters += a[i].first.find(".lora_") != std::string::npos ? 1 : 0;
    }
    EXPECT_EQ(differing, 0);
    EXPECT_GT(adapters, 0);
    for (const char* f : {"pytorch_lora_weights.safetensors", "ema/pytorch_lora_weights.safetensors",
                          "checkpoint-2/unet_ema/ema_model.safetensors", "checkpoint-2/loss_scaler.json"})
        EXPECT_EQ(fs::read_file(straight / f), fs::read_file(split / f)) << f;
    EXPECT_NE(fs::read_file(straight / "pytorch_lora_weights.safetensors"),
              fs::read_file(straight / "ema/pytorch_lora_weights.safetensors"));
    EXPECT_FALSE(std::filesystem::exists(straight / "checkpoint-2" / "unet"));  // adapters only
}

// base_model_precision: the frozen UNet is quantised before the adapters are injected; only the
// adapters train; the quantised base does not move; the first step's loss is within quantisation
// noise of the dense base's; and a resumed run ends on the same adapters as a straight one.
TEST(TrainCheckpoint, QuantisedBaseTrainsTheAdaptersAndResumesExactly) {
    const auto first_loss = [](const std::filesystem::path& dir) {
        std::ifstream metrics(dir / "metrics.jsonl");
        std::string line;
        std::getline(metrics, line);
        return nlohmann::json::parse(line).at("loss").get<double>();
    };
    test::TempDir dense_dir;
    const std::string lora = R"({"model_type": "lora", "lora_rank": 4, "checkpoint_step_interval": 1)";
    run_trainer(config_with(dense_dir.path(), 1, lora + "}"));
    for (const std::string preset : {"int8-quanto", "fp8-quanto", "int8-torchao", "fp8-torchao"}) {
        SCOPED_TRACE(preset);
        // DoRA rides on torchao presets (quanto refuses it, as in SimpleTuner).
        const std::string keys = lora + R"(, "base_model_precision": ")" + preset + "\"" +
                                 (preset.find("torchao") != std::string::npos ? R"(, "use_dora": true)" : "");
        test::TempDir straight, split;
        const io::TensorList a = run_trainer(config_with(straight.path(), 2, keys + "}"));
        run_trainer(config_with(split.path(), 1, keys + "}"));
        TrainResult second;
        const io::TensorList b = run_trainer(config_with(split.path(), 2, keys + "}"), &second);
        ASSERT_TRUE(second.resumed_from.has_value());

        auto quantised = tiny_unet();
        const int64_t layers = models::quantize_module(*quantised, parse_quant_preset(preset, "k")).layers;
        EXPECT_GT(layers, 10);
        std::map<std::string, at::Tensor> base;
        for (auto& [k, v] : models::state_dict(*quantised)) base[k] = v;
        ASSERT_EQ(a.size(), b.size());
        int64_t quantised_tensors = 0, adapters = 0;
        for (size_t i = 0; i < a.size(); ++i) {
            EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
            if (a[i].first.find(".lora_") != std::string::npos) {
                ++adapters;
                continue;
            }
            ASSERT_TRUE(base.count(a[i].first)) << a[i].first;
            EXPECT_TRUE(at::equal(a[i].second, base.at(a[i].first))) << a[i].first << " moved";
            const auto t = a[i].second.scalar_type();
            quantised_tensors += t == at::kChar || t == at::kFloat8_e4m3fn ? 1 : 0;
        }
        EXPECT_EQ(quantised_tensors, layers);
        EXPECT_GT(adapters, 0);
        EXPECT_EQ(fs::read_file(straight / "pytorch_lora_weights.safetensors"),
                  fs::read_file(split / "pytorch_lora_weights.safetensors"));
        const double dense = first_loss(dense_dir.path()), quant = first_loss(straight.path());
        EXPECT_NEAR(quant, dense, 0.05 * dense) << "dense " << dense << ", " << preset << " " << quant;
    }
}

// gradient_checkpointing_interval only changes what is recomputed: the same weights as checkpointing
// every block (SGD, whose update is linear in the gradient: the gradients' summation order differs
// in the last bits, which Adam's first, sign-like steps would blow up to +-lr); 0 is refused with
// the key named.
TEST(TrainConfigKeys, GradientCheckpointingIntervalTrainsTheSameWeights) {
    test::TempDir every, second;
    const io::TensorList a = run_trainer(
        config_with(every.path(), 2, R"({"gradient_checkpointing": true, "optimizer": "torch-sgd"})"));
    const io::TensorList b = run_trainer(config_with(
        second.path(), 2,
        R"({"gradient_checkpointing": true, "gradient_checkpointing_interval": 2, "optimizer": "torch-sgd"})"));
    ASSERT_EQ(a.size(), b.size());
    const io::TensorList base = models::state_dict(*tiny_unet());
    int64_t moved = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_TRUE(at::allclose(a[i].second, b[i].second, 1e-5, 1e-6)) << a[i].first;
        moved += at::equal(a[i].second, base[i].second) ? 0 : 1;
    }
    EXPECT_GT(moved, static_cast<int64_t>(a.size()) / 2);  // the runs trained
    test::TempDir bad;
    try {
        run_trainer(config_with(bad.path(), 1, R"({"gradient_checkpointing_interval": 0})"));
        ADD_FAILURE() << "interval 0 accepted";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("gradient_checkpointing_interval"), std::string::npos)
            << e.what();
    }
}

// DTUNE_CHANNELS_LAST=1 (NHWC convolutions and GroupNorm; the default for LoRA on CUDA) trains the
// same adapters as NCHW: on the CPU through the same trainer set-up (the conversion before the
// adapters, the optimizer and checkpoints), with the composite GroupNorm. A bad value is refused.
TEST(TrainConfigKeys, ChannelsLastTrainsTheSameAdaptersAndRefusesABadSwitch) {
    // SGD: Adam's first steps turn float-rounding differences of near-zero gradients into whole
    // learning-rate steps, so its weights would not show whether the two layouts agree.
    const std::string lora =
        R"({"model_type": "lora", "lora_rank": 4, "lora_dropout": 0.1, "optimizer": "torch-sgd")";
    auto run_with = [&](const char* value, const std::filesystem::path& dir, const std::string& keys) {
        setenv("DTUNE_CHANNELS_LAST", value, 1);
        try {
            io::TensorList out = run_trainer(config_with(dir, 2, keys));
            unsetenv("DTUNE_CHANNELS_LAST");
            return out;
        } catch (...) {
            unsetenv("DTUNE_CHANNELS_LAST");
            throw;
        }
    };
    // A dense base, and an int8 base whose channels-last conv weights are dequantised as such.
    for (const std::string& extra :
         {std::string(), std::string(R"(, "base_model_precision": "int8-quanto")")}) {
        SCOPED_TRACE(extra);
        const std::string keys = lora + extra + "}";
        test::TempDir nchw, nhwc;
        const io::TensorList a = run_with("0", nchw.path(), keys);
        testing::internal::CaptureStderr();
        const io::TensorList b = run_with("1", nhwc.path(), keys);
        const std::string log = testing::internal::GetCapturedStderr();
        ASSERT_EQ(a.size(), b.size());
        int64_t trained = 0;
        for (size_t i = 0; i < a.size(); ++i) {
            ASSERT_EQ(a[i].first, b[i].first);
            EXPECT_TRUE(at::allclose(a[i].second, b[i].second, 1e-4, 1e-6))
                << a[i].first << " max diff " << (a[i].second - b[i].second).abs().max().item<double>()
                << " of " << a[i].second.abs().max().item<double>();
            // lora_B starts at zero: nonzero means the run trained it
            if (a[i].first.find(".lora_B") != std::string::npos && a[i].second.abs().max().item<double>() > 0)
                ++trained;
        }
        EXPECT_GT(trained, 0);
        EXPECT_NE(log.find("channels-last (NHWC)"), std::string::npos) << log;
    }
    test::TempDir bad;
    try {
        run_with("sideways", bad.path(), lora + "}");
        ADD_FAILURE() << "DTUNE_CHANNELS_LAST=sideways accepted";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("DTUNE_CHANNELS_LAST"), std::string::npos) << e.what();
    }
}

// DTUNE_LORA_CAST_FACTORS (the LoRA factors' compute-dtype copies; the copies themselves are tested
// in LoRAUnit and CastFactorCopiesGpu): a value that is not a switch stops the run at set-up with
// the variable named and the accepted values.
TEST(TrainConfigKeys, LoRACastFactorsRefusesABadSwitch) {
    test::TempDir dir;
    setenv("DTUNE_LORA_CAST_FACTORS", "maybe", 1);
    try {
        run_trainer(config_with(dir.path(), 1, R"({"model_type": "lora", "lora_rank": 4})"));
        ADD_FAILURE() << "DTUNE_LORA_CAST_FACTORS=maybe accepted";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("DTUNE_LORA_CAST_FACTORS='maybe'"), std::string::npos)
            << e.what();
        EXPECT_NE(std::string(e.what()).find("0 (off/false"), std::string::npos) << e.what();
    }
    unsetenv("DTUNE_LORA_CAST_FACTORS");
}

// offload_optimizer_device cpu: the same weights as the optimizer on the training device (both on
// the CPU here, so bit for bit), resume exact, and the logged offload; a bad value is refused.
TEST(TrainConfigKeys, OffloadOptimizerTrainsTheSameWeightsAndResumes) {
    const std::string off = R"({"offload_optimizer_device": "cpu", "checkpoint_step_interval": 1)";
    test::TempDir plain, straight, split;
    const io::TensorList a = run_trainer(config_with(plain.path(), 3, "{}"));
    const io::TensorList b =
        run_trainer(config_with(straight.path(), 3, off + R"(, "resume_from_checkpoint": "none"})"));
    run_trainer(config_with(split.path(), 2, off + "}"));
    TrainResult resumed;
    const io::TensorList c = run_trainer(config_with(split.path(), 3, off + "}"), &resumed);
    ASSERT_TRUE(resumed.resumed_from.has_value());
    ASSERT_EQ(a.size(), b.size());
    ASSERT_EQ(b.size(), c.size());
    for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
        EXPECT_TRUE(at::equal(b[i].second, c[i].second)) << b[i].first << " (resumed)";
    }
    test::TempDir bad;
    try {
        run_trainer(config_with(bad.path(), 1, R"({"offload_optimizer_device": "nvme"})"));
        ADD_FAILURE() << "nvme accepted";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("offload_optimizer_device"), std::string::npos) << e.what();
    }
}

TEST(TrainMetrics, RowsEveryIntervalWithTheWindowsThroughput) {
    // metrics_interval 3 over 6 steps: rows at steps 3 and 6; img_per_s is the rate over the 3
    // steps since the previous row (images / summed step time): finite and positive.
    test::TempDir dir;
    const auto c = config_with(dir.path(), 6, R"({"metrics_interval": 3, "checkpoint_step_interval": 0})");
    run_trainer(c);
    std::ifstream metrics(dir / "metrics.jsonl");
    std::vector<int64_t> steps;
    for (std::string line; std::getline(metrics, line);) {
        const auto j = nlohmann::json::parse(line);
        steps.push_back(j.at("step").get<int64_t>());
        const double ips = j.at("img_per_s").get<double>();
        EXPECT_TRUE(std::isfinite(ips) && ips > 0) << line;
        EXPECT_EQ(j.at("samples_seen").get<int64_t>(), steps.back() * 2) << line;  // batch 2
    }
    EXPECT_EQ(steps, (std::vector<int64_t>{3, 6}));
}

// The read-back at a step's end (where the previous step's row, its callbacks and observers run) is
// step time too: it counts into the next step's, so the rows' step times add up to the wall time.
// A callback that takes 300 ms per row shows in every row from step 3 on (step 1's row is read at
// step 2's end, which step 3's time carries), where a step of the tiny model alone is far shorter.
TEST(TrainMetrics, TheReadBackWaitCountsAsStepTime) {
    struct Slow : TrainCallback {
        void on_step_metrics(Trainer&, const StepReport&) override {
            std::this_thread::sleep_for(std::chrono::milliseconds(300));
        }
    };
    test::TempDir dir;
    Trainer trainer(config_with(dir.path(), 5, R"({"checkpoint_step_interval": 0})"),
                    testutil::sdxl_model(tiny_unet()), tiny_schedule(), synthetic());
    trainer.add_callback(std::make_shared<Slow>());
    trainer.run();
    std::ifstream metrics(dir / "metrics.jsonl");
    int checked = 0;
    for (std::string line; std::getline(metrics, line);) {
        const auto j = nlohmann::json::parse(line);
        if (!j.contains("img_per_s") || j.at("step").get<int64_t>() < 3) continue;
        const double seconds = 2.0 / j.at("img_per_s").get<double>();  // batch 2
        EXPECT_GE(seconds, 0.3) << line;
        ++checked;
    }
    EXPECT_EQ(checked, 3);  // steps 3, 4 and 5
}

// A stop before the run's first step has nothing new to save: no checkpoint-0 (issue #20).
// bench_trainer's constructor: the network loaded from pretrained_model_name_or_path as `dtune train`
// loads it, batches from the given source. Trained on the same batches it ends on the same weights
// as a run whose UNet the test loaded itself; with distinct_batches the source serves its first
// batches in turn.
TEST(TrainBench, SyntheticSourceConstructorLoadsTheNetworkAsTrainDoes) {
    const auto cycling = [] {
        SyntheticBatchOptions o;
        o.batch_size = 2;
        o.latent_size = 8;
        o.dim = 64;
        o.pooled_dim = 32;
        o.distinct_batches = 2;
        return std::make_unique<SyntheticBatchSource>(o);
    };
    auto source = cycling();
    at::Generator g = at::detail::createCPUGenerator(7);
    const TrainBatch b0 = source->next(g), b1 = source->next(g), b2 = source->next(g);
    EXPECT_TRUE(at::equal(b0.latents, b2.latents));
    EXPECT_FALSE(at::equal(b0.latents, b1.latents));

    test::TempDir by_hand, by_path;
    const std::string extra = R"({"model_type": "lora", "lora_rank": 4, "checkpoint_step_interval": 0})";
    TrainConfig config = config_with(by_hand.path(), 2, extra);
    Trainer hand(config, testutil::sdxl_model(tiny_unet()), tiny_schedule(), cycling());
    hand.run();
    TrainConfig with_path = config_with(by_path.path(), 2, extra);
    with_path.set("pretrained_model_name_or_path", testutil::tiny_model().string(), "test");
    Trainer loaded(with_path, cycling());
    const TrainResult r = loaded.run();
    EXPECT_EQ(r.global_step, 2);
    const io::TensorList a = models::state_dict(*testutil::unet_of(hand));
    const io::TensorList b = models::state_dict(*testutil::unet_of(loaded));
    ASSERT_EQ(a.size(), b.size());
    int64_t differing = 0, trained = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_EQ(a[i].first, b[i].first);
        differing += at::equal(a[i].second, b[i].second) ? 0 : 1;
        // LoRA B starts at zero: a nonzero one trained.
        if (a[i].first.find("lora_B") != std::string::npos && a[i].second.abs().max().item<double>() > 0)
            ++trained;
    }
    EXPECT_EQ(differing, 0);
    EXPECT_GT(trained, 0);
    // A missing model folder is named, as `dtune train` names it.
    TrainConfig missing = config_with(by_path.path() / "again", 1, extra);
    missing.set("pretrained_model_name_or_path", (by_path.path() / "nowhere").string(), "test");
    EXPECT_THROW(Trainer(missing, cycling()), DataError);
}

// What the observers see of a run: on_step_end's step and loss (and how many steps had been read
// back by then), and every on_step_metrics report in order. `stop_at`: request a stop in that
// step's on_step_end.
struct ReadbackLog final : TrainCallback {
    std::vector<double> end_losses;
    std::vector<std::size_t> read_at_end;  // on_step_metrics calls before each on_step_end
    std::vector<StepReport> metrics;
    int64_t stop_at = -1;
    void on_step_end(Trainer&, const StepReport& r) override {
        end_losses.push_back(r.loss);
        read_at_end.push_back(metrics.size());
        if (r.step == stop_at) request_stop();
    }
    void on_step_metrics(Trainer&, const StepReport& r) override { metrics.push_back(r); }
};

// The synthetic batches with every other one marked as regularisation data (a full fine-tune
// trains them as any other; the log keeps their loss apart).
class AlternatingRegularisation final : public BatchSource {
  public:
    TrainBatch next(at::Generator& g) override {
        TrainBatch b = inner_->next(g);
        b.regularisation = served_++ % 2 == 1;
        return b;
    }
    int64_t batches_per_epoch() const override { return inner_->batches_per_epoch(); }
    int64_t epoch() const override { return inner_->epoch(); }
    PromptEmbedding empty_prompt() override { return inner_->empty_prompt(); }
    nlohmann::json state() const override { return inner_->state(); }
    void load_state(const nlohmann::json& s) override { inner_->load_state(s); }
    bool has_regularisation_data() const override { return true; }

  private:
    std::unique_ptr<BatchSource> inner_ = synthetic();
    int64_t served_ = 0;
};

struct ReadbackRun {
    std::vector<std::string> rows;  // metrics.jsonl without img_per_s (a wall-clock rate)
    io::TensorList weights;
    std::shared_ptr<ReadbackLog> log = std::make_shared<ReadbackLog>();
    TrainResult result;
};

std::vector<std::string> metrics_rows(const std::filesystem::path& dir) {
    std::vector<std::string> rows;
    std::ifstream in(dir / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
        nlohmann::json j = nlohmann::json::parse(line);
        j.erase("img_per_s");
        rows.push_back(j.dump());
    }
    return rows;
}

// A run with the step values read back `lag` steps late (0: at once, DTUNE_SYNC_READBACK=1).
ReadbackRun run_with_lag(const TrainConfig& config, int lag, std::unique_ptr<BatchSource> source,
                         int64_t stop_at = -1) {
    ReadbackRun out;
    Trainer trainer(config, testutil::sdxl_model(tiny_unet()), tiny_schedule(), std::move(source));
    ReadbackOptions options;
    options.lag = lag;
    trainer.set_readback_options(options);
    out.log->stop_at = stop_at;
    trainer.add_callback(out.log);
    out.result = trainer.run();
    clear_stop_request();
    out.weights = models::state_dict(*testutil::unet_of(trainer));
    out.rows = metrics_rows(config.text("output_dir"));
    return out;
}

// Issue #18: the loss and gradient norm come back a step late, with no wait for the device, yet
// every metrics row, every on_step_metrics report and every checkpoint is what the immediate
// read-back gives, bit for bit: with gradient accumulation (the mean over micro-batches), a
// regularisation micro-batch in every step, rows every other step and checkpoints in between.
TEST(TrainReadback, DeferredReadBackLogsAndSavesWhatImmediateReadBackDoes) {
    test::TempDir deferred_dir, sync_dir;
    const std::string keys = R"({"gradient_accumulation_steps": 2, "metrics_interval": 2,
                                 "checkpoint_step_interval": 2})";
    const ReadbackRun deferred = run_with_lag(config_with(deferred_dir.path(), 5, keys), 1,
                                              std::make_unique<AlternatingRegularisation>());
    const ReadbackRun sync =
        run_with_lag(config_with(sync_dir.path(), 5, keys), 0, std::make_unique<AlternatingRegularisation>());
    ASSERT_EQ(deferred.rows.size(), 2u);  // steps 2 and 4
    EXPECT_EQ(deferred.rows, sync.rows);
    const auto row = nlohmann::json::parse(deferred.rows[1]);
    EXPECT_EQ(row.at("step"), 4);
    EXPECT_TRUE(row.contains("regularisation_loss") && row.contains("regularisation_grad_norm")) << row;
    EXPECT_NE(row.at("regularisation_loss"), row.at("loss"));  // one of the two micro-batches
    for (const char* f :
         {"checkpoint-2/unet/diffusion_pytorch_model.safetensors", "checkpoint-4/optimizer.safetensors",
          "checkpoint-4/random_states.safetensors", "checkpoint-4/training_state.json",
          "checkpoint-5/unet/diffusion_pytorch_model.safetensors"})
        EXPECT_EQ(fs::read_file(deferred_dir / f), fs::read_file(sync_dir / f)) << f;
    for (std::size_t i = 0; i < deferred.weights.size(); ++i)
        EXPECT_TRUE(at::equal(deferred.weights[i].second, sync.weights[i].second))
            << deferred.weights[i].first;
    // Every step reaches on_step_metrics once, in order, with the row's values where it has one.
    ASSERT_EQ(deferred.log->metrics.size(), 5u);
    ASSERT_EQ(sync.log->metrics.size(), 5u);
    for (std::size_t i = 0; i < 5; ++i) {
        const StepReport &d = deferred.log->metrics[i], &s = sync.log->metrics[i];
        EXPECT_EQ(d.step, static_cast<int64_t>(i + 1));
        EXPECT_EQ(d.loss, s.loss) << "step " << i + 1;
        EXPECT_EQ(d.grad_norm, s.grad_norm) << "step " << i + 1;
        EXPECT_EQ(d.regularisation_loss, s.regularisation_loss) << "step " << i + 1;
        EXPECT_TRUE(std::isfinite(d.loss) && d.grad_norm > 0) << "step " << i + 1;
        // Immediate: on_step_end sees the step's values; deferred: the step before is read back
        // then and this one not yet (NaN).
        EXPECT_EQ(sync.log->end_losses[i], s.loss) << "step " << i + 1;
        EXPECT_TRUE(std::isnan(deferred.log->end_losses[i])) << "step " << i + 1;
        EXPECT_EQ(sync.log->read_at_end[i], i + 1);
        EXPECT_EQ(deferred.log->read_at_end[i], i) << "step " << i + 1;
    }
    EXPECT_EQ(nlohmann::json::parse(deferred.rows[0]).at("loss").get<double>(),
              deferred.log->metrics[1].loss);
    EXPECT_EQ(deferred.result.last_loss, sync.log->metrics[4].loss);
}

// A stop requested during a run (one process): the next step does not start, every step trained
// has its row, the checkpoint is saved at the stop, and resuming from it ends on the weights and
// rows of a run that was never stopped.
TEST(TrainReadback, StopDuringARunSavesEveryRowAndResumesExactly) {
    install_stop_signal_handlers();
    test::TempDir straight_dir, stopped_dir;
    const std::string keys = R"({"checkpoint_step_interval": 0})";
    const ReadbackRun straight = run_with_lag(config_with(straight_dir.path(), 4, keys), 1, synthetic());
    const ReadbackRun stopped = run_with_lag(config_with(stopped_dir.path(), 4, keys), 1, synthetic(), 2);
    EXPECT_EQ(stopped.result.outcome, TrainOutcome::kInterrupted);
    EXPECT_EQ(stopped.result.global_step, 2);
    EXPECT_TRUE(std::filesystem::exists(stopped_dir / "checkpoint-2" / ".guard"));
    EXPECT_EQ(stopped.rows, std::vector<std::string>(straight.rows.begin(), straight.rows.begin() + 2));
    EXPECT_EQ(stopped.log->metrics.size(), 2u);
    EXPECT_EQ(stopped.result.last_loss, straight.log->metrics[1].loss);
    const ReadbackRun resumed = run_with_lag(config_with(stopped_dir.path(), 4, keys), 1, synthetic());
    ASSERT_TRUE(resumed.result.resumed_from.has_value());
    EXPECT_EQ(resumed.rows, straight.rows);
    for (std::size_t i = 0; i < straight.weights.size(); ++i)
        EXPECT_TRUE(at::equal(straight.weights[i].second, resumed.weights[i].second))
            << straight.weights[i].first;
}

// A loss that turns non-finite is still caught, a step late, naming the step it belongs to; no
// checkpoint holds the weights trained on it (the save reads the step back first).
TEST(TrainReadback, NonFiniteLossNamesItsStepAndIsNeverCheckpointed) {
    test::TempDir dir;
    const TrainConfig c =
        config_with(dir.path(), 4, R"({"learning_rate": 1e30, "checkpoint_step_interval": 1})");
    try {
        run_with_lag(c, 1, synthetic());
        ADD_FAILURE() << "a learning rate of 1e30 trained on";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("at step 2 (batch:"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(std::filesystem::exists(dir / "checkpoint-1" / ".guard"));
    EXPECT_FALSE(std::filesystem::exists(dir / "checkpoint-2"));
    EXPECT_EQ(metrics_rows(dir.path()).size(), 1u);
}

// DTUNE_SYNC_READBACK: 1 reads each step back at once (lag 0), unset or 0 a step late; anything
// else is refused, naming the variable.
TEST(TrainReadback, SyncSwitchIsReadOnceAndCheckedAtStart) {
    unsetenv("DTUNE_SYNC_READBACK");
    EXPECT_EQ(ReadbackOptions::from_env().lag, 1);
    setenv("DTUNE_SYNC_READBACK", "1", 1);
    EXPECT_EQ(ReadbackOptions::from_env().lag, 0);
    setenv("DTUNE_SYNC_READBACK", "yes", 1);
    try {
        ReadbackOptions::from_env();
        ADD_FAILURE() << "DTUNE_SYNC_READBACK=yes accepted";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("DTUNE_SYNC_READBACK='yes'"), std::string::npos) << e.what();
    }
    unsetenv("DTUNE_SYNC_READBACK");
}

TEST(TrainSignals, StopRequestBeforeTheFirstStepReportsInterruptedWithoutACheckpoint) {
    test::TempDir dir;
    install_stop_signal_handlers();
    request_stop();
    TrainResult r;
    run_trainer(tiny_config(dir.path(), 4), &r);
    clear_stop_request();
    EXPECT_EQ(r.outcome, TrainOutcome::kInterrupted);
    EXPECT_EQ(r.global_step, 0);
    EXPECT_FALSE(std::filesystem::exists(dir / "checkpoint-0"));
}

}  // namespace
}  // namespace test_trainer_local
}  // namespace dtune::train
