// Euler and Euler-ancestral samplers (see euler.h). Scalars are float32, as the 0-d tensors diffusers
// computes them with.
#include "diffusion/euler.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "diffusion/sigma_tables.h"

namespace dtune::diffusion {

EulerSampler::EulerSampler(const SchedulerConfig& config, bool ancestral)
    : Sampler(config), ancestral_(ancestral) {
    // diffusers keeps the last alphas_cumprod off exactly 0 so the largest sigma stays finite.
    if (config.schedule.rescale_betas_zero_snr) alphas_cumprod_[-1].fill_(std::pow(2.0, -24));
}

void EulerSampler::set_timesteps(int64_t n) {
    const int64_t num_train = config_.schedule.num_train_timesteps;
    std::vector<double> t =
        detail::spaced_timesteps(config_.timestep_spacing, num_train, n, config_.steps_offset,
                                 /*round_linspace=*/false);
    const std::vector<double> train = detail::train_sigmas(alphas_cumprod_);
    std::vector<double> sigmas;
    sigmas.reserve(t.size() + 1);
    for (double v : t) sigmas.push_back(detail::np_interp_index(v, train));
    if (!ancestral_ && config_.use_karras_sigmas) {
        const double lo = config_.sigma_min.value_or(sigmas.back());
        const double hi = config_.sigma_max.value_or(sigmas.front());
        sigmas = detail::karras_sigmas(lo, hi, n);
        const std::vector<double> logs = detail::log_of_float(train);
        for (size_t k = 0; k < sigmas.size(); ++k) t[k] = detail::sigma_to_t(sigmas[k], logs);
    }
    const bool sigma_min_last = !ancestral_ && config_.final_sigmas_type == FinalSigmas::kSigmaMin;
    sigmas.push_back(sigma_min_last ? train.front() : 0.0);
    sigmas_ = detail::to_float_tensor(sigmas);
    timesteps_ = detail::to_float_tensor(t);
}

double EulerSampler::init_noise_sigma() const {
    DTUNE_CHECK(sigmas_.defined(), "call set_timesteps() before init_noise_sigma()");
    const float max_sigma = sigmas_.max().item<float>();
    if (config_.timestep_spacing != TimestepSpacing::kLeading) return max_sigma;
    return std::sqrt(max_sigma * max_sigma + 1.0f);
}

at::Tensor EulerSampler::scale_model_input(const at::Tensor& x, int64_t i) const {
    check_step(i);
    const float sigma = sigma_at(i);
    return x / std::sqrt(sigma * sigma + 1.0f);
}

at::Tensor EulerSampler::step(const at::Tensor& model_output, int64_t i, const at::Tensor& x_in,
                              const std::optional<at::Generator>& generator) {
    check_step(i);
    const at::Tensor x = x_in.to(at::kFloat);
    const at::Tensor out = model_output.to(at::kFloat);
    const float sigma = sigma_at(i);
    const float sigma_next = sigma_at(i + 1);
    at::Tensor x0;  // the model's estimate of the clean sample
    switch (config_.schedule.prediction_type) {
        case PredictionType::kEpsilon: x0 = x - sigma * out; break;
        case PredictionType::kVPrediction:
            x0 = out * (-sigma / std::sqrt(sigma * sigma + 1.0f)) + x / (sigma * sigma + 1.0f);
            break;
        case PredictionType::kSample: x0 = out; break;
        case PredictionType::kFlowMatching:
            DTUNE_FAIL("Euler over a DDPM schedule cannot take flow predictions");
    }
    const at::Tensor derivative = (x - x0) / sigma;
    at::Tensor prev;
    if (!ancestral_) {
        prev = x + derivative * (sigma_next - sigma);
    } else {
        const float from2 = sigma * sigma;
        const float to2 = sigma_next * sigma_next;
        const float sigma_up = std::sqrt(to2 * (from2 - to2) / from2);
        const float sigma_down = std::sqrt(to2 - sigma_up * sigma_up);
        prev = x + derivative * (sigma_down - sigma);
        prev = prev + noise_like(out, generator) * sigma_up;
    }
    return prev.to(model_output.scalar_type());
}

}  // namespace dtune::diffusion
