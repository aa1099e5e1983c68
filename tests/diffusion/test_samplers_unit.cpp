// Sampler behaviour that needs no reference file: an oracle model (one that knows the true noise)
// must be led back to the clean sample by every deterministic sampler; seeds repeat; CFG at scale 1
// is the conditional prediction; config errors name the key; SDXL time ids.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "diffusion/ddim.h"
#include "diffusion/guidance.h"
#include "diffusion/sampler.h"

namespace dtune::diffusion {
namespace test_samplers_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

at::Generator seeded(uint64_t seed) {
    return at::make_generator<at::CPUGeneratorImpl>(seed);
}

nlohmann::json sdxl_config(const std::string& class_name) {
    return {{"_class_name", class_name}, {"num_train_timesteps", 1000},      {"beta_start", 0.00085},
            {"beta_end", 0.012},         {"beta_schedule", "scaled_linear"}, {"prediction_type", "epsilon"},
            {"steps_offset", 1},         {"timestep_spacing", "leading"},    {"clip_sample", false},
            {"set_alpha_to_one", false}};
}

// A model that returns the exact noise of the current sample, given the clean sample x0 and eps.
// Every deterministic sampler then stays on the schedule: Euler ends at x0 (final sigma 0), DPM++
// and UniPC likewise, DDIM at the "alpha before the first timestep" (alphas_cumprod[0] with set_alpha_to_one
// false). These identities follow from the update formulas alone, not from diffusers.
TEST(Samplers, OracleModelRecoversTheCleanSample) {
    at::Generator g = seeded(21);
    const at::Tensor x0 = at::randn({1, 4, 4, 4}, g) * 0.5;
    const at::Tensor eps = at::randn({1, 4, 4, 4}, g);
    for (const std::string kind : {"euler", "ddim", "dpm++", "unipc"}) {
        for (const std::string spacing : {"leading", "trailing", "linspace"}) {
            SCOPED_TRACE(kind + " " + spacing);
            // diffusers' DDIM steps to t - T / n whatever the spacing, which is the next timestep only
            // for leading spacing (the parity tests pin the other spacings to diffusers).
            if (kind == "ddim" && spacing != "leading") continue;
            nlohmann::json cfg = sdxl_config("EulerDiscreteScheduler");
            cfg["timestep_spacing"] = spacing;
            auto s = make_sampler(cfg, kind);
            s->set_timesteps(12);
            const at::Tensor ac = s->alphas_cumprod().to(at::kDouble);
            at::Tensor x;
            at::Tensor expected = x0;
            if (kind == "euler") {
                x = x0 + s->sigmas()[0].item<double>() * eps;  // Euler's variance-exploding form
            } else {
                const double a = ac[s->timesteps()[0].item<int64_t>()].item<double>();
                x = std::sqrt(a) * x0 + std::sqrt(1 - a) * eps;
                if (kind == "ddim") {
                    const double a_end = ac[0].item<double>();
                    expected = std::sqrt(a_end) * x0 + std::sqrt(1 - a_end) * eps;
                }
            }
            for (int64_t i = 0; i < s->num_steps(); ++i) x = s->step(eps, i, x);
            EXPECT_LE((x - expected).abs().max().item<double>(), 1e-4);
        }
    }
}

// diffusers' bh1 UniPC returns NaN at a final sigma of 0 (B(h) = -inf times a literal 0); the last step
// is first order, with no correction term, so ours must stay finite and land on the oracle's x0.
TEST(Samplers, UniPCBh1EndsFiniteAtSigmaZero) {
    nlohmann::json cfg = sdxl_config("UniPCMultistepScheduler");
    cfg["solver_type"] = "bh1";
    auto s = make_sampler(cfg);
    s->set_timesteps(6);
    at::Generator g = seeded(2);
    const at::Tensor x0 = at::randn({1, 4, 4, 4}, g);
    const at::Tensor eps = at::randn({1, 4, 4, 4}, g);
    const double a = s->alphas_cumprod()[s->timesteps()[0].item<int64_t>()].item<double>();
    at::Tensor x = std::sqrt(a) * x0 + std::sqrt(1 - a) * eps;
    for (int64_t i = 0; i < s->num_steps(); ++i) x = s->step(eps, i, x);
    EXPECT_LE((x - x0).abs().max().item<double>(), 1e-4);
}

TEST(Samplers, SameSeedSameSamples) {
    for (const std::string kind : {"euler-a", "ddim"}) {
        SCOPED_TRACE(kind);
        std::array<at::Tensor, 2> runs;
        for (auto& out : runs) {
            auto s = make_sampler(sdxl_config("EulerDiscreteScheduler"), kind);
            if (kind == "ddim") dynamic_cast<DDIMSampler&>(*s).set_eta(1.0);  // noise from the generator
            s->set_timesteps(5);
            at::Generator g = seeded(1234);
            at::Tensor x = initial_latents({1, 4, 8, 8}, *s, g);
            for (int64_t i = 0; i < s->num_steps(); ++i) x = s->step(at::tanh(x) * 0.3, i, x, g);
            out = x;
        }
        EXPECT_TRUE(at::equal(runs[0], runs[1]));
    }
    // And a different seed gives a different ancestral path.
    auto s = make_sampler(sdxl_config("EulerAncestralDiscreteScheduler"));
    s->set_timesteps(3);
    at::Generator a = seeded(1);
    at::Generator b = seeded(2);
    const at::Tensor x = at::zeros({1, 4, 8, 8});
    EXPECT_FALSE(at::equal(s->step(x, 0, x, a), s->step(x, 0, x, b)));
}

TEST(Samplers, InitialLatentsAreSeededNoiseTimesInitSigma) {
    auto s = make_sampler(sdxl_config("EulerDiscreteScheduler"));
    s->set_timesteps(30);
    at::Generator g = seeded(42);
    at::Generator r = seeded(42);
    const at::Tensor x = initial_latents({1, 4, 8, 8}, *s, g);
    EXPECT_TRUE(at::allclose(x, at::randn({1, 4, 8, 8}, r) * s->init_noise_sigma(), 0, 0));
}

TEST(Samplers, DPMStepsMustRunInOrder) {
    auto s = make_sampler(sdxl_config("DPMSolverMultistepScheduler"));
    s->set_timesteps(4);
    const at::Tensor x = at::zeros({1, 1, 2, 2});
    EXPECT_THROW(s->step(x, 1, x), Error);
    s->step(x, 0, x);
    EXPECT_THROW(s->step(x, 0, x), Error);
    EXPECT_THROW(s->scale_model_input(x, 4), Error);
}

TEST(SchedulerConfigs, DefaultsAndOverridesFollowTheTargetClass) {
    // DDIM built from an Euler config without clip/alpha keys takes DDIM's own defaults.
    nlohmann::json euler = sdxl_config("EulerDiscreteScheduler");
    euler.erase("clip_sample");
    euler.erase("set_alpha_to_one");
    const SchedulerConfig d = SchedulerConfig::from_json(euler, SamplerKind::kDDIM);
    EXPECT_TRUE(d.clip_sample);
    EXPECT_TRUE(d.set_alpha_to_one);
    EXPECT_EQ(d.timestep_spacing, TimestepSpacing::kLeading);
    EXPECT_EQ(d.steps_offset, 1);
    const SchedulerConfig dpm =
        SchedulerConfig::from_json(nlohmann::json::object(), SamplerKind::kDPMSolverMultistep);
    EXPECT_EQ(dpm.timestep_spacing, TimestepSpacing::kLinspace);
    EXPECT_EQ(dpm.schedule.beta_schedule, BetaSchedule::kLinear);
    EXPECT_EQ(dpm.solver_order, 2);
}

TEST(SchedulerConfigs, UnsupportedValuesNameTheKey) {
    nlohmann::json cfg = sdxl_config("DPMSolverMultistepScheduler");
    cfg["algorithm_type"] = "sde-dpmsolver++";
    try {
        make_sampler(cfg, "", "unet/scheduler_config.json");
        FAIL() << "expected a UsageError";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("algorithm_type"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("unet/scheduler_config.json"), std::string::npos) << e.what();
    }
    cfg = sdxl_config("EulerDiscreteScheduler");
    cfg["thresholding"] = true;
    EXPECT_THROW(make_sampler(cfg), UsageError);
    cfg = sdxl_config("EulerDiscreteScheduler");
    cfg["timestep_spacing"] = "even";
    EXPECT_THROW(make_sampler(cfg), UsageError);
    EXPECT_THROW(make_sampler(sdxl_config("HeunDiscreteScheduler")), UsageError);
    EXPECT_THROW(make_sampler(sdxl_config("EulerDiscreteScheduler"), "heun"), UsageError);
    cfg = sdxl_config("EulerDiscreteScheduler");
    cfg["steps_offset"] = "1";
    EXPECT_THROW(make_sampler(cfg), UsageError);
}

TEST(SchedulerConfigs, ParsesPythonJsonInfinity) {
    const auto j =
        parse_python_json(R"({"lambda_min_clipped": -Infinity, "note": "-Infinity \" NaN"})", "t.json");
    const SchedulerConfig c = SchedulerConfig::from_json(j, SamplerKind::kDPMSolverMultistep);
    EXPECT_TRUE(std::isinf(c.lambda_min_clipped) && c.lambda_min_clipped < 0);
    EXPECT_EQ(j.at("note").get<std::string>(), "-Infinity \" NaN");
    EXPECT_THROW(parse_python_json("{", "t.json"), DataError);
}

