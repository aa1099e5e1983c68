// Flow matching (rectified flow) for Flux.1 and SD3-style models: diffusers'
// FlowMatchEulerDiscreteScheduler (0.42) and FluxPipeline's resolution-dependent shift.
//
//   x_sigma = (1 - sigma) · x0 + sigma · noise,   the model predicts v = noise - x0,
//   an Euler step: x_next = x + (sigma_next - sigma) · v.
//
// Sigmas run from 1 (noise) down; a static `shift` s maps sigma to s·sigma / (1 + (s - 1)·sigma),
// dynamic shifting maps it with mu (exponential: e^mu / (e^mu + (1/sigma - 1)), linear: mu / (mu +
// (1/sigma - 1))), where FluxPipeline takes mu from the image's token count by a line through
// (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift). Karras, exponential and beta
// sigma conversions are refused (no Flux or SD3 config uses them).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace dtune::diffusion {

enum class TimeShiftType { kExponential, kLinear };

struct FlowMatchConfig {
    int64_t num_train_timesteps = 1000;
    double shift = 1.0;
    bool use_dynamic_shifting = false;
    double base_shift = 0.5;
    double max_shift = 1.15;
    int64_t base_image_seq_len = 256;
    int64_t max_image_seq_len = 4096;
    bool invert_sigmas = false;
    std::optional<double> shift_terminal;
    TimeShiftType time_shift_type = TimeShiftType::kExponential;
    bool stochastic_sampling = false;

    // From a scheduler_config.json of FlowMatchEulerDiscreteScheduler; `source` names the file in
    // errors. Another _class_name, or a sigma conversion dtune does not implement, is a UsageError.
    static FlowMatchConfig from_json(const nlohmann::json& config,
                                     const std::string& source = "scheduler_config.json");
};

// FluxPipeline's calculate_shift: mu for an image of `image_seq_len` latent tokens (packed 2×2
// patches: (H/16)·(W/16) for an H×W image).
double flow_match_mu(const FlowMatchConfig& config, int64_t image_seq_len);

// The shifted sigma of an unshifted one (static shift, or dynamic with `mu`).
double flow_match_shift_sigma(const FlowMatchConfig& config, double sigma, std::optional<double> mu);

class FlowMatchEulerSampler {
  public:
    explicit FlowMatchEulerSampler(FlowMatchConfig config);

    const FlowMatchConfig& config() const { return config_; }
    // The inference schedule of n steps: sigmas from linspace(sigma_max, sigma_min, n) of the
    // training schedule, or `sigmas` when given (FluxPipeline passes linspace(1, 1/n, n)); then the
    // shift (mu required with dynamic shifting), shift_terminal and invert_sigmas, as diffusers does.
    void set_timesteps(int64_t num_inference_steps,
                       const std::optional<std::vector<double>>& sigmas = std::nullopt,
                       std::optional<double> mu = std::nullopt);
    const at::Tensor& timesteps() const { return timesteps_; }  // [n] float32: sigma · num_train_timesteps
    const at::Tensor& sigmas() const { return sigmas_; }        // [n + 1] float32, ending in 0 (1 inverted)
    int64_t num_steps() const { return timesteps_.defined() ? timesteps_.size(0) : 0; }

    // x at step i -> x at step i + 1 (float32 math, returned in model_output's dtype). With
    // stochastic_sampling the next sample is re-noised from the predicted x0 with N(0, 1) drawn from
    // `generator` (on the CPU, then moved).
    at::Tensor step(const at::Tensor& model_output, int64_t i, const at::Tensor& x,
                    const std::optional<at::Generator>& generator = std::nullopt) const;

    // The training schedule's sigmas ([num_train_timesteps] float32, statically shifted unless
    // dynamic shifting is on), as the scheduler holds them before set_timesteps.
    static at::Tensor training_sigmas(const FlowMatchConfig& config);

  private:
    FlowMatchConfig config_;
    double sigma_min_ = 0, sigma_max_ = 1;
    at::Tensor timesteps_, sigmas_;
};

// x_sigma = (1 - sigma) · x0 + sigma · noise (diffusers' scale_noise), sigma broadcast over the batch
// ([B] or a scalar tensor).
at::Tensor flow_match_noise(const at::Tensor& x0, const at::Tensor& noise, const at::Tensor& sigma);

}  // namespace dtune::diffusion
