// DDPM noise schedule for training: betas, alphas_cumprod, forward noising (add_noise), training
// targets (epsilon, v, sample, flow) and the signal-to-noise ratio, as diffusers' DDPMScheduler and
// training_utils compute them. Tables are float32 on the CPU (diffusers' own precision, so values match
// the Python reference bit for bit where the ops are the same); per-call math runs on the input's device.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace dtune::diffusion {

enum class BetaSchedule { kLinear, kScaledLinear, kSquaredCosCapV2 };
enum class PredictionType { kEpsilon, kVPrediction, kSample, kFlowMatching };

// Parse diffusers' names ("linear", "scaled_linear", "squaredcos_cap_v2"; "epsilon", "v_prediction",
// "sample", "flow_matching"); `key` names the config key in the error message.
BetaSchedule parse_beta_schedule(const std::string& name, const std::string& key = "beta_schedule");
PredictionType parse_prediction_type(const std::string& name, const std::string& key = "prediction_type");
const char* to_string(BetaSchedule schedule);
const char* to_string(PredictionType type);

// [n] float32 betas as diffusers builds them (linspace in float32; scaled_linear squares a linspace of
// square roots; squaredcos_cap_v2 is the Nichol & Dhariwal cosine alpha-bar, computed in double, capped
// at 0.999).
at::Tensor make_betas(BetaSchedule schedule, int64_t num_train_timesteps, double beta_start, double beta_end);

// Lin et al. 2023 ("Common Diffusion Noise Schedules and Sample Steps Are Flawed", Algorithm 1): shifts
// and scales sqrt(alphas_cumprod) so the last one is exactly 0 (zero terminal SNR). [n] -> [n].
at::Tensor rescale_zero_terminal_snr(const at::Tensor& betas);

// The keys of a diffusers scheduler_config.json that define the training schedule. Defaults are those
// of diffusers' DDPMScheduler class (what from_config uses for a missing key); SDXL's own
// scheduler_config.json sets scaled_linear 0.00085..0.012.
struct NoiseScheduleConfig {
    int64_t num_train_timesteps = 1000;
    double beta_start = 0.0001;
    double beta_end = 0.02;
    BetaSchedule beta_schedule = BetaSchedule::kLinear;
    PredictionType prediction_type = PredictionType::kEpsilon;
    bool rescale_betas_zero_snr = false;

    // Reads the keys above from a scheduler config (unknown keys are ignored, as diffusers'
    // from_config does, because one JSON serves several scheduler classes). `source` names the file.
    static NoiseScheduleConfig from_json(const nlohmann::json& config, const std::string& source);
    // SDXL base 1.0's training schedule (scaled_linear 0.00085..0.012, epsilon).
    static NoiseScheduleConfig sdxl();
};

class NoiseSchedule {
  public:
    explicit NoiseSchedule(const NoiseScheduleConfig& config = NoiseScheduleConfig::sdxl());

    const NoiseScheduleConfig& config() const { return config_; }
    int64_t num_train_timesteps() const { return config_.num_train_timesteps; }
    const at::Tensor& betas() const { return betas_; }                    // [T] float32, CPU
    const at::Tensor& alphas_cumprod() const { return alphas_cumprod_; }  // [T] float32, CPU

    // sqrt(a_t) x0 + sqrt(1 - a_t) noise, a_t = alphas_cumprod[t]; x0/noise [B, ...], timesteps [B] int.
    at::Tensor add_noise(const at::Tensor& x0, const at::Tensor& noise, const at::Tensor& timesteps) const;
    // The v-prediction target sqrt(a_t) noise - sqrt(1 - a_t) x0 (diffusers' get_velocity).
    at::Tensor velocity(const at::Tensor& x0, const at::Tensor& noise, const at::Tensor& timesteps) const;
    // SNR a_t / (1 - a_t) as (sqrt(a_t) / sqrt(1 - a_t))^2 in float32, diffusers' compute_snr. [B] on
    // the timesteps' device (alphas_cumprod_at: no host copy once the table is there).
    at::Tensor snr(const at::Tensor& timesteps) const;
    // alphas_cumprod[t] for timesteps [B], float32 on the timesteps' device (a cached device copy of
    // the table, so no host copy once it exists).
    at::Tensor alphas_cumprod_at(const at::Tensor& timesteps) const;
    // The regression target for `type`: noise (epsilon), velocity (v), x0 (sample), noise - x0 (flow).
    at::Tensor target(PredictionType type, const at::Tensor& x0, const at::Tensor& noise,
                      const at::Tensor& timesteps) const;

  private:
    // alphas_cumprod[t] on x's device and dtype, shaped [B, 1, ..., 1] to broadcast against x.
    std::pair<at::Tensor, at::Tensor> coefficients(const at::Tensor& x, const at::Tensor& timesteps) const;

    NoiseScheduleConfig config_;
    at::Tensor betas_;
    at::Tensor alphas_cumprod_;
    // alphas_cumprod_ on the last accelerator asked for, copied once: a step then makes no host copy
    // (which a CUDA graph could not replay).
    mutable at::Tensor alphas_cumprod_device_;
};

}  // namespace dtune::diffusion
