// cuda_graph on a CUDA device (tiny SDXL fixture, LoRA): the trainer replays CUDA graphs, keeps
// them across a changing LR (linear schedule: the LR is read from device memory), and its per-step
// losses and final weights match the same run kept eager with the graph's settings (device RNG and
// LR, DTUNE_CUDA_GRAPH_WARMUP above the step count) within float32 reordering tolerance, for
// SimpleTuner's defaults (clip by value at 2, lora_dropout 0.1: masks from the device seed) and
// for other step options, gradient accumulation included (a micro graph and a final graph per
// shape; the micro graphs must replay too). Every step's loss is read back (a step later, on_step_metrics),
// whatever metrics_interval (2 here: a row every other step). The same for Flux.1 (the tiny pipeline's
// transformer, LoRA, flow matching with sigmas and embedded guidance drawn on the GPU) with cuda_graph true,
// every sigma schedule included (Beta's gamma draws and the fast list), and cuda_graph auto graphing
// Flux runs. A timestep bias (inverse CDF on the GPU) and Diff2Flow are graphed for SDXL.
// mixed_precision fp16 is graphed too, with a case whose scale overflows so that replays skip steps
// like the eager run. Skipped without CUDA.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>

#include "family/flux/flux_family.h"
#include "train/graph_step.h"
#include "train/loss_scaler.h"
#include "train/trainer_graph.h"
#include "trainer_test_util.h"

