// The sampler interface the validation/inference pipeline drives, whatever the algorithm:
//
//   auto s = make_sampler(read_scheduler_config(dir / "scheduler_config.json"), "euler");
//   s->set_timesteps(30);
//   x = initial_noise({B, 4, H/8, W/8}, gen) * s->init_noise_sigma();   (or initial_latents(...))
//   for (i = 0; i < s->num_steps(); ++i) {
//       eps = unet(s->scale_model_input(x, i), s->timesteps()[i], ...);
//       x = s->step(eps, i, x, gen);
//   }
//
// Steps are addressed by index i (0-based, in sampling order) instead of diffusers' timestep lookup.
// Multistep samplers (DPM++) keep history, so step() must be called with i = 0, 1, 2, ... after each
// set_timesteps(); they check it. Samples are computed in float32 and returned in model_output's dtype.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "diffusion/noise_schedule.h"
#include "diffusion/scheduler_config.h"

namespace dtune::diffusion {

class Sampler {
  public:
    explicit Sampler(const SchedulerConfig& config);
    virtual ~Sampler() = default;
    Sampler(const Sampler&) = delete;
    Sampler& operator=(const Sampler&) = delete;

    const SchedulerConfig& config() const { return config_; }
    const char* name() const { return to_string(config_.kind); }
    PredictionType prediction_type() const { return config_.schedule.prediction_type; }
    const at::Tensor& alphas_cumprod() const { return alphas_cumprod_; }  // [T] float32, CPU

    // Builds the inference schedule for n steps (resets any multistep history).
    virtual void set_timesteps(int64_t num_inference_steps) = 0;
    // [n] timesteps to give the model, in sampling order: float32 for the Euler family (they may be
    // fractional), int64 for DDIM and DPM++ (as diffusers).
    const at::Tensor& timesteps() const { return timesteps_; }
    // [n + 1] float32 sigmas ending in the final sigma (Euler family and DPM++); undefined for DDIM.
    const at::Tensor& sigmas() const { return sigmas_; }
    int64_t num_steps() const { return timesteps_.defined() ? timesteps_.size(0) : 0; }

    // The standard deviation of the initial noise (multiply N(0, 1) latents by it).
    virtual double init_noise_sigma() const { return 1.0; }
    // The model's input at step i (Euler family: x / sqrt(sigma^2 + 1); identity otherwise).
    virtual at::Tensor scale_model_input(const at::Tensor& x, int64_t i) const {
        check_step(i);
        return x;
    }
    // x at step i -> x at step i + 1. `generator` feeds the ancestral / eta noise (CPU generator:
    // noise is drawn on the CPU and moved, so results do not depend on the device).
    virtual at::Tensor step(const at::Tensor& model_output, int64_t i, const at::Tensor& x,
                            const std::optional<at::Generator>& generator = std::nullopt) = 0;

  protected:
    void check_step(int64_t i) const;
    // N(0, 1) shaped like `like`, drawn on the generator's device, returned on like's device in float32.
    static at::Tensor noise_like(const at::Tensor& like, const std::optional<at::Generator>& generator);

    SchedulerConfig config_;
    at::Tensor alphas_cumprod_;
    at::Tensor timesteps_;
    at::Tensor sigmas_;
};

// Builds the sampler `kind` (SimpleTuner or diffusers name; empty: the config's "_class_name") from a
// diffusers scheduler config.
std::unique_ptr<Sampler> make_sampler(const nlohmann::json& scheduler_config, const std::string& kind = "",
                                      const std::string& source = "scheduler_config.json");
std::unique_ptr<Sampler> make_sampler(const SchedulerConfig& config);

// Seeded initial latents as diffusers' prepare_latents draws them: N(0, 1) of `shape` from the
// generator (on its device), times init_noise_sigma, in float32 on `device`.
at::Tensor initial_latents(at::IntArrayRef shape, const Sampler& sampler, at::Generator& generator,
                           at::Device device = at::kCPU);

}  // namespace dtune::diffusion
