// Scheduled sampling for DDPM (epsilon / v-prediction) models, SimpleTuner's experimental feature
// (scheduled_sampling_* options; its scheduled_sampling/plan.py and rollout.py):
// - each step, a sample with probability p (ramped over the run) starts `offset` timesteps above
//   its training timestep t (offset drawn per `strategy`, at most max_step_offset);
// - from the noised latent at t + offset the model denoises itself one training timestep at a time
//   (no gradient) down to t, and trains on that rolled-out input in place of the noised latent at
//   t; the target (noise or v at t) is unchanged. The model thus learns from its own drift.
//
// The rollout steps with the first-order DDIM/Euler update x_{t-1} = sqrt(a_{t-1}) x0 +
// sqrt(1 - a_{t-1}) eps. SimpleTuner hands the step to a skrample sampler (UniPC by default); with
// the skrample versions it pins (0.5.x) that call indexes the schedule so that each step moves to
// the next *higher* noise level (its DDPM sigma table ascends with t while the sampler assumes a
// descending one), so its rollouts do not land at t. dtune implements the intended descent; over
// one-timestep steps UniPC, DPM and Euler agree to within their discretisation error, so every
// `scheduled_sampling_sampler` value takes this update (docs: README "The loss and the timesteps").
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>

#include "diffusion/noise_schedule.h"

namespace dtune::diffusion {

enum class RolloutStrategy { kUniform, kBiasedEarly, kBiasedLate };
RolloutStrategy parse_rollout_strategy(const std::string& name);  // uniform | biased_early | biased_late

struct ScheduledSamplingOptions {
    int64_t max_step_offset = 0;  // 0: off
    double probability = 0.0;
    double prob_start = 0.0;
    double prob_end = 0.5;
    int64_t ramp_steps = 0;
    int64_t start_step = 0;
    bool cosine_ramp = false;  // ramp_shape cosine (else linear)
    RolloutStrategy strategy = RolloutStrategy::kUniform;
    bool active() const { return max_step_offset > 0; }
};

// The rollout probability at `global_step`, exactly as SimpleTuner derives it (including its
// `or` fallbacks: a prob_start or prob_end of 0 means `probability`).
double rollout_probability(const ScheduledSamplingOptions& options, int64_t global_step);

struct RolloutPlan {
    at::Tensor offsets;  // [B] int64 (0: no rollout)
    at::Tensor source;   // [B] int64: min(t + offset, T - 1)
};

// SimpleTuner's build_rollout_schedule for the batch's timesteps `t` ([B] int64, CPU): a Bernoulli
// mask with `probability` (all when >= 1), offsets per strategy, draws from `generator` (CPU).
RolloutPlan plan_rollout(const at::Tensor& t, int64_t num_train_timesteps,
                         const ScheduledSamplingOptions& options, double probability,
                         at::Generator& generator);

// plan_rollout's offsets for `n` samples, [n] int64 (0: no rollout), one formulation for both step
// paths: from `generator` on its device, or without one on `device` with its default generator and
// no host read, so a CUDA graph captures the draws. `probability` is a [] float32 in [0, 1] on that
// device (a tensor a captured step reads at every replay); the Bernoulli mask is drawn only when
// `draw_mask` (plan_rollout: when the probability is below 1; the graphed step: always, as its
// probability may reach 1 later in a ramp).
at::Tensor draw_rollout_offsets(int64_t n, const ScheduledSamplingOptions& options,
                                const at::Tensor& probability, bool draw_mask,
                                const std::optional<at::Generator>& generator, const at::Device& device);

// True when rollout_probability changes from step to step (a ramp between two different values).
bool rollout_probability_varies(const ScheduledSamplingOptions& options);

// One deterministic DDIM/Euler step of a noised sample x at timestep t ([1] or scalar) to t_prev,
// from the model output `pred` (epsilon or v, per `type`). Float32 math, x's dtype out.
at::Tensor rollout_step(const NoiseSchedule& schedule, PredictionType type, const at::Tensor& x,
                        const at::Tensor& pred, int64_t t, int64_t t_prev);
// The same step per sample: x, pred [B, ...], t and t_prev [B] int64 on x's device (t_prev -1: to the
// clean sample). The coefficients are computed there in float64 from the cached device table
// (NoiseSchedule::alphas_cumprod_at), as the host computes them, then rounded to float32: no host
// read, so a CUDA graph captures it.
at::Tensor rollout_step(const NoiseSchedule& schedule, PredictionType type, const at::Tensor& x,
                        const at::Tensor& pred, const at::Tensor& t, const at::Tensor& t_prev);

}  // namespace dtune::diffusion
