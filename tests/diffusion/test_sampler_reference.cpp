// Parity with diffusers for what the shared fixtures do not cover: other beta schedules and the
// zero-SNR rescale, Euler trailing/linspace/Karras, Euler-ancestral, DDIM (eta, clipping, v), DPM++ 2M
// (spacings, Karras, Heun), UniPC (bh1/bh2, Karras) and the CFG rescale. The reference values come from
// tools/ref/gen_diffusion_ref.py (diffusers, float32, CPU), committed under tests/data/ref.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "diffusion/ddim.h"
#include "diffusion/guidance.h"
#include "diffusion/noise_schedule.h"
#include "diffusion/sampler.h"
#include "io/safetensors.h"

namespace dtune::diffusion {
namespace test_sampler_reference_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

constexpr double kTol = 1e-5;

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
    return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

class SamplerReference : public ::testing::Test {
  protected:
    static void SetUpTestSuite() {
        const std::filesystem::path dir = std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref";
        file_ = new io::SafetensorsFile(dir / "diffusion_ref.safetensors");
        json_ = new nlohmann::json(read_scheduler_config(dir / "diffusion_ref.json"));
    }
    static void TearDownTestSuite() {
        delete file_;
        delete json_;
    }
    // max |a - b| / max(1, |b|), elementwise.
    static double max_rel_diff(const at::Tensor& a, const at::Tensor& b) {
        const at::Tensor bd = b.to(at::kDouble);
        return ((a.to(at::kDouble) - bd).abs() / bd.abs().clamp_min(1.0)).max().item<double>();
    }
    static at::Tensor get(const std::string& key) { return file_->get(key).clone(); }
    static const nlohmann::json& config(const std::string& name) { return json_->at("cases").at(name); }

    // Builds the sampler of case `name` and checks its tables against diffusers'.
    static std::unique_ptr<Sampler> check_tables(const std::string& name, int64_t steps) {
        SCOPED_TRACE(name);
        auto s = make_sampler(config(name), "", name);
        s->set_timesteps(steps);
        const at::Tensor t = get(name + ".timesteps");
        EXPECT_EQ(s->timesteps().scalar_type(), t.scalar_type());
        // Integer timesteps must match exactly; interpolated (float) ones and sigmas to kTol relative
        // to max(1, |value|): zero-terminal-SNR sigmas reach 4096, where float32 steps are 2.4e-4, and
        // torch builds differ in the last bit there (seen between torch 2.11 CUDA and 2.13 CPU).
        if (t.is_floating_point()) {
            EXPECT_LE(max_rel_diff(s->timesteps(), t), kTol)
                << "dtune " << s->timesteps() << "\ndiffusers " << t;
        } else {
            EXPECT_TRUE(at::equal(s->timesteps(), t)) << "dtune " << s->timesteps() << "\ndiffusers " << t;
        }
        if (file_->contains(name + ".sigmas")) {
            EXPECT_LE(max_rel_diff(s->sigmas(), get(name + ".sigmas")), kTol)
                << "dtune " << s->sigmas() << "\ndiffusers " << get(name + ".sigmas");
        }
        if (file_->contains(name + ".init_noise_sigma")) {
            const double want = get(name + ".init_noise_sigma").item<double>();
            EXPECT_NEAR(s->init_noise_sigma(), want, kTol * std::max(1.0, std::abs(want)));
        }
        return s;
    }

    // Runs the case's whole sampling loop with the recorded model outputs.
    static void check_loop(const std::string& name) {
        SCOPED_TRACE(name);
        const auto& cfg = config(name);
        const int64_t steps = cfg.at("_steps").get<int64_t>();
        auto s = check_tables(name, steps);
        if (cfg.at("_step_kwargs").contains("eta")) {
            dynamic_cast<DDIMSampler&>(*s).set_eta(cfg.at("_step_kwargs").at("eta").get<double>());
        }
        std::optional<at::Generator> gen;
        if (!cfg.at("_seed").is_null()) {
            gen = at::make_generator<at::CPUGeneratorImpl>(cfg.at("_seed").get<uint64_t>());
        }
        at::Tensor x = get(name + ".x0");
        const at::Tensor outs = get(name + ".model_outputs");
        at::Tensor last_scaled;
        for (int64_t i = 0; i < s->num_steps(); ++i) {
            last_scaled = s->scale_model_input(x, i);
            x = s->step(outs[i], i, x, gen);
        }
        // Relative to the values' scale: the loops start from noise of std ~15.
        const at::Tensor scaled = get(name + ".scaled_input_last");
        EXPECT_LE(max_abs_diff(last_scaled, scaled) / std::max(1.0, scaled.abs().max().item<double>()), kTol);
        const at::Tensor expected = get(name + ".final");
        const double scale = std::max(1.0, expected.abs().max().item<double>());
        EXPECT_LE(max_abs_diff(x, expected) / scale, kTol) << "dtune " << x << "\ndiffusers " << expected;
    }

