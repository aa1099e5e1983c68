// Euler (Karras et al. 2022, Algorithm 2 without churn) and Euler-ancestral samplers over a
// discrete DDPM schedule: diffusers' EulerDiscreteScheduler and EulerAncestralDiscreteScheduler.
#pragma once

#include "diffusion/sampler.h"

namespace dtune::diffusion {

class EulerSampler : public Sampler {
  public:
    // `ancestral`: after the deterministic move to sigma_down, add N(0, sigma_up^2) noise.
    EulerSampler(const SchedulerConfig& config, bool ancestral);

    void set_timesteps(int64_t num_inference_steps) override;
    double init_noise_sigma() const override;
    at::Tensor scale_model_input(const at::Tensor& x, int64_t i) const override;
    at::Tensor step(const at::Tensor& model_output, int64_t i, const at::Tensor& x,
                    const std::optional<at::Generator>& generator = std::nullopt) override;

  private:
    float sigma_at(int64_t i) const { return sigmas_[i].item<float>(); }

    bool ancestral_;
};

}  // namespace dtune::diffusion
