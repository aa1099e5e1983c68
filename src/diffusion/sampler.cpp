// Sampler base class and factory (see sampler.h).
#include "diffusion/sampler.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "diffusion/ddim.h"
#include "diffusion/dpm_solver.h"
#include "diffusion/euler.h"
#include "diffusion/unipc.h"

namespace dtune::diffusion {

Sampler::Sampler(const SchedulerConfig& config)
    : config_(config), alphas_cumprod_(NoiseSchedule(config.schedule).alphas_cumprod().clone()) {}

void Sampler::check_step(int64_t i) const {
    DTUNE_CHECK(timesteps_.defined(), "call set_timesteps() on the ", name(), " sampler before stepping");
    DTUNE_CHECK(i >= 0 && i < num_steps(), "step index ", i, " is outside the ", num_steps(),
                " steps set by set_timesteps()");
}

at::Tensor Sampler::noise_like(const at::Tensor& like, const std::optional<at::Generator>& generator) {
    if (!generator.has_value()) return at::randn(like.sizes(), like.options().dtype(at::kFloat));
    const at::Device gen_device = generator->device();
    const at::Tensor noise =
        at::randn(like.sizes(), *generator, at::TensorOptions().dtype(at::kFloat).device(gen_device));
    return noise.to(like.device());
}

std::unique_ptr<Sampler> make_sampler(const SchedulerConfig& config) {
    switch (config.kind) {
        case SamplerKind::kEuler: return std::make_unique<EulerSampler>(config, false);
        case SamplerKind::kEulerAncestral: return std::make_unique<EulerSampler>(config, true);
        case SamplerKind::kDDIM: return std::make_unique<DDIMSampler>(config);
        case SamplerKind::kDPMSolverMultistep: return std::make_unique<DPMSolverSampler>(config);
        case SamplerKind::kUniPC: return std::make_unique<UniPCSampler>(config);
    }
    DTUNE_FAIL("unknown sampler kind");
}

std::unique_ptr<Sampler> make_sampler(const nlohmann::json& scheduler_config, const std::string& kind,
                                      const std::string& source) {
    std::optional<SamplerKind> k;
    if (!kind.empty()) k = parse_sampler_kind(kind);
    return make_sampler(SchedulerConfig::from_json(scheduler_config, k, source));
}

at::Tensor initial_latents(at::IntArrayRef shape, const Sampler& sampler, at::Generator& generator,
                           at::Device device) {
    const at::Tensor noise =
        at::randn(shape, generator, at::TensorOptions().dtype(at::kFloat).device(generator.device()));
    return (noise * sampler.init_noise_sigma()).to(device);
}

}  // namespace dtune::diffusion