namespace dtune::train {
namespace test_trainer_graph_gpu_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

constexpr int64_t kSteps = 6;

struct LossLog : TrainCallback {
    std::vector<double> losses;
    void on_step_metrics(Trainer&, const StepReport& r) override { losses.push_back(r.loss); }
};

struct GraphRun {
    std::vector<double> losses;
    std::vector<at::Tensor> weights;
    int64_t replays = 0, eager = 0;
    int64_t micro_replays = 0;    // gradient accumulation: micro-steps before the last, replayed
    nlohmann::json last_metrics;  // metrics.jsonl's last row
};

// Runs `trainer` (output in `dir`) with DTUNE_CUDA_GRAPH_WARMUP set to `warmup`; expects a graphed run.
GraphRun run_graphed(Trainer& trainer, const std::filesystem::path& dir, const char* warmup) {
    setenv("DTUNE_CUDA_GRAPH_WARMUP", warmup, 1);
    auto log = std::make_shared<LossLog>();
    trainer.add_callback(log);
    trainer.run();
    unsetenv("DTUNE_CUDA_GRAPH_WARMUP");
    GraphRun out;
    std::ifstream metrics(dir / "metrics.jsonl");
    for (std::string line; std::getline(metrics, line);)
        if (!line.empty()) out.last_metrics = nlohmann::json::parse(line);
    out.losses = log->losses;
    for (const auto& p : trainer.trainable_parameters()) out.weights.push_back(p.tensor.detach().cpu());
    EXPECT_NE(trainer.graphed_step(), nullptr) << "the run should meet every cuda_graph condition";
    EXPECT_EQ(trainer.graph_status().fallback, "");
    if (trainer.graphed_step()) {
        out.replays = trainer.graphed_step()->replays();
        out.eager = trainer.graphed_step()->eager_steps();
        out.micro_replays = trainer.graphed_step()->micro_replays();
    }
    return out;
}

// A trainer of the tiny SDXL UNet on CUDA (its weights in `dtype`), fed batches of 2 synthetic 8 x 8
// latents.
std::unique_ptr<Trainer> sdxl_cuda_trainer(const TrainConfig& config, at::ScalarType dtype = at::kFloat) {
    auto unet = testutil::tiny_unet();
    unet->to(c10::Device(c10::kCUDA, 0), dtype);
    SyntheticBatchOptions o;
    o.batch_size = 2;
    o.latent_size = 8;
    o.dim = 64;
    o.pooled_dim = 32;
    o.device = c10::Device(c10::kCUDA, 0);
    return std::make_unique<Trainer>(config, testutil::sdxl_model(unet), testutil::tiny_schedule(),
                                     std::make_unique<SyntheticBatchSource>(o));
}

GraphRun train_cuda(const char* warmup, int64_t metrics_interval, const nlohmann::json& options) {
    test::TempDir dir;
    nlohmann::json j{{"model_type", "lora"},          {"lora_rank", 4},
                     {"deterministic", false},        {"lr_scheduler", "linear"},
                     {"checkpoint_step_interval", 0}, {"metrics_interval", metrics_interval}};
    j.update(options);
    const auto trainer = sdxl_cuda_trainer(testutil::tiny_config(dir.path(), kSteps, j));
    return run_graphed(*trainer, dir.path(), warmup);
}

// Checks a graphed run against the same run kept eager with the graph's settings: warm-up and replay
// counts, per-step losses (every step's, read back without a wait) and the final trainable weights.
void expect_graph_matches_eager(const GraphRun& eager, const GraphRun& graph, double weight_tol = 1e-1) {
    EXPECT_EQ(eager.replays, 0);
    EXPECT_EQ(eager.eager, kSteps);
    // Two warm-up steps, then every step (the capture's included) replays; a recapture on each LR
    // change would leave fewer.
    EXPECT_EQ(graph.eager, 2);
    EXPECT_EQ(graph.replays, kSteps - 2);
    // metrics.jsonl counts them (this run's steps, cumulative).
    EXPECT_EQ(graph.last_metrics.value("graph_replays", -1), kSteps - 2) << graph.last_metrics.dump();
    EXPECT_EQ(graph.last_metrics.value("eager_steps", -1), 2) << graph.last_metrics.dump();
    ASSERT_EQ(eager.losses.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(graph.losses.size(), static_cast<size_t>(kSteps));
    for (int64_t i = 0; i < kSteps; ++i) {
        const double e = eager.losses[i], g = graph.losses[i];
        ASSERT_TRUE(std::isfinite(e)) << "step " << i + 1;
        EXPECT_NEAR(g, e, 1e-3 * std::abs(e) + 1e-6) << "step " << i + 1;
    }
    ASSERT_EQ(eager.weights.size(), graph.weights.size());
    ASSERT_FALSE(eager.weights.empty());
    // Relative to the tensor's norm: Adam's first steps move an element by about +-lr whatever its
    // gradient's size, so a near-zero gradient whose sign the GPU's reduction order flips may differ
    // by 2 lr in one element; a stale or wrong LR (or different noise) moves whole tensors. On an
    // H200 two LoRA tensors differed by 5.6% and 6.5% of their norm (bf16 autocast): 10% keeps
    // those apart from a wrong step, which differs by the size of the tensor itself. Lion moves
    // every element by exactly +-lr, so each flipped sign costs 2 lr however small its gradient: a
    // small LoRA tensor differed by 10.5% on an H200 (weight_tol 0.25 for it).
    for (size_t i = 0; i < eager.weights.size(); ++i) {
        const double diff = (graph.weights[i] - eager.weights[i]).norm().item<double>();
        const double norm = eager.weights[i].norm().item<double>();
        EXPECT_LE(diff, weight_tol * norm + 1e-7) << "tensor " << i << " (norm " << norm << ")";
    }
}

// (name, config keys as JSON)
class CudaGraphTrainerGpu : public ::testing::TestWithParam<std::pair<const char*, const char*>> {};

TEST_P(CudaGraphTrainerGpu, ReplaysAndMatchesTheEagerRun) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const nlohmann::json options = nlohmann::json::parse(GetParam().second);
    const GraphRun eager = train_cuda("1000", 1, options);
    const GraphRun graph = train_cuda("2", 2, options);
    // Counted per optimizer step (its last micro-step), so the counts do not depend on accumulation.
    expect_graph_matches_eager(eager, graph, options.value("optimizer", "") == "optimi-lion" ? 0.25 : 0.1);
    // Accumulation: the micro graph has its own two warm-up micro-steps, then every one replays.
    const int64_t accum = options.value("gradient_accumulation_steps", int64_t{1});
    EXPECT_EQ(eager.micro_replays, 0);
    EXPECT_EQ(graph.micro_replays, accum > 1 ? (accum - 1) * kSteps - 2 : 0);
}

// bf16 autocast with float32 factors: the factors' bf16 copies, refreshed once per forward
// (DTUNE_LORA_CAST_FACTORS, on by default), train as the per-layer casts do: the same losses and
// weights eagerly (deterministic, so to float rounding), and a graphed run with the copies matches
// an eager run without them.
TEST(CastFactorCopiesGpu, Bf16RunsTrainAsThePerLayerCasts) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const nlohmann::json bf16{{"mixed_precision", "bf16"}, {"deterministic", true}};
    auto run = [&](const char* copies, const char* warmup) {
        setenv("DTUNE_LORA_CAST_FACTORS", copies, 1);
        GraphRun r = train_cuda(warmup, 1, bf16);
        unsetenv("DTUNE_LORA_CAST_FACTORS");
        return r;
    };
    const GraphRun cast = run("0", "1000");
    const GraphRun copies = run("1", "1000");
    ASSERT_EQ(cast.losses.size(), copies.losses.size());
    for (size_t i = 0; i < cast.losses.size(); ++i)
        EXPECT_NEAR(copies.losses[i], cast.losses[i], 1e-6 * std::abs(cast.losses[i])) << "step " << i + 1;
    ASSERT_EQ(cast.weights.size(), copies.weights.size());
    for (size_t i = 0; i < cast.weights.size(); ++i)
        EXPECT_LE((copies.weights[i] - cast.weights[i]).norm().item<double>(),
                  1e-6 * cast.weights[i].norm().item<double>() + 1e-9)
            << "tensor " << i;
    expect_graph_matches_eager(cast, run("1", "2"));
}