    static io::SafetensorsFile* file_;
    static nlohmann::json* json_;
};

io::SafetensorsFile* SamplerReference::file_ = nullptr;
nlohmann::json* SamplerReference::json_ = nullptr;

TEST_F(SamplerReference, DDPMBetaSchedulesAndZeroSNR) {
    for (const std::string name : {"ddpm_linear", "ddpm_cos", "ddpm_zsnr"}) {
        SCOPED_TRACE(name);
        const NoiseSchedule s(NoiseScheduleConfig::from_json(config(name), name));
        const at::Tensor idx = get(name + ".index");
        EXPECT_LE(max_abs_diff(s.alphas_cumprod().index_select(0, idx), get(name + ".alphas_cumprod")), kTol);
    }
    // Zero terminal SNR: the last alphas_cumprod is exactly 0.
    const NoiseSchedule z(NoiseScheduleConfig::from_json(config("ddpm_zsnr"), "ddpm_zsnr"));
    EXPECT_EQ(z.alphas_cumprod()[-1].item<float>(), 0.0f);
}

TEST_F(SamplerReference, EulerSpacingsKarrasAndZeroSNR) {
    check_tables("euler_trailing30", 30);
    check_tables("euler_linspace25", 25);
    check_tables("euler_karras20", 20);
    check_tables("euler_zsnr_trailing12", 12);
}

TEST_F(SamplerReference, EulerAncestralTables) {
    check_tables("eulera_trailing10", 10);
    check_tables("eulera_leading7", 7);
}

TEST_F(SamplerReference, DDIMSpacings) {
    check_tables("ddim_trailing10", 10);
    check_tables("ddim_linspace9", 9);
    check_tables("ddim_cos_leading8", 8);
}

TEST_F(SamplerReference, DPMSolverSpacingsAndKarras) {
    check_tables("dpm_linspace10", 10);
    check_tables("dpm_leading20", 20);
    check_tables("dpm_trailing16", 16);
    check_tables("dpm_karras25", 25);
}

TEST_F(SamplerReference, UniPCSpacingsAndKarras) {
    check_tables("unipc_linspace10", 10);
    check_tables("unipc_trailing12", 12);
    check_tables("unipc_karras15", 15);
}

TEST_F(SamplerReference, EulerLoopVPrediction) {
    check_loop("loop_euler_v");
}
TEST_F(SamplerReference, EulerAncestralLoopWithSeededNoise) {
    check_loop("loop_eulera");
}
TEST_F(SamplerReference, EulerAncestralLoopVPrediction) {
    check_loop("loop_eulera_v");
}
TEST_F(SamplerReference, DDIMLoop) {
    check_loop("loop_ddim");
}
TEST_F(SamplerReference, DDIMLoopVPredictionZeroSNR) {
    check_loop("loop_ddim_v_trailing");
}
TEST_F(SamplerReference, DDIMLoopWithEta) {
    check_loop("loop_ddim_eta");
}
TEST_F(SamplerReference, DDIMLoopWithClipSample) {
    check_loop("loop_ddim_clip");
}
TEST_F(SamplerReference, DPMSolver2MLoop) {
    check_loop("loop_dpm");
}
TEST_F(SamplerReference, DPMSolver2MKarrasLoop) {
    check_loop("loop_dpm_karras");
}
TEST_F(SamplerReference, DPMSolver2MHeunVPredictionLoop) {
    check_loop("loop_dpm_v_heun");
}

TEST_F(SamplerReference, UniPCLoop) {
    check_loop("loop_unipc");
}
TEST_F(SamplerReference, UniPCBh1VPredictionLoop) {
    check_loop("loop_unipc_v_bh1");
}
TEST_F(SamplerReference, UniPCKarrasLoop) {
    check_loop("loop_unipc_karras");
}

TEST_F(SamplerReference, GuidanceRescaleMatchesDiffusers) {
    const at::Tensor cond = get("cfg.cond");
    const at::Tensor uncond = get("cfg.uncond");
    EXPECT_LE(max_abs_diff(classifier_free_guidance(uncond, cond, 6.0), get("cfg.guided_6")), kTol);
    EXPECT_LE(max_abs_diff(classifier_free_guidance(uncond, cond, 6.0, 0.7), get("cfg.rescaled_6_0p7")),
              kTol);
}

}  // namespace
}  // namespace test_sampler_reference_local
}  // namespace dtune::diffusion
