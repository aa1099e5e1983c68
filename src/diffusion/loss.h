// The training loss SimpleTuner computes (ModelFoundation.loss): element-wise l2 / pseudo-Huber /
// smooth-L1 with a constant or scheduled huber_c, min-SNR-gamma weighting (with the v-prediction
// divisor SNR + 1), then the mean over each sample and over the batch.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "diffusion/noise_schedule.h"

namespace dtune::diffusion {

enum class LossType { kL2, kHuber, kSmoothL1 };
enum class HuberSchedule { kConstant, kExponential, kSnr };
LossType parse_loss_type(const std::string& name);
HuberSchedule parse_huber_schedule(const std::string& name);

// SimpleTuner's option names and defaults (SIMPLETUNER.md §6): loss_type l2, huber_schedule snr,
// huber_c 0.1, snr_gamma None, snr_weight 1.0.
struct LossOptions {
    LossType loss_type = LossType::kL2;
    HuberSchedule huber_schedule = HuberSchedule::kSnr;
    double huber_c = 0.1;
    std::optional<double> snr_gamma;  // None or 0: no min-SNR weighting
    double snr_weight = 1.0;          // scales the plain l2 loss only (as in SimpleTuner)
};

// min(SNR, gamma) / SNR, or / (SNR + 1) when the schedule predicts v. [B] float32.
at::Tensor min_snr_weights(const at::Tensor& snr, double gamma, PredictionType schedule_prediction);

// huber_c per sample [B]: constant; exponential exp(-t ln(1/c) / T); snr (1 - c) / (1 + sigma)^2 + c
// with sigma = sqrt((1 - a_t) / a_t), or for flow matching sqrt((1 - s) / (s + 1e-4)) with s = t / 1000.
// `schedule` may be null for flow matching. Float32 on the timesteps' device, with no host read (a
// CUDA graph captures it), as are the min-SNR weights per_sample_loss applies.
at::Tensor scheduled_huber_c(const at::Tensor& timesteps, const LossOptions& options,
                             const NoiseSchedule* schedule, bool flow_matching);

// Element-wise loss, no reduction. huber_c is a scalar tensor or [B] (broadcast per sample).
// l2: (p - t)^2; huber: 2c (sqrt((p - t)^2 + c^2) - c); smooth_l1: 2 (sqrt((p - t)^2 + c^2) - c).
at::Tensor elementwise_loss(const at::Tensor& pred, const at::Tensor& target, LossType type,
                            const at::Tensor& huber_c);

// Per-sample loss [B] (mean over all but the batch dim), computed in float32. `prediction` is the
// model's prediction type; for DDPM models `schedule` gives the SNR and its own prediction type decides
// the min-SNR divisor, as in SimpleTuner. min-SNR does not apply to flow matching (ignored there, as
// SimpleTuner does) and is rejected for `sample` prediction and for a zero-terminal-SNR epsilon model
// (0/0 at the last timestep).
at::Tensor per_sample_loss(const at::Tensor& pred, const at::Tensor& target, const at::Tensor& timesteps,
                           PredictionType prediction, const NoiseSchedule* schedule,
                           const LossOptions& options);

// Diff2Flow (SimpleTuner's diff2flow bridge): an epsilon or v prediction at DDPM timesteps [B],
// with the noisy input it was made from, as the flow-matching vector field noise - x0:
//   epsilon: x0 = x_t / sqrt(a) - sqrt(1/a - 1) eps,              flow = eps - x0
//   v:       x0 = sqrt(a) x_t - sqrt(1 - a) v, eps = sqrt(a) v + sqrt(1 - a) x_t, flow = eps - x0
// with a = alphas_cumprod[t]. Float32. UsageError for other prediction types.
at::Tensor diff2flow_prediction(const at::Tensor& pred, const at::Tensor& noisy, const at::Tensor& timesteps,
                                PredictionType prediction, const NoiseSchedule& schedule);

// The scalar training loss: per_sample_loss(...).mean().
inline at::Tensor diffusion_loss(const at::Tensor& pred, const at::Tensor& target,
                                 const at::Tensor& timesteps, PredictionType prediction,
                                 const NoiseSchedule* schedule, const LossOptions& options) {
    return per_sample_loss(pred, target, timesteps, prediction, schedule, options).mean();
}

}  // namespace dtune::diffusion