// cuda_graph left at auto with SimpleTuner's step defaults; explicit norm clipping without dropout;
// DoRA with dropout and value clipping; gradient checkpointing with dropout (the recompute must
// find the same masks inside the graph); gradient accumulation over 2 micro-batches with the
// defaults (a dropout seed per micro-step), and over 3 with norm clipping (the clip sees the summed
// gradient).
INSTANTIATE_TEST_SUITE_P(
    Options, CudaGraphTrainerGpu,
    ::testing::Values(std::pair{"SimpleTunerDefaults", R"({})"},
                      std::pair{"NormClipNoDropout", R"({"cuda_graph": true, "grad_clip_method": "norm",
                                                         "max_grad_norm": 1.0, "lora_dropout": 0.0})"},
                      std::pair{"DoRAValueClip", R"({"use_dora": true, "max_grad_norm": 0.01})"},
                      std::pair{"CheckpointingWithDropout", R"({"gradient_checkpointing": true})"},
                      std::pair{"Accumulation2", R"({"gradient_accumulation_steps": 2})"},
                      std::pair{"Accumulation3NormClip",
                                R"({"cuda_graph": true, "gradient_accumulation_steps": 3,
                                    "grad_clip_method": "norm", "max_grad_norm": 1.0})"}),
    [](const auto& info) { return std::string(info.param.first); });

// Lion, SGD and Adafactor, captured with their LR (and Adafactor's step terms) read from the device
// (train/optimizer_graph.cpp) under the linear schedule. SGD runs with momentum 0: no config key sets
// SGD's momentum (optimizer_config is refused), so that is what a run trains with. Adafactor also
// with accumulation over 2 micro-batches (its step counts advance once per optimizer step).
INSTANTIATE_TEST_SUITE_P(
    Optimizers, CudaGraphTrainerGpu,
    ::testing::Values(std::pair{"Lion", R"({"optimizer": "optimi-lion", "learning_rate": 5e-5})"},
                      std::pair{"SGD", R"({"optimizer": "torch-sgd", "learning_rate": 1e-2})"},
                      std::pair{"Adafactor", R"({"optimizer": "torch-adafactor", "learning_rate": 1e-2})"},
                      std::pair{"AdafactorAccumulation2",
                                R"({"optimizer": "torch-adafactor", "learning_rate": 1e-2,
                                    "gradient_accumulation_steps": 2})"}),
    [](const auto& info) { return std::string(info.param.first); });

