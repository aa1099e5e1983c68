// The draws that made timestep_bias_strategy, flow_use_beta_schedule and flux_fast_schedule
// graphable, and Diff2Flow's step, checked on the CPU (where the "device" generator is the CPU's
// default one):
// - a timestep bias is drawn by inverse CDF (diffusion::timestep_cdf, draw_timesteps): each table
//   row equals SimpleTuner's segmented_timestep_selection weights, normalised in place in float32 as
//   it does (the procedure written out here), and many draws match those probabilities bin by bin,
//   segmented or not; a generator and a device's default generator give the same numbers;
// - the step with StepOptions::device_rng and a bias draws noise then biased timesteps from the
//   default generator only, keeps a data-parallel rank's rows, and an eager run with a bias resumes
//   bit for bit;
// - Beta sigmas drawn on the device have Beta(a, b)'s mean and variance, and are the eager path's
//   torch.distributions.Beta formula number for number; the fast list's device draw is SimpleTuner's
//   list with its shares, and the eager path's old table lookup number for number;
// - the biased timestep draw, the fast list and Diff2Flow's conversion run on meta tensors, which
//   hold no data: any host read would throw there, as it would break a CUDA graph capture. (Beta's
//   Dirichlet sampler has no meta kernel; its CUDA kernel takes Philox offsets that a capture
//   records, and test_trainer_graph_gpu's FluxBeta case captures it.)
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "diffusion/loss.h"
#include "models/common/weights.h"
#include "support/test_support.h"
#include "train/step.h"
#include "trainer_test_util.h"

