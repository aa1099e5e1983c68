// Flow matching with StepOptions::device_rng (what a CUDA graph captures), run on the CPU, where the
// "device" generator is the CPU's default one: the device draws of sigmas and embedded guidance have
// the host path's distributions (the same numbers from the same seed), the step is deterministic
// under a fixed manual_seed, draws in its documented order (noise, sigmas, guidance) for the global
// batch, never touches the generator it is passed, and its loss is the flow-matching formula on the
// tensors it drew. Beta and the fast list are drawn on the device too (their distributions:
// tests/train/test_graphed_draws.cpp). Also cuda_graph_blocker's flow-matching cases (every sigma
// schedule is graphed) and cuda_graph_fallback's auto-versus-true rule, for a CUDA device value (no
// CUDA needed).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>

#include "core/error.h"
#include "diffusion/training_sampling.h"
#include "family/flux/flux_family.h"
#include "support/test_support.h"
#include "train/step.h"
#include "train/trainer_graph.h"
#include "trainer_test_util.h"

namespace dtune::train {
namespace test_flow_device_draws_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

namespace stdfs = std::filesystem;

const stdfs::path kRef = stdfs::path(DTUNE_TEST_DATA_DIR) / "ref";
constexpr int64_t kDraws = 200000;  // standard error of a mean ~0.002 per unit of spread

diffusion::FlowMatchingOptions flow_options(const nlohmann::json& keys) {
    diffusion::FlowMatchingOptions o;
    o.shift = keys.value("shift", 0.0);
    o.auto_shift = keys.value("auto_shift", false);
    o.sigmoid_scale = keys.value("scale", 1.0);
    o.uniform = keys.value("uniform", false);
    o.beta = keys.value("beta", false);
    o.flux_fast_schedule = keys.value("fast", false);
    return o;
}

// SD3's shift inverted: u = sigma / (shift - (shift - 1) sigma).
at::Tensor unshift(const at::Tensor& sigmas, double shift) {
    return sigmas / (shift - (shift - 1) * sigmas);
}

TEST(FlowDeviceDraws, SigmasMatchTheHostDrawsAndTheirDistribution) {
    const std::vector<int64_t> shape{1, 16, 64, 64};  // auto shift: 1024 tokens
    const std::vector<nlohmann::json> cases = {{{"scale", 1.5}},
                                               {{"shift", 3.0}},
                                               {{"auto_shift", true}, {"shift", 3.0}},
                                               {{"uniform", true}},
                                               {{"uniform", true}, {"beta", true}, {"fast", true}}};
    for (const auto& keys : cases) {
        const diffusion::FlowMatchingOptions o = flow_options(keys);
        at::manual_seed(21);
        const at::Tensor device = diffusion::sample_flow_sigmas_on(c10::Device(c10::kCPU), kDraws, o, shape);
        at::Generator gen = at::detail::createCPUGenerator(21);
        const at::Tensor host = diffusion::sample_flow_sigmas(kDraws, o, shape, gen);
        // Same generator kind and seed: the device variant shares the host path's formulas exactly.
        EXPECT_TRUE(at::equal(device, host)) << keys.dump();
        ASSERT_EQ(device.scalar_type(), at::kFloat);
        ASSERT_EQ(device.size(0), kDraws);
        EXPECT_GE(device.min().item<double>(), 0.0) << keys.dump();
        EXPECT_LE(device.max().item<double>(), 1.0) << keys.dump();
        const std::optional<double> shift = diffusion::flow_shift_for(o, shape);
        const at::Tensor u = shift ? unshift(device.to(at::kDouble), *shift) : device.to(at::kDouble);
        if (o.uniform) {
            EXPECT_FALSE(shift.has_value()) << keys.dump();
            EXPECT_NEAR(u.mean().item<double>(), 0.5, 0.01) << keys.dump();
            EXPECT_NEAR(u.var().item<double>(), 1.0 / 12.0, 0.002) << keys.dump();
            continue;
        }
        const at::Tensor z = at::logit(u.clamp(1e-12, 1 - 1e-12));  // scale * N(0, 1)
        EXPECT_NEAR(z.mean().item<double>(), 0.0, 0.02) << keys.dump();
        EXPECT_NEAR(z.std().item<double>(), o.sigmoid_scale, 0.02 * o.sigmoid_scale) << keys.dump();
        if (shift) {  // the shift moves the sigmas toward noise: the unshifted logits would be off-centre
            EXPECT_GT(*shift, 1.0) << keys.dump();
            EXPECT_GT(at::logit(device.to(at::kDouble)).mean().item<double>(), 0.3) << keys.dump();
        }
    }
    EXPECT_NEAR(*diffusion::flow_shift_for(flow_options({{"auto_shift", true}}), shape),
                std::exp(1024 * (0.65 / 3840) + 0.5 - (0.65 / 3840) * 256), 1e-9);
    // Beta and the fast list: the device variant is the host path's formula too.
    for (const auto& keys :
         {nlohmann::json{{"beta", true}, {"shift", 3.0}}, nlohmann::json{{"fast", true}}}) {
        const diffusion::FlowMatchingOptions o = flow_options(keys);
        at::manual_seed(22);
        const at::Tensor device = diffusion::sample_flow_sigmas_on(c10::Device(c10::kCPU), 4096, o, shape);
        at::Generator gen = at::detail::createCPUGenerator(22);
        EXPECT_TRUE(at::equal(device, diffusion::sample_flow_sigmas(4096, o, shape, gen))) << keys.dump();
    }
}

TEST(FlowDeviceDraws, GuidanceMatchesTheHostDrawsAndStaysInRange) {
    diffusion::EmbeddedGuidanceOptions g;
    g.mode = diffusion::EmbeddedGuidanceOptions::Mode::kRandomRange;
    g.min = 1.5;
    g.max = 4.5;
    at::manual_seed(3);
    const at::Tensor device = diffusion::sample_embedded_guidance_on(c10::Device(c10::kCPU), kDraws, g);
    at::Generator gen = at::detail::createCPUGenerator(3);
    EXPECT_TRUE(at::equal(device, diffusion::sample_embedded_guidance(kDraws, g, gen)));
    ASSERT_EQ(device.scalar_type(), at::kFloat);
    EXPECT_GE(device.min().item<double>(), 1.5);
    EXPECT_LE(device.max().item<double>(), 4.5);
    EXPECT_LT(device.min().item<double>(), 1.51);  // the whole range is used
    EXPECT_GT(device.max().item<double>(), 4.49);
    EXPECT_NEAR(device.mean().item<double>(), 3.0, 0.01);
    g.mode = diffusion::EmbeddedGuidanceOptions::Mode::kConstant;
    g.value = 3.5;
    const at::Tensor constant = diffusion::sample_embedded_guidance_on(c10::Device(c10::kCPU), 5, g);
    EXPECT_TRUE(at::equal(constant, at::full({5}, 3.5, at::kFloat)));
}

// The tiny Flux.1 [dev] transformer and a batch of 2 in its shapes (4 latent channels, 2x2 packed).
struct FluxStep {
    std::unique_ptr<family::Denoiser> model =
        family::flux_family().load_denoiser(kRef / "tiny-flux-dev", {at::kFloat, c10::Device(c10::kCPU)});
    family::TrainingObjective objective = family::flux_family().training_objective(kRef / "tiny-flux-dev");
    TrainBatch batch;
    FluxStep() {
        at::Generator gen = at::detail::createCPUGenerator(5);
        batch.latents = at::randn({2, 4, 6, 8}, gen, at::kFloat);              // [B, C, h, w]
        batch.cond["prompt_embeds"] = at::randn({2, 7, 24}, gen, at::kFloat);  // [B, L, 24]
        batch.cond["pooled_prompt_embeds"] = at::randn({2, 12}, gen, at::kFloat);
        batch.cond["attention_mask"] = at::ones({2, 7}, at::kLong);
        objective.flow.shift = 3.0;
        objective.flow.sigmoid_scale = 1.3;
        diffusion::EmbeddedGuidanceOptions g;
        g.mode = diffusion::EmbeddedGuidanceOptions::Mode::kRandomRange;
        g.min = 1.0;
        g.max = 4.0;
        objective.flow.guidance = g;
    }
    MicroStep run(uint64_t seed, const StepOptions& options, at::Generator& gen, const TrainBatch& b) {
        at::manual_seed(seed);
        return micro_step(*model, b, objective, options, 0, gen, {});
    }
};

TEST(FlowDeviceDraws, StepIsDeterministicDrawsInOrderAndTrainsOnItsDraws) {
    FluxStep f;
    StepOptions options;
    options.device_rng = true;
    at::Generator gen = at::detail::createCPUGenerator(99);
    const at::Tensor gen_state = gen.get_state();
    const MicroStep a = f.run(7, options, gen, f.batch);
    const MicroStep again = f.run(7, options, gen, f.batch);
    const MicroStep other = f.run(8, options, gen, f.batch);
    EXPECT_TRUE(at::equal(gen.get_state(), gen_state)) << "device_rng drew from the generator passed in";
    ASSERT_TRUE(a.noise.defined() && a.sigmas.defined() && a.guidance.defined());
    EXPECT_EQ(a.loss.item<double>(), again.loss.item<double>());
    EXPECT_TRUE(at::equal(a.noise, again.noise));
    EXPECT_TRUE(at::equal(a.sigmas, again.sigmas));
    EXPECT_TRUE(at::equal(a.guidance, again.guidance));
    EXPECT_FALSE(at::equal(a.noise, other.noise));
    EXPECT_NE(a.loss.item<double>(), other.loss.item<double>());

    // The documented order: noise, sigmas, guidance, from the default generator.
    at::manual_seed(7);
    const at::Tensor noise = at::randn({2, 4, 6, 8}, at::kFloat);
    const at::Tensor sigmas = diffusion::sample_flow_sigmas_on(c10::Device(c10::kCPU), 2, f.objective.flow,
                                                               f.batch.latents.sizes());
    const at::Tensor guidance =
        diffusion::sample_embedded_guidance_on(c10::Device(c10::kCPU), 2, *f.objective.flow.guidance);
    EXPECT_TRUE(at::equal(a.noise, noise));
    EXPECT_TRUE(at::equal(a.sigmas, sigmas));
    EXPECT_TRUE(at::equal(a.guidance, guidance));
    EXPECT_TRUE(at::allclose(a.timesteps, sigmas * 1000));
    EXPECT_GE(a.guidance.min().item<double>(), 1.0);
    EXPECT_LE(a.guidance.max().item<double>(), 4.0);

    // The loss by hand on the drawn values: noisy = (1 - s) x0 + s noise, target noise - x0.
    const at::Tensor x0 = f.batch.latents, s = sigmas.view({2, 1, 1, 1});
    const at::Tensor noisy = (1 - s) * x0 + s * noise;
    family::Conditioning cond = f.batch.cond;
    cond["guidance"] = guidance;
    at::Tensor pred;
    {
        c10::NoGradGuard no_grad;
        pred = f.model->forward(noisy, sigmas * 1000, cond);
    }
    const double expected = (pred - (noise - x0)).pow(2).mean().item<double>();
    EXPECT_TRUE(at::allclose(a.target, noise - x0));
    EXPECT_NEAR(a.loss.item<double>(), expected, 1e-6 * std::abs(expected));

    // Data parallelism: rank 1 of 2 with one row each draws for the global batch of 2 and keeps row 1.
    StepOptions rank1 = options;
    rank1.rank = 1;
    rank1.world_size = 2;
    TrainBatch row1;
    row1.latents = f.batch.latents.narrow(0, 1, 1);
    for (const auto& [name, t] : f.batch.cond) row1.cond[name] = t.narrow(0, 1, 1);
    const MicroStep r = f.run(7, rank1, gen, row1);
    EXPECT_TRUE(at::equal(r.noise, a.noise.narrow(0, 1, 1)));
    EXPECT_TRUE(at::equal(r.sigmas, a.sigmas.narrow(0, 1, 1)));
    EXPECT_TRUE(at::equal(r.guidance, a.guidance.narrow(0, 1, 1)));

    // A batch's own guidance wins and nothing is drawn for it.
    TrainBatch guided = f.batch;
    guided.cond["guidance"] = at::full({2}, 2.5, at::kFloat);
    const MicroStep own = f.run(7, options, gen, guided);
    EXPECT_FALSE(own.guidance.defined());
    EXPECT_TRUE(at::equal(own.sigmas, a.sigmas));

    // The test hook replaces host draws only.
    StepOptions fixed = options;
    fixed.fixed_flow_draws = [](int64_t, const at::Tensor& l) { return FlowDraws{at::zeros_like(l), {}}; };
    EXPECT_THROW(f.run(7, fixed, gen, f.batch), Error);
    // Beta sigmas are drawn on the device too, after the same noise (cuda_graph_blocker graphs them).
    f.objective.flow.beta = true;
    const MicroStep beta = f.run(7, options, gen, f.batch);
    at::manual_seed(7);
    at::randn({2, 4, 6, 8}, at::kFloat);
    const at::Tensor beta_sigmas = diffusion::sample_flow_sigmas_on(
        c10::Device(c10::kCPU), 2, f.objective.flow, f.batch.latents.sizes());
    EXPECT_TRUE(at::equal(beta.noise, a.noise));
    EXPECT_TRUE(at::equal(beta.sigmas, beta_sigmas));
    EXPECT_FALSE(at::equal(beta.sigmas, a.sigmas));
    EXPECT_TRUE(at::equal(gen.get_state(), gen_state)) << "device_rng drew from the generator passed in";
}

TEST(FlowDeviceDraws, HostPathIsUnchangedByTheNewFields) {
    FluxStep f;
    StepOptions options;  // CPU generator draws, as every eager run
    at::Generator gen = at::detail::createCPUGenerator(4);
    const MicroStep m = micro_step(*f.model, f.batch, f.objective, options, 0, gen, {});
    at::Generator ref = at::detail::createCPUGenerator(4);
    const at::Tensor noise = at::randn({2, 4, 6, 8}, ref, at::kFloat);
    const at::Tensor sigmas =
        diffusion::sample_flow_sigmas(2, f.objective.flow, f.batch.latents.sizes(), ref);
    const at::Tensor guidance = diffusion::sample_embedded_guidance(2, *f.objective.flow.guidance, ref);
    EXPECT_TRUE(at::equal(m.noise, noise));
    EXPECT_TRUE(at::equal(m.sigmas, sigmas));
    EXPECT_TRUE(at::equal(m.guidance, guidance));
    EXPECT_TRUE(at::equal(m.timesteps, sigmas * 1000.0));
}

// cuda_graph_blocker and cuda_graph_fallback on a Flux run's config: every sigma schedule is graphed.
TrainConfig flux_config(const stdfs::path& out, const nlohmann::json& extra) {
    TrainConfig c;
    c.merge_json(nlohmann::json{{"model_family", "flux"},
                                {"output_dir", out.string()},
                                {"model_type", "lora"},
                                {"optimizer", "torch-adamw"},
                                {"mixed_precision", "bf16"},
                                {"deterministic", false},
                                {"lora_dropout", 0.0}},
                 "test");
    c.merge_json(extra, "test extra");
    c.validate();
    return c;
}

TEST(CudaGraphFlow, BlockersAndAutoGraphsFlowMatching) {
    test::TempDir dir;
    const c10::Device cuda(c10::kCUDA, 0);  // a Device value only: no CUDA needed
    const auto flux_model = family::flux_family().load_denoiser(kRef / "tiny-flux-dev", {});
    const auto objective_for = [&](const TrainConfig& c) {
        family::TrainingObjective o = family::flux_family().training_objective(kRef / "tiny-flux-pipeline");
        family::flux_family().apply_training_config(c, *flux_model, o);
        return o;
    };
    const TrainConfig on = flux_config(dir.path(), {{"cuda_graph", true}});
    const TrainConfig automatic = flux_config(dir.path(), {{"cuda_graph", "auto"}});
    const family::TrainingObjective flow = objective_for(on);
    EXPECT_EQ(cuda_graph_blocker(on, cuda, 1, 0, &flow), "");
    EXPECT_EQ(cuda_graph_fallback(on, flow, cuda, 1), "");         // cuda_graph true: graphed
    EXPECT_EQ(cuda_graph_fallback(automatic, flow, cuda, 1), "");  // auto: graphed as DDPM is
    EXPECT_EQ(cuda_graph_fallback(flux_config(dir.path(), {{"cuda_graph", false}}), flow, cuda, 1),
              "cuda_graph is false");
    EXPECT_EQ(cuda_graph_fallback(on, flow, c10::Device(c10::kCPU), 1).rfind("device is cpu", 0), 0u);
    // A DDPM run left at auto is graphed, as before.
    const TrainConfig sdxl = testutil::tiny_config(dir.path(), 2,
                                                   {{"deterministic", false},
                                                    {"model_type", "lora"},
                                                    {"mixed_precision", "bf16"},
                                                    {"cuda_graph", "auto"}});
    EXPECT_EQ(cuda_graph_fallback(sdxl, testutil::tiny_schedule(), cuda, 1), "");

    const std::vector<std::pair<nlohmann::json, std::string>> cases = {
        {{{"flow_use_beta_schedule", true}}, ""},
        {{{"flow_use_beta_schedule", true}, {"flow_beta_schedule_alpha", 0.5}}, ""},
        {{{"flux_fast_schedule", true}}, ""},
        {{{"flow_use_beta_schedule", true}, {"flux_fast_schedule", true}}, ""},
        {{{"offload_optimizer_device", "cpu"}},
         "offload_optimizer_device is cpu"},  // a blocker still reaches flow runs
        {{{"flow_use_uniform_schedule", true}, {"flow_use_beta_schedule", true}}, ""},  // uniform wins
        {{{"flow_use_uniform_schedule", true}, {"flow_schedule_auto_shift", true}}, ""},
        {{{"flux_guidance_mode", "random-range"}}, ""},
    };
    for (auto [extra, expected] : cases) {
        extra["cuda_graph"] = "auto";
        const TrainConfig c = flux_config(dir.path(), extra);
        const family::TrainingObjective o = objective_for(c);
        const std::string blocker = cuda_graph_blocker(c, cuda, 1, 0, &o);
        const std::string fallback = cuda_graph_fallback(c, o, cuda, 1);
        if (expected.empty()) {
            EXPECT_EQ(blocker, "") << extra.dump();
            // Graphed under auto, Beta sigmas included (their capture passed on an H200).
            EXPECT_EQ(fallback, "") << extra.dump();
        } else {
            EXPECT_EQ(blocker.rfind(expected, 0), 0u) << extra.dump() << " gave: " << blocker;
            EXPECT_NE(blocker.find("trains without CUDA graphs"), std::string::npos) << blocker;
            EXPECT_EQ(fallback, blocker) << extra.dump();
        }
    }
    // fp16 with adamw_bf16 is graphed under auto (CudaGraphFp16Gpu/AdamWBF16Full passed on an H200).
    {
        const nlohmann::json extra{
            {"mixed_precision", "fp16"}, {"optimizer", "adamw_bf16"}, {"cuda_graph", "auto"}};
        const TrainConfig c = flux_config(dir.path(), extra);
        const family::TrainingObjective o = objective_for(c);
        EXPECT_EQ(cuda_graph_blocker(c, cuda, 1, 0, &o), "");
        EXPECT_EQ(cuda_graph_fallback(c, o, cuda, 1), "");
    }
    // Without the objective the same keys block nothing either.
    EXPECT_EQ(cuda_graph_blocker(flux_config(dir.path(), {{"flux_fast_schedule", true}}), cuda, 1), "");
}

}  // namespace
}  // namespace test_flow_device_draws_local
}  // namespace dtune::train