// Offset noise (gated per step with SimpleTuner's noise_offset_probability 0.25), input perturbation,
// min-SNR and the Huber losses with a per-sample huber_c, all inside the graph: the gate, offset and
// perturbation are device draws, huber_c and the min-SNR weights come from the device timesteps
// (train/step.cpp, diffusion/loss.cpp). cuda_graph true: a fallback to eager fails the case.
INSTANTIATE_TEST_SUITE_P(
    NoiseAndLoss, CudaGraphTrainerGpu,
    ::testing::Values(
        std::pair{"OffsetNoise", R"({"cuda_graph": true, "offset_noise": true, "noise_offset": 0.1})"},
        std::pair{"InputPerturbation", R"({"cuda_graph": true, "input_perturbation": 0.1})"},
        std::pair{"SnrGamma", R"({"cuda_graph": true, "snr_gamma": 5.0})"},
        std::pair{"HuberSnrSchedule",
                  R"({"cuda_graph": true, "loss_type": "huber", "huber_schedule": "snr"})"},
        std::pair{"SmoothL1Constant",
                  R"({"cuda_graph": true, "loss_type": "smooth_l1", "huber_schedule": "constant"})"}),
    [](const auto& info) { return std::string(info.param.first); });

// timestep_bias_strategy: the timesteps drawn by inverse CDF on the GPU (diffusion::draw_timesteps,
// its table put on the GPU by the first warm-up step), segmented across the batch as on the eager
// path; with accumulation the micro graph draws from the same table; left at auto, a biased run is
// graphed. Diff2Flow: the flow-target loss from the device timesteps (diffusion::diff2flow_prediction).
INSTANTIATE_TEST_SUITE_P(
    BiasAndDiff2Flow, CudaGraphTrainerGpu,
    ::testing::Values(std::pair{"TimestepBiasLater",
                                R"({"cuda_graph": true, "timestep_bias_strategy": "later",
                                                         "timestep_bias_multiplier": 3.0})"},
                      std::pair{"TimestepBiasRangeAccumulation2",
                                R"({"cuda_graph": true, "timestep_bias_strategy": "range",
                                    "timestep_bias_begin": 200, "timestep_bias_end": 500,
                                    "timestep_bias_multiplier": 2.0, "gradient_accumulation_steps": 2})"},
                      std::pair{"TimestepBiasEarlierAuto", R"({"timestep_bias_strategy": "earlier",
                                                               "timestep_bias_portion": 0.1,
                                                               "timestep_bias_multiplier": 5.0})"},
                      std::pair{"Diff2Flow", R"({"cuda_graph": true, "diff2flow_enabled": true,
                                                 "diff2flow_loss": true})"},
                      // deterministic's per-tensor AdamW (step counts and lr on the device), and
                      // scheduled sampling's rollout masked per sample on the device (train/step.cpp),
                      // also with a ramped probability (refilled on the device before each replay).
                      std::pair{"DeterministicAdamWLoop", R"({"cuda_graph": true, "deterministic": true})"},
                      std::pair{"ScheduledSampling", R"({"cuda_graph": true,
                                                         "scheduled_sampling_max_step_offset": 4,
                                                         "scheduled_sampling_probability": 0.5})"},
                      std::pair{"ScheduledSamplingRamp", R"({"cuda_graph": true,
                                                             "scheduled_sampling_max_step_offset": 3,
                                                             "scheduled_sampling_ramp_steps": 6,
                                                             "scheduled_sampling_prob_start": 0.1,
                                                             "scheduled_sampling_prob_end": 0.9})"}),
    [](const auto& info) { return std::string(info.param.first); });