namespace dtune::train {
namespace test_graphed_draws_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using diffusion::TimestepBiasStrategy;
using diffusion::TimestepSamplingOptions;

constexpr int64_t kT = 1000;

TimestepSamplingOptions bias(TimestepBiasStrategy s, double multiplier, double portion = 0.25,
                             int64_t begin = 0, int64_t end = 1000) {
    TimestepSamplingOptions o;
    o.bias.strategy = s;
    o.bias.multiplier = multiplier;
    o.bias.portion = portion;
    o.bias.begin = begin;
    o.bias.end = end;
    return o;
}

// SimpleTuner's segmented_timestep_selection, its probabilities rather than its draws: the float32
// weights split into B segments of T / B from the top (the last reaching 0), consecutive segments
// sharing a boundary, each normalised in place before the next is cut. [B, T] float64, row i the
// probabilities sample i is drawn with.
at::Tensor simpletuner_segment_probabilities(const at::Tensor& weights_in, int64_t b) {
    at::Tensor weights = weights_in.clone();  // float32, as SimpleTuner's
    const int64_t t = weights.size(0), segment = std::max<int64_t>(t / b, 1);
    at::Tensor out = at::zeros({b, t}, at::kDouble);
    for (int64_t i = 0; i < b; ++i) {
        const int64_t start = t - 1 - i * segment;
        const int64_t end = i == b - 1 ? 0 : std::max<int64_t>(start - segment, 0);
        at::Tensor seg = weights.slice(0, end, start + 1);
        seg /= seg.sum();
        out[i].slice(0, end, start + 1).copy_(seg);
    }
    return out;
}

// Share of `t` ([N] int64) in each bin of `width` timesteps: [T / width] float64.
at::Tensor bin_shares(const at::Tensor& t, int64_t width) {
    return at::bincount(t.div(width, "floor"), {}, kT / width).to(at::kDouble) /
           static_cast<double>(t.numel());
}

at::Tensor bin_probabilities(const at::Tensor& p, int64_t width) {
    return p.to(at::kDouble).view({kT / width, width}).sum(1);
}

TEST(TimestepBiasDraws, CdfRowsAreSimpleTunersSegmentWeights) {
    for (const auto& o :
         {bias(TimestepBiasStrategy::kLater, 3.0), bias(TimestepBiasStrategy::kEarlier, 5.0, 0.1),
          bias(TimestepBiasStrategy::kRange, 3.0, 0.25, 200, 500), TimestepSamplingOptions{}}) {
        const at::Tensor w = diffusion::timestep_weights(o.bias, kT);
        for (const int64_t b : {2, 3, 4, 7}) {
            const at::Tensor want = simpletuner_segment_probabilities(w, b).cumsum(1);  // [B, T]
            const at::Tensor cdf = diffusion::timestep_cdf(b, kT, o);
            ASSERT_EQ(cdf.sizes(), want.sizes());
            EXPECT_LE((cdf - want).abs().max().item<double>(), 2e-6) << "B " << b;
            // Exactly 1 from each segment's top on: a draw u < 1 never leaves its segment.
            EXPECT_TRUE(cdf.select(1, kT - 1).eq(1.0).all().item<bool>());
        }
        // One sample, or segments disabled: the plain cumulative weights, one row for every sample.
        TimestepSamplingOptions flat = o;
        flat.disable_segmented_timestep_sampling = true;
        const at::Tensor plain = w.to(at::kDouble).cumsum(0) / w.to(at::kDouble).sum();  // kNone's are ones
        EXPECT_LE((diffusion::timestep_cdf(8, kT, flat) - plain).abs().max().item<double>(), 2e-6);
        EXPECT_LE((diffusion::timestep_cdf(1, kT, o) - plain).abs().max().item<double>(), 2e-6);
    }
}

TEST(TimestepBiasDraws, DeviceDrawsFollowTheHostWeights) {
    constexpr int64_t kDraws = 50000;  // a bin share's standard error <= 0.0014
    diffusion::TimestepCdfCache cache;
    const c10::Device cpu(c10::kCPU);
    for (const auto& o :
         {bias(TimestepBiasStrategy::kLater, 3.0), bias(TimestepBiasStrategy::kEarlier, 5.0, 0.1),
          bias(TimestepBiasStrategy::kRange, 3.0, 0.25, 200, 500)}) {
        SCOPED_TRACE(static_cast<int>(o.bias.strategy));
        // Without segments (one sample per draw): the host weights, bin by bin.
        TimestepSamplingOptions flat = o;
        flat.disable_segmented_timestep_sampling = true;
        at::manual_seed(3);
        const at::Tensor t = diffusion::draw_timesteps(kDraws, kT, flat, std::nullopt, cpu, &cache);
        ASSERT_EQ(t.scalar_type(), at::kLong);
        EXPECT_GE(t.min().item<int64_t>(), 0);
        EXPECT_LT(t.max().item<int64_t>(), kT);
        const at::Tensor want = bin_probabilities(diffusion::timestep_weights(o.bias, kT), 25);
        EXPECT_LE((bin_shares(t, 25) - want).abs().max().item<double>(), 0.008);  // a wrong bias: >= 0.02
        // The generator path is the same formula: same seed, same numbers.
        at::Generator gen = at::detail::createCPUGenerator(3);
        EXPECT_TRUE(at::equal(t, diffusion::draw_timesteps(kDraws, kT, flat, gen, cpu)));

        // Segmented, four samples: each row its own segment's probabilities.
        at::manual_seed(4);
        constexpr int64_t kBatches = 4000;
        at::Tensor rows = at::empty({kBatches, 4}, at::kLong);
        for (int64_t i = 0; i < kBatches; ++i)
            rows[i].copy_(diffusion::draw_timesteps(4, kT, o, std::nullopt, cpu, &cache));
        const at::Tensor p = simpletuner_segment_probabilities(diffusion::timestep_weights(o.bias, kT), 4);
        for (int64_t r = 0; r < 4; ++r)  // bins of 25 within a segment of 250: standard error <= 0.0065
            EXPECT_LE((bin_shares(rows.select(1, r).contiguous(), 25) - bin_probabilities(p[r], 25))
                          .abs()
                          .max()
                          .item<double>(),
                      0.035)
                << "sample " << r;
    }
    // The biased mass itself, by hand: later x3 over the last quarter is half the draws.
    at::manual_seed(5);
    TimestepSamplingOptions later = bias(TimestepBiasStrategy::kLater, 3.0);
    later.disable_segmented_timestep_sampling = true;
    const at::Tensor t = diffusion::draw_timesteps(kDraws, kT, later, std::nullopt, cpu, &cache);
    EXPECT_NEAR(t.ge(750).to(at::kDouble).mean().item<double>(), 0.5, 0.011);  // unbiased: 0.25
    // Without a bias the device draw stays one randint (graphed runs' uniform draw).
    at::manual_seed(6);
    const at::Tensor uniform = diffusion::draw_timesteps(8, kT, TimestepSamplingOptions{}, std::nullopt, cpu);
    at::manual_seed(6);
    EXPECT_TRUE(at::equal(uniform, at::randint(0, kT, {8}, at::kLong)));
}

TEST(TimestepBiasDraws, MakeNoHostRead) {
    const c10::Device meta(c10::kMeta);
    diffusion::TimestepCdfCache cache;
    for (const bool segmented : {true, false}) {
        TimestepSamplingOptions o = bias(TimestepBiasStrategy::kEarlier, 4.0);
        o.disable_segmented_timestep_sampling = !segmented;
        cache.get(4, kT, o, meta);  // what the warm-up step leaves for the capture
        const at::Tensor t = diffusion::draw_timesteps(4, kT, o, std::nullopt, meta, &cache);
        EXPECT_TRUE(t.is_meta());
        EXPECT_EQ(t.sizes(), at::IntArrayRef({4}));
        EXPECT_EQ(t.scalar_type(), at::kLong);
    }
    diffusion::FlowMatchingOptions fast;
    fast.flux_fast_schedule = true;
    const at::Tensor s = diffusion::sample_flow_sigmas_on(meta, 4, fast, std::vector<int64_t>{4, 16, 8, 8});
    EXPECT_TRUE(s.is_meta());
    EXPECT_EQ(s.scalar_type(), at::kFloat);
    // Diff2Flow's conversion from device timesteps (epsilon and v).
    for (const auto p : {diffusion::PredictionType::kEpsilon, diffusion::PredictionType::kVPrediction}) {
        const at::Tensor x = at::empty({2, 4, 8, 8}, at::TensorOptions().device(meta));
        const at::Tensor t = at::empty({2}, at::TensorOptions().device(meta).dtype(at::kLong));
        const at::Tensor flow = diffusion::diff2flow_prediction(x, x, t, p, testutil::tiny_schedule());
        EXPECT_TRUE(flow.is_meta());
        EXPECT_EQ(flow.sizes(), x.sizes());
    }
}

TEST(TimestepBiasDraws, StepDrawsBiasedTimestepsFromTheDeviceGenerator) {
    const TrainBatch batch = testutil::tiny_batch(4);
    auto model = testutil::sdxl_model(testutil::tiny_unet());
    const diffusion::NoiseSchedule schedule = testutil::tiny_schedule();
    const int64_t t_count = schedule.num_train_timesteps();
    StepOptions options;
    options.device_rng = true;
    options.timesteps = bias(TimestepBiasStrategy::kLater, 1e6);  // the last quarter, in practice only
    at::Generator gen = at::detail::createCPUGenerator(99);
    const at::Tensor gen_state = gen.get_state();
    at::manual_seed(11);
    const MicroStep a = micro_step(*model, batch, schedule, options, 0, gen);
    EXPECT_TRUE(at::equal(gen.get_state(), gen_state)) << "device_rng drew from the generator passed in";
    // The documented order: the noise, then the timesteps, from the default generator.
    at::manual_seed(11);
    at::randn(batch.latents.sizes(), at::kFloat);
    const at::Tensor t =
        diffusion::draw_timesteps(4, t_count, options.timesteps, std::nullopt, c10::Device(c10::kCPU));
    EXPECT_TRUE(at::equal(a.timesteps, t));
    // Segmented and biased: the top sample in the top segment's biased part, and each sample in its own.
    const int64_t quarter = t_count - t_count / 4;
    EXPECT_GE(a.timesteps[0].item<int64_t>(), quarter);
    for (int64_t i = 1; i < 4; ++i)
        EXPECT_LE(a.timesteps[i].item<int64_t>(), a.timesteps[i - 1].item<int64_t>());

    // Data parallelism: rank 1 of 2 with two rows each keeps rows 2 and 3 of the global draw.
    StepOptions rank1 = options;
    rank1.rank = 1;
    rank1.world_size = 2;
    const TrainBatch half = testutil::batch_rows(batch, 2, 2);
    at::manual_seed(11);
    const MicroStep r = micro_step(*model, half, schedule, rank1, 0, gen);
    EXPECT_TRUE(at::equal(r.timesteps, a.timesteps.narrow(0, 2, 2)));

    // Diff2Flow with device draws: the flow loss on the drawn noise and timesteps.
    StepOptions d2f;
    d2f.device_rng = true;
    d2f.diff2flow_loss = true;
    at::manual_seed(12);
    const MicroStep m = micro_step(*model, batch, schedule, d2f, 0, gen);
    at::manual_seed(12);
    const at::Tensor noise = at::randn(batch.latents.sizes(), at::kFloat);
    const at::Tensor ts = at::randint(0, t_count, {4}, at::kLong);
    EXPECT_TRUE(at::equal(m.timesteps, ts));
    const at::Tensor x0 = batch.latents.to(at::kFloat);
    const at::Tensor noisy = schedule.add_noise(x0, noise, ts);
    at::Tensor pred;
    {
        at::NoGradGuard no_grad;
        pred = model->forward(noisy, ts, batch.cond);
    }
    const double expected =
        (diffusion::diff2flow_prediction(pred, noisy, ts, diffusion::PredictionType::kEpsilon, schedule) -
         (noise - x0))
            .pow(2)
            .mean()
            .item<double>();
    EXPECT_NEAR(m.loss.item<double>(), expected, 1e-5 * std::abs(expected));
}

io::TensorList run_trainer(const std::filesystem::path& out, int64_t steps, const nlohmann::json& extra,
                           TrainResult* result = nullptr) {
    Trainer trainer(testutil::tiny_config(out, steps, extra), testutil::sdxl_model(testutil::tiny_unet()),
                    testutil::tiny_schedule(), testutil::synthetic());
    const TrainResult r = trainer.run();
    if (result) *result = r;
    return models::state_dict(*testutil::unet_of(trainer));
}

// The eager trainer (CPU generator) with a timestep bias: 4 steps straight equal 2 steps, a resume
// and 2 more, bit for bit.
TEST(TimestepBiasDraws, EagerRunWithABiasResumesExactly) {
    const nlohmann::json keys{{"timestep_bias_strategy", "range"},
                              {"timestep_bias_begin", 100},
                              {"timestep_bias_end", 400},
                              {"timestep_bias_multiplier", 4.0},
                              {"checkpoint_step_interval", 2}};
    test::TempDir straight, split;
    nlohmann::json fresh = keys;
    fresh["resume_from_checkpoint"] = "none";
    const io::TensorList a = run_trainer(straight.path(), 4, fresh);
    TrainResult second;
    run_trainer(split.path(), 2, keys);
    const io::TensorList b = run_trainer(split.path(), 4, keys, &second);
    ASSERT_TRUE(second.resumed_from.has_value());
    EXPECT_EQ(second.resumed_from->filename(), "checkpoint-2");
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
}

// ---- flow matching: Beta and the fast list -------------------------------------------------------

TEST(FlowScheduleDraws, BetaOnTheDeviceHasBetasMomentsAndIsTheEagerFormula) {
    constexpr int64_t kDraws = 200000;
    const std::vector<int64_t> shape{1, 16, 8, 8};
    for (const auto& [a, b] : std::vector<std::pair<double, double>>{{2.0, 2.0}, {0.5, 3.0}, {3.0, 1.5}}) {
        SCOPED_TRACE(std::to_string(a) + ", " + std::to_string(b));
        diffusion::FlowMatchingOptions o;
        o.beta = true;
        o.beta_alpha = a;
        o.beta_beta = b;
        o.shift = 0.0;  // unshifted: the distribution itself
        at::manual_seed(8);
        const at::Tensor s = diffusion::sample_flow_sigmas_on(c10::Device(c10::kCPU), kDraws, o, shape);
        ASSERT_EQ(s.scalar_type(), at::kFloat);
        const double mean = a / (a + b), var = a * b / ((a + b) * (a + b) * (a + b + 1));
        // Standard errors: mean <= 0.0007, variance <= 0.0003; swapping a and b moves the mean by >= 0.33.
        EXPECT_NEAR(s.mean().item<double>(), mean, 0.004);
        EXPECT_NEAR(s.to(at::kDouble).var().item<double>(), var, 0.002);
        EXPECT_GT(s.min().item<double>(), 0.0);
        EXPECT_LT(s.max().item<double>(), 1.0);
        // torch.distributions.Beta(a, b).sample((N,)) from the same seed: Dirichlet over [a, b], first
        // column.
        at::Generator gen = at::detail::createCPUGenerator(8);
        const at::Tensor torch_beta =
            at::_sample_dirichlet(at::tensor({a, b}, at::kFloat).expand({kDraws, 2}), gen).select(1, 0);
        EXPECT_TRUE(at::equal(s, torch_beta));
    }
}

TEST(FlowScheduleDraws, FastListOnTheDeviceIsSimpleTunersListAndTheEagerFormula) {
    constexpr int64_t kDraws = 100000;
    diffusion::FlowMatchingOptions o;
    o.flux_fast_schedule = true;
    o.shift = 3.0;  // never applied to the fast list
    at::manual_seed(9);
    const at::Tensor s = diffusion::sample_flow_sigmas_on(c10::Device(c10::kCPU), kDraws, o, {1, 16, 64, 64});
    ASSERT_EQ(s.scalar_type(), at::kFloat);
    double seen = 0;
    for (const auto& [value, share] :
         std::vector<std::pair<double, double>>{{1.0, 0.7}, {0.75, 0.1}, {0.5, 0.1}, {0.25, 0.1}}) {
        const double got = s.eq(value).to(at::kDouble).mean().item<double>();
        seen += got;
        EXPECT_NEAR(got, share, 0.006) << "sigma " << value;  // binomial sd <= 0.0015
    }
    EXPECT_NEAR(seen, 1.0, 1e-12) << "a sigma outside SimpleTuner's list";
    // The table lookup the eager path made before, from the same seed: the same sigmas.
    at::manual_seed(9);
    const at::Tensor table = at::tensor({1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.75f, 0.5f, 0.25f});
    EXPECT_TRUE(at::equal(s, table.index_select(0, at::randint(0, 10, {kDraws}, at::kLong))));
}

}  // namespace
}  // namespace test_graphed_draws_local
}  // namespace dtune::train
