// The inference timestep and sigma tables of diffusers' discrete schedulers, computed in double the
// way diffusers computes them with NumPy (np.linspace, np.arange with a float step, np.round's
// round-half-to-even, np.interp, Karras' rho = 7 ramp, log-sigma interpolation back to timesteps), so
// integer timesteps come out identical and sigmas agree to float32 rounding.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "diffusion/scheduler_config.h"

namespace dtune::diffusion::detail {

// np.linspace(start, stop, num) (endpoint included).
std::vector<double> np_linspace(double start, double stop, int64_t num);
// np.arange(start, stop, step) for a float step, filled as NumPy does (start + i * delta, delta taken
// from the first two values).
std::vector<double> np_arange(double start, double stop, double step);
// np.round: half to even.
double np_round(double x);
// np.interp(x, [0, 1, ..., n-1], fp).
double np_interp_index(double x, const std::vector<double>& fp);

// Timesteps in sampling order (descending) for Euler, Euler-ancestral and DDIM: linspace (not rounded
// when `round_linspace` is false: Euler keeps fractional timesteps), leading (+ steps_offset), trailing.
std::vector<double> spaced_timesteps(TimestepSpacing spacing, int64_t num_train, int64_t num_steps,
                                     int64_t steps_offset, bool round_linspace);

// Timesteps of the multistep solvers (DPM++, UniPC): linspace over [0, last) with n + 1 points, the
// final 0 dropped; leading with stride last // (n + 1) (+ steps_offset); trailing from `last`.
std::vector<double> multistep_timesteps(TimestepSpacing spacing, int64_t num_train, int64_t last, int64_t n,
                                        int64_t steps_offset);

// Per-train-timestep sigmas sqrt((1 - a) / a) computed in float32 as diffusers does, widened to
// double; and their float32 logs.
std::vector<double> train_sigmas(const at::Tensor& alphas_cumprod);
std::vector<double> log_of_float(const std::vector<double>& sigmas);

// Karras et al. 2022 sigmas: (max^(1/7) + ramp (min^(1/7) - max^(1/7)))^7, ramp = linspace(0, 1, n).
std::vector<double> karras_sigmas(double sigma_min, double sigma_max, int64_t n);
// The fractional train timestep whose log-sigma matches, by linear interpolation in log sigma.
double sigma_to_t(double sigma, const std::vector<double>& log_sigmas);

// A sigma of the variance-exploding form seen from the variance-preserving one: alpha = 1/sqrt(s^2+1),
// sigma_t = s alpha, lambda = log(alpha) - log(sigma_t) (half log-SNR), in float32 like diffusers.
// At s = 0, lambda = +inf, which the multistep updates rely on for their last step.
struct AlphaSigma {
    float alpha;
    float sigma;
    float lambda;
};
inline AlphaSigma vp_from_sigma(float s) {
    const float alpha = 1.0f / std::sqrt(s * s + 1.0f);
    const float sigma = s * alpha;
    return {alpha, sigma, std::log(alpha) - std::log(sigma)};
}

// [n] float32 tensor from doubles.
at::Tensor to_float_tensor(const std::vector<double>& values);

}  // namespace dtune::diffusion::detail
