// UniPC sampler (see unipc.h). Scalars are float32 like diffusers' 0-d tensors; the 2x2 system of the
// second-order corrector is solved in closed form.
#include "diffusion/unipc.h"

#include <cmath>

#include "core/error.h"
#include "diffusion/sigma_tables.h"

namespace dtune::diffusion {

using detail::AlphaSigma;
using detail::vp_from_sigma;

UniPCSampler::UniPCSampler(const SchedulerConfig& config) : Sampler(config) {
    if (config.schedule.rescale_betas_zero_snr) alphas_cumprod_[-1].fill_(std::pow(2.0, -24));
}

void UniPCSampler::set_timesteps(int64_t n) {
    const int64_t num_train = config_.schedule.num_train_timesteps;
    std::vector<double> t =
        detail::multistep_timesteps(config_.timestep_spacing, num_train, num_train, n, config_.steps_offset);
    const std::vector<double> train = detail::train_sigmas(alphas_cumprod_);
    std::vector<double> sigmas;
    double last = config_.final_sigmas_type == FinalSigmas::kSigmaMin ? train.front() : 0.0;
    if (config_.use_karras_sigmas) {
        sigmas = detail::karras_sigmas(config_.sigma_min.value_or(train.front()),
                                       config_.sigma_max.value_or(train.back()), n);
        const std::vector<double> logs = detail::log_of_float(train);
        t.clear();
        for (double s : sigmas) t.push_back(detail::np_round(detail::sigma_to_t(s, logs)));
        if (config_.final_sigmas_type == FinalSigmas::kSigmaMin) last = sigmas.back();  // unlike DPM++
    } else {
        for (double v : t) sigmas.push_back(detail::np_interp_index(v, train));
    }
    sigmas.push_back(last);
    sigmas_ = detail::to_float_tensor(sigmas);
    std::vector<int64_t> ints(t.begin(), t.end());
    timesteps_ = at::tensor(ints, at::kLong);
    history_ = {};
    last_sample_ = at::Tensor();
    this_order_ = 0;
    lower_order_nums_ = 0;
    next_step_ = 0;
}

float UniPCSampler::b_of_h(float hh) const {
    return config_.unipc_variant == UniPCVariant::kBh1 ? hh : std::expm1(hh);
}

at::Tensor UniPCSampler::predict(const at::Tensor& x, int64_t i, int64_t order) const {
    const AlphaSigma t = vp_from_sigma(sigma_at(i + 1));
    const AlphaSigma s0 = vp_from_sigma(sigma_at(i));
    const at::Tensor& m0 = history_[1];
    const float hh = -(t.lambda - s0.lambda);
    const float h_phi_1 = std::expm1(hh);
    at::Tensor x_t = (t.sigma / s0.sigma) * x - (t.alpha * h_phi_1) * m0;
    if (order == 2) {
        const AlphaSigma s1 = vp_from_sigma(sigma_at(i - 1));
        const float rk = (s1.lambda - s0.lambda) / (t.lambda - s0.lambda);
        const at::Tensor d1 = (history_[0] - m0) / rk;
        x_t = x_t - (t.alpha * b_of_h(hh)) * (0.5f * d1);  // rhos_p = 0.5 at order 2
    }
    return x_t;
}

at::Tensor UniPCSampler::correct(const at::Tensor& x0_now, int64_t i) const {
    const AlphaSigma t = vp_from_sigma(sigma_at(i));
    const AlphaSigma s0 = vp_from_sigma(sigma_at(i - 1));
    const at::Tensor& m0 = history_[1];  // the prediction made at step i - 1
    const float h = t.lambda - s0.lambda;
    const float hh = -h;
    const float h_phi_1 = std::expm1(hh);
    const float b_h = b_of_h(hh);
    const at::Tensor base = (t.sigma / s0.sigma) * last_sample_ - (t.alpha * h_phi_1) * m0;
    const at::Tensor d1_t = x0_now - m0;
    if (this_order_ == 1) return base - (t.alpha * b_h) * (0.5f * d1_t);
    // Order 2: solve [[1, 1], [rk, 1]] rho = [b1, b2] for the weights of D1 and D1_t.
    const AlphaSigma s1 = vp_from_sigma(sigma_at(i - 2));
    const float rk = (s1.lambda - s0.lambda) / h;
    const float phi_k1 = h_phi_1 / hh - 1.0f;
    const float b1 = phi_k1 / b_h;
    const float b2 = (phi_k1 / hh - 0.5f) * 2.0f / b_h;
    const float rho0 = (b1 - b2) / (1.0f - rk);
    const float rho1 = b1 - rho0;
    const at::Tensor d1 = (history_[0] - m0) / rk;
    return base - (t.alpha * b_h) * (rho0 * d1 + rho1 * d1_t);
}

at::Tensor UniPCSampler::step(const at::Tensor& model_output, int64_t i, const at::Tensor& x_in,
                              const std::optional<at::Generator>& /*generator: deterministic*/) {
    check_step(i);
    DTUNE_CHECK(i == next_step_,
                "UniPC is a multistep sampler: steps must run in order 0, 1, 2, ... after "
                "set_timesteps(); expected step ",
                next_step_, ", got ", i);
    const at::Tensor out = model_output.to(at::kFloat);
    at::Tensor x = x_in.to(at::kFloat);
    const AlphaSigma s = vp_from_sigma(sigma_at(i));
    at::Tensor x0;
    switch (config_.schedule.prediction_type) {
        case PredictionType::kEpsilon: x0 = (x - s.sigma * out) / s.alpha; break;
        case PredictionType::kSample: x0 = out; break;
        case PredictionType::kVPrediction: x0 = s.alpha * x - s.sigma * out; break;
        case PredictionType::kFlowMatching:
            DTUNE_FAIL("UniPC over a DDPM schedule cannot take flow predictions");
    }
    if (i > 0 && last_sample_.defined()) x = correct(x0, i);
    history_[0] = history_[1];
    history_[1] = x0;
    const int64_t n = num_steps();
    int64_t order = config_.lower_order_final ? std::min(config_.solver_order, n - i) : config_.solver_order;
    this_order_ = std::min(order, lower_order_nums_ + 1);
    last_sample_ = x;
    const at::Tensor prev = predict(x, i, this_order_);
    lower_order_nums_ = std::min(lower_order_nums_ + 1, config_.solver_order);
    ++next_step_;
    return prev.to(model_output.scalar_type());
}

}  // namespace dtune::diffusion