// mixed_precision fp16: the device loss scaler (loss_scaler.h) inside the graph (scale, unscale and
// the optimizer's overflow skip captured; the scale update after the replay), alone and with the
// micro graphs of accumulation; Lion, SGD and Adafactor skip with at::where on the device
// (optimizer_graph.cpp). adamw_bf16 needs bf16 weights: CudaGraphFp16Gpu below.
INSTANTIATE_TEST_SUITE_P(
    Fp16, CudaGraphTrainerGpu,
    ::testing::Values(std::pair{"Fp16TorchAdamW", R"({"cuda_graph": true, "mixed_precision": "fp16",
                                                      "optimizer": "torch-adamw"})"},
                      std::pair{"Fp16Accumulation2",
                                R"({"cuda_graph": true, "mixed_precision": "fp16", "optimizer": "torch-adamw",
                                    "gradient_accumulation_steps": 2, "grad_clip_method": "norm",
                                    "max_grad_norm": 1.0})"},
                      std::pair{"Fp16Lion", R"({"cuda_graph": true, "mixed_precision": "fp16",
                                                "optimizer": "optimi-lion", "learning_rate": 5e-5})"},
                      std::pair{"Fp16SGD", R"({"cuda_graph": true, "mixed_precision": "fp16",
                                               "optimizer": "torch-sgd", "learning_rate": 1e-2})"},
                      std::pair{"Fp16Adafactor", R"({"cuda_graph": true, "mixed_precision": "fp16",
                                                     "optimizer": "torch-adafactor", "learning_rate": 1e-2})"},
                      std::pair{"Fp16AdafactorAccumulation2",
                                R"({"cuda_graph": true, "mixed_precision": "fp16",
                                    "optimizer": "torch-adafactor", "learning_rate": 1e-2,
                                    "gradient_accumulation_steps": 2})"}),
    [](const auto& info) { return std::string(info.param.first); });

// fp16 runs whose scale overflows for real (see OverflowedStepsAreSkippedInsideTheReplay): the
// per-step rows of metrics.jsonl with the run. `options` are added to an fp16 LoRA run; with
// "model_type": "full" the UNet is bf16 (adamw_bf16 needs bf16 weights).
struct Fp16Run {
    GraphRun run;
    std::vector<nlohmann::json> rows;
};

Fp16Run train_overflowing_fp16(const char* warmup, const nlohmann::json& options) {
    test::TempDir dir;
    nlohmann::json j{{"model_type", "lora"},
                     {"lora_rank", 4},
                     {"deterministic", false},
                     {"lr_scheduler", "linear"},
                     {"checkpoint_step_interval", 0},
                     {"metrics_interval", 1},
                     {"cuda_graph", true},
                     {"mixed_precision", "fp16"}};
    j.update(options);
    const TrainConfig config = testutil::tiny_config(dir.path(), kSteps, j);
    std::unique_ptr<Trainer> owned =
        sdxl_cuda_trainer(config, j.at("model_type") == "full" ? at::kBFloat16 : at::kFloat);
    Trainer& trainer = *owned;
    trainer.set_loss_scaler_options(LossScalerOptions{std::ldexp(1.0, 20), 16.0, 1.0 / 16, 1});
    Fp16Run out;
    out.run = run_graphed(trainer, dir.path(), warmup);
    std::ifstream metrics(dir.path() / "metrics.jsonl");
    for (std::string line; std::getline(metrics, line);)
        if (!line.empty()) out.rows.push_back(nlohmann::json::parse(line));
    return out;
}

