// DDIM (Song et al. 2021) over a discrete DDPM schedule: diffusers' DDIMScheduler, with eta (0 by
// default: deterministic), clip_sample and set_alpha_to_one. SDXL's validation default in SimpleTuner.
#pragma once

#include "diffusion/sampler.h"

namespace dtune::diffusion {

class DDIMSampler : public Sampler {
  public:
    explicit DDIMSampler(const SchedulerConfig& config);

    // eta = 0 is DDIM; eta = 1 is DDPM-like ancestral sampling (noise from step()'s generator).
    void set_eta(double eta) { eta_ = eta; }
    double eta() const { return eta_; }

    void set_timesteps(int64_t num_inference_steps) override;
    at::Tensor step(const at::Tensor& model_output, int64_t i, const at::Tensor& x,
                    const std::optional<at::Generator>& generator = std::nullopt) override;

  private:
    float alpha_cumprod(int64_t t) const;

    double eta_ = 0.0;
    int64_t stride_ = 0;  // num_train_timesteps // num_inference_steps: the step to the previous timestep
};

}  // namespace dtune::diffusion
