// DPM-Solver++ multistep sampler (see dpm_solver.h). Scalars are float32 like diffusers' 0-d tensors;
// log(0) = -inf at the final sigma 0 is intended (the first-order update then returns x0 exactly).
#include "diffusion/dpm_solver.h"

#include <cmath>

#include "core/error.h"
#include "diffusion/sigma_tables.h"

namespace dtune::diffusion {

using detail::AlphaSigma;
using detail::vp_from_sigma;

DPMSolverSampler::DPMSolverSampler(const SchedulerConfig& config) : Sampler(config) {
    if (config.schedule.rescale_betas_zero_snr) alphas_cumprod_[-1].fill_(std::pow(2.0, -24));
}

void DPMSolverSampler::set_timesteps(int64_t n) {
    const int64_t num_train = config_.schedule.num_train_timesteps;
    // Drop the noisiest timesteps whose half log-SNR is below lambda_min_clipped.
    const at::Tensor lambdas =
        at::log(alphas_cumprod_.sqrt()) - at::log((1 - alphas_cumprod_).sqrt());  // [T]
    const int64_t clipped = (lambdas < config_.lambda_min_clipped).sum().item<int64_t>();
    const int64_t last = num_train - clipped;
    std::vector<double> t =
        detail::multistep_timesteps(config_.timestep_spacing, num_train, last, n, config_.steps_offset);
    const std::vector<double> train = detail::train_sigmas(alphas_cumprod_);
    std::vector<double> sigmas;
    if (config_.use_karras_sigmas) {
        sigmas = detail::karras_sigmas(train.front(), train.back(), n);
        const std::vector<double> logs = detail::log_of_float(train);
        const bool round = config_.schedule.beta_schedule != BetaSchedule::kSquaredCosCapV2;
        t.clear();
        for (double s : sigmas) {
            const double v = detail::sigma_to_t(s, logs);
            t.push_back(round ? detail::np_round(v) : std::trunc(v));
        }
    } else {
        for (double v : t) sigmas.push_back(detail::np_interp_index(v, train));
    }
    sigmas.push_back(config_.final_sigmas_type == FinalSigmas::kSigmaMin ? train.front() : 0.0);
    sigmas_ = detail::to_float_tensor(sigmas);
    std::vector<int64_t> ints(t.begin(), t.end());
    timesteps_ = at::tensor(ints, at::kLong);
    history_ = {};
    lower_order_nums_ = 0;
    next_step_ = 0;
}

at::Tensor DPMSolverSampler::data_prediction(const at::Tensor& out, const at::Tensor& x, int64_t i) const {
    const AlphaSigma s = vp_from_sigma(sigma_at(i));
    switch (config_.schedule.prediction_type) {
        case PredictionType::kEpsilon: return (x - s.sigma * out) / s.alpha;
        case PredictionType::kSample: return out;
        case PredictionType::kVPrediction: return s.alpha * x - s.sigma * out;
        case PredictionType::kFlowMatching: break;
    }
    DTUNE_FAIL("DPM-Solver++ over a DDPM schedule cannot take flow predictions");
}

at::Tensor DPMSolverSampler::first_order(const at::Tensor& x0, const at::Tensor& x, int64_t i) const {
    const AlphaSigma t = vp_from_sigma(sigma_at(i + 1));
    const AlphaSigma s = vp_from_sigma(sigma_at(i));
    const float h = t.lambda - s.lambda;
    return (t.sigma / s.sigma) * x - (t.alpha * (std::exp(-h) - 1.0f)) * x0;
}

at::Tensor DPMSolverSampler::second_order(const at::Tensor& x, int64_t i) const {
    const AlphaSigma t = vp_from_sigma(sigma_at(i + 1));
    const AlphaSigma s0 = vp_from_sigma(sigma_at(i));
    const AlphaSigma s1 = vp_from_sigma(sigma_at(i - 1));
    const at::Tensor& m0 = history_[1];
    const at::Tensor& m1 = history_[0];
    const float h = t.lambda - s0.lambda;
    const float h0 = s0.lambda - s1.lambda;
    const float r0 = h0 / h;
    const at::Tensor d1 = (1.0f / r0) * (m0 - m1);
    const float phi = t.alpha * (std::exp(-h) - 1.0f);
    const at::Tensor base = (t.sigma / s0.sigma) * x - phi * m0;
    if (config_.solver_type == DPMSolverType::kMidpoint) return base - 0.5f * phi * d1;
    return base + (t.alpha * ((std::exp(-h) - 1.0f) / h + 1.0f)) * d1;
}

at::Tensor DPMSolverSampler::step(const at::Tensor& model_output, int64_t i, const at::Tensor& x_in,
                                  const std::optional<at::Generator>& /*generator: deterministic*/) {
    check_step(i);
    DTUNE_CHECK(i == next_step_,
                "DPM++ is a multistep sampler: steps must run in order 0, 1, 2, ... after "
                "set_timesteps(); expected step ",
                next_step_, ", got ", i);
    const int64_t n = num_steps();
    const bool final_sigma_zero = config_.final_sigmas_type == FinalSigmas::kZero;
    const bool lower_order_final =
        i == n - 1 && (config_.euler_at_final || (config_.lower_order_final && n < 15) || final_sigma_zero);
    const at::Tensor out = model_output.to(at::kFloat);
    const at::Tensor x = x_in.to(at::kFloat);
    history_[0] = history_[1];
    history_[1] = data_prediction(out, x, i);
    at::Tensor prev;
    if (config_.solver_order == 1 || lower_order_nums_ < 1 || lower_order_final) {
        prev = first_order(history_[1], x, i);
    } else {
        prev = second_order(x, i);  // orders are at most 2, so diffusers' lower_order_second changes nothing
    }
    lower_order_nums_ = std::min(lower_order_nums_ + 1, config_.solver_order);
    ++next_step_;
    return prev.to(model_output.scalar_type());
}

}  // namespace dtune::diffusion