// The graphed run against the eager one: the same scales and skipped steps per row, and at least
// one replayed step skipped (not all).
void expect_same_skips(const Fp16Run& eager, const Fp16Run& graph, double weight_tol) {
    expect_graph_matches_eager(eager.run, graph.run, weight_tol);
    ASSERT_EQ(eager.rows.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(graph.rows.size(), static_cast<size_t>(kSteps));
    for (int64_t i = 0; i < kSteps; ++i) {
        EXPECT_EQ(graph.rows[i].at("loss_scale"), eager.rows[i].at("loss_scale")) << "step " << i + 1;
        EXPECT_EQ(graph.rows[i].at("skipped_steps"), eager.rows[i].at("skipped_steps")) << "step " << i + 1;
    }
    // Steps 3.. are replays (two warm-up steps): at least one of them was skipped, and not all.
    const int64_t before = graph.rows[1].at("skipped_steps").get<int64_t>();
    const int64_t after = graph.rows.back().at("skipped_steps").get<int64_t>();
    EXPECT_GT(after, before) << "no replayed step overflowed: the test does not exercise the skip";
    EXPECT_LT(after - before, kSteps - 2) << "every replayed step overflowed";
}

// fp16 with a scale that overflows for real: 2^20, x16 after every clean step, /16 after an
// overflow (the fp16 backward overflows near 2^24 here), so clean and skipped steps alternate, in
// the replays too. The graphed run must skip the same steps as the eager one, leave the weights
// alone on them (the harness compares the weights) and log the same scales and skipped counts:
// fused AdamW (the kernel's found_inf), Lion, SGD and Adafactor (at::where on the device, Adafactor's
// step count on the device), and adamw_bf16 on a bf16 full fine-tune (its kernel's found_inf, its
// step counts and decay accumulators on the device; lr wd up to 5e-3, so decays come due in the run).
class CudaGraphFp16Gpu : public ::testing::TestWithParam<std::pair<const char*, const char*>> {};

TEST_P(CudaGraphFp16Gpu, OverflowedStepsAreSkippedInsideTheReplay) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const nlohmann::json options = nlohmann::json::parse(GetParam().second);
    const Fp16Run eager = train_overflowing_fp16("1000", options);
    const Fp16Run graph = train_overflowing_fp16("2", options);
    expect_same_skips(eager, graph, options.at("optimizer") == "optimi-lion" ? 0.25 : 0.1);
}

INSTANTIATE_TEST_SUITE_P(
    Optimizers, CudaGraphFp16Gpu,
    ::testing::Values(std::pair{"TorchAdamW", R"({"optimizer": "torch-adamw"})"},
                      std::pair{"Lion", R"({"optimizer": "optimi-lion", "learning_rate": 5e-5})"},
                      std::pair{"SGD", R"({"optimizer": "torch-sgd", "learning_rate": 1e-2})"},
                      std::pair{"Adafactor", R"({"optimizer": "torch-adafactor", "learning_rate": 1e-2})"},
                      std::pair{"AdamWBF16Full", R"({"optimizer": "adamw_bf16", "model_type": "full",
                                                     "learning_rate": 1e-2, "adam_weight_decay": 0.5})"}),
    [](const auto& info) { return std::string(info.param.first); });

// ---- Flux.1: flow matching ----------------------------------------------------------------------

const std::filesystem::path kFluxPipeline =
    std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref" / "tiny-flux-pipeline";

// A Flux LoRA run on the tiny pipeline's transformer (float32 on CUDA, batch 2 of 16 x 8 x 8 latents
// and random T5 / CLIP embeddings in its widths), with the family's training keys applied.
std::unique_ptr<Trainer> flux_trainer(const std::filesystem::path& dir, int64_t metrics_interval,
                                      const nlohmann::json& options) {
    TrainConfig config;
    nlohmann::json j{{"model_family", "flux"},
                     {"output_dir", dir.string()},
                     {"model_type", "lora"},
                     {"lora_rank", 4},
                     {"optimizer", "torch-adamw"},
                     {"learning_rate", 1e-3},
                     {"lr_scheduler", "linear"},
                     {"train_batch_size", 2},
                     {"max_train_steps", kSteps},
                     {"checkpoint_step_interval", 0},
                     {"mixed_precision", "no"},
                     {"gradient_checkpointing", false},
                     {"deterministic", false},
                     {"seed", 1234},
                     {"metrics_interval", metrics_interval},
                     {"cuda_graph", true}};
    j.update(options);
    config.merge_json(j, "flux graph test");
    config.validate();
    const family::ModelFamily& flux = family::flux_family();
    const c10::Device cuda(c10::kCUDA, 0);
    auto model = flux.load_denoiser(kFluxPipeline / "transformer", {at::kFloat, cuda});
    family::TrainingObjective objective = flux.training_objective(kFluxPipeline);
    flux.apply_training_config(config, *model, objective);
    SyntheticBatchOptions o;
    o.batch_size = 2;
    o.latent_channels = 16;
    o.latent_size = 8;
    o.tokens = 8;
    o.dim = 24;         // joint_attention_dim (T5's width in the tiny pipeline)
    o.pooled_dim = 32;  // pooled_projection_dim (CLIP-L's)
    o.device = cuda;
    return std::make_unique<Trainer>(config, std::move(model), std::move(objective),
                                     std::make_unique<SyntheticBatchSource>(o));
}