TEST(Guidance, ScaleOneIsTheConditionalPrediction) {
    at::Generator g = seeded(8);
    const at::Tensor cond = at::randn({2, 4, 4, 4}, g);
    const at::Tensor uncond = at::randn({2, 4, 4, 4}, g);
    EXPECT_FALSE(uses_cfg(1.0));
    EXPECT_TRUE(at::equal(classifier_free_guidance(uncond, cond, 1.0), cond));
    EXPECT_TRUE(at::equal(classifier_free_guidance(uncond, cond, 1.0, 0.7), cond));
    // The formula itself at scale 1 is cond up to rounding.
    EXPECT_TRUE(at::allclose(uncond + 1.0 * (cond - uncond), cond, 0, 1e-6));
    const at::Tensor guided = classifier_free_guidance(uncond, cond, 7.5);
    EXPECT_TRUE(at::allclose(guided, uncond + 7.5 * (cond - uncond), 0, 1e-6));
    // Rescale 1.0 matches the conditional prediction's per-sample std exactly.
    const at::Tensor full = classifier_free_guidance(uncond, cond, 7.5, 1.0);
    EXPECT_TRUE(at::allclose(full.std({1, 2, 3}), cond.std({1, 2, 3}), 1e-5, 1e-6));
}

TEST(Guidance, SdxlTimeIds) {
    const at::Tensor ids = sdxl_time_ids({1024, 768}, {16, 32}, {1024, 1024}, 2);
    ASSERT_EQ(ids.sizes(), (at::IntArrayRef{2, 6}));
    EXPECT_TRUE(at::equal(ids[1], at::tensor({1024.0f, 768.0f, 16.0f, 32.0f, 1024.0f, 1024.0f})));
}

}  // namespace
}  // namespace test_samplers_unit_local
}  // namespace dtune::diffusion