GraphRun train_flux_cuda(const char* warmup, int64_t metrics_interval, const nlohmann::json& options) {
    test::TempDir dir;
    auto trainer = flux_trainer(dir.path(), metrics_interval, options);
    return run_graphed(*trainer, dir.path(), warmup);
}

// (name, config keys as JSON)
class CudaGraphFluxGpu : public ::testing::TestWithParam<std::pair<const char*, const char*>> {};

TEST_P(CudaGraphFluxGpu, ReplaysAndMatchesTheEagerRun) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const nlohmann::json options = nlohmann::json::parse(GetParam().second);
    // The eager reference keeps the graph's settings (device draws of noise, sigmas and guidance).
    const GraphRun eager = train_flux_cuda("1000", 1, options);
    const GraphRun graph = train_flux_cuda("2", 2, options);
    expect_graph_matches_eager(eager, graph);
    // LoRA B starts at zero: the graphed run trained.
    double moved = 0;
    for (const at::Tensor& w : graph.weights) moved = std::max(moved, w.abs().max().item<double>());
    EXPECT_GT(moved, 0.0);
}

// SimpleTuner's Flux defaults (logit-normal sigmas, shift 3, constant guidance 1, clip by value,
// lora_dropout 0.1); guidance drawn per sample on the GPU; uniform sigmas with the auto shift and
// norm clipping; Beta sigmas (at::_sample_dirichlet's gamma draws inside the capture) shifted, and
// an asymmetric Beta; the fast list (an index per sample mapped to its sigma on the GPU).
INSTANTIATE_TEST_SUITE_P(
    Options, CudaGraphFluxGpu,
    ::testing::Values(std::pair{"FluxDefaults", R"({})"},
                      std::pair{"RandomRangeGuidance", R"({"flux_guidance_mode": "random-range",
                                                           "flux_guidance_min": 1.0, "flux_guidance_max": 4.0})"},
                      std::pair{"UniformAutoShiftNormClip", R"({"flow_use_uniform_schedule": true,
                                                                "flow_schedule_auto_shift": true,
                                                                "grad_clip_method": "norm", "max_grad_norm": 1.0,
                                                                "lora_dropout": 0.0})"},
                      std::pair{"FluxBeta", R"({"flow_use_beta_schedule": true})"},
                      std::pair{"FluxBetaAsymmetric",
                                R"({"cuda_graph": true, "flow_use_beta_schedule": true,
                                                              "flow_beta_schedule_alpha": 0.5,
                                                              "flow_beta_schedule_beta": 3.0})"},
                      std::pair{"FluxFastSchedule", R"({"flux_fast_schedule": true})"}),
    [](const auto& info) { return std::string(info.param.first); });

// cuda_graph auto graphs a Flux run (CudaGraphFluxGpu checks it matches the eager run), with every
// sigma schedule: the default logit-normal, Beta and the fast list.
TEST(CudaGraphFluxGpuAuto, AutoGraphsEverySigmaSchedule) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    for (const nlohmann::json& options :
         {nlohmann::json::object(), nlohmann::json{{"flow_use_beta_schedule", true}},
          nlohmann::json{{"flux_fast_schedule", true}}}) {
        test::TempDir dir;
        nlohmann::json o = options;
        o["cuda_graph"] = "auto";
        o["max_train_steps"] = 4;
        auto trainer = flux_trainer(dir.path(), 1, o);
        trainer->run();
        EXPECT_NE(trainer->graphed_step(), nullptr) << options.dump();
        EXPECT_EQ(trainer->graph_status().fallback, "") << options.dump();
        if (trainer->graphed_step()) {
            EXPECT_EQ(trainer->graphed_step()->replays(), 2) << options.dump();
        }
    }
}

}  // namespace
}  // namespace test_trainer_graph_gpu_local
}  // namespace dtune::train
