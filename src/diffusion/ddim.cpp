// DDIM sampler (see ddim.h). Scalars are float32 like diffusers' 0-d tensors.
#include "diffusion/ddim.h"

#include <cmath>

#include "core/error.h"
#include "diffusion/sigma_tables.h"

namespace dtune::diffusion {

DDIMSampler::DDIMSampler(const SchedulerConfig& config) : Sampler(config) {}

void DDIMSampler::set_timesteps(int64_t n) {
    const int64_t num_train = config_.schedule.num_train_timesteps;
    const std::vector<double> t = detail::spaced_timesteps(config_.timestep_spacing, num_train, n,
                                                           config_.steps_offset, /*round_linspace=*/true);
    std::vector<int64_t> ints(t.begin(), t.end());
    timesteps_ = at::tensor(ints, at::kLong);
    stride_ = num_train / n;
    sigmas_ = at::Tensor();
}

float DDIMSampler::alpha_cumprod(int64_t t) const {
    if (t >= 0) return alphas_cumprod_[t].item<float>();
    // Before the first training timestep: 1 (set_alpha_to_one) or the first alpha.
    return config_.set_alpha_to_one ? 1.0f : alphas_cumprod_[0].item<float>();
}

at::Tensor DDIMSampler::step(const at::Tensor& model_output, int64_t i, const at::Tensor& x_in,
                             const std::optional<at::Generator>& generator) {
    check_step(i);
    const at::Tensor x = x_in.to(at::kFloat);
    const at::Tensor out = model_output.to(at::kFloat);
    const int64_t t = timesteps_[i].item<int64_t>();
    const float a_t = alpha_cumprod(t);
    const float a_prev = alpha_cumprod(t - stride_);
    const float b_t = 1.0f - a_t;
    at::Tensor x0;
    at::Tensor eps;
    switch (config_.schedule.prediction_type) {
        case PredictionType::kEpsilon:
            x0 = (x - std::sqrt(b_t) * out) / std::sqrt(a_t);
            eps = out;
            break;
        case PredictionType::kSample:
            x0 = out;
            eps = (x - std::sqrt(a_t) * x0) / std::sqrt(b_t);
            break;
        case PredictionType::kVPrediction:
            x0 = std::sqrt(a_t) * x - std::sqrt(b_t) * out;
            eps = std::sqrt(a_t) * out + std::sqrt(b_t) * x;
            break;
        case PredictionType::kFlowMatching: DTUNE_FAIL("DDIM cannot take flow predictions");
    }
    if (config_.clip_sample) {
        const double r = config_.clip_sample_range;
        x0 = x0.clamp(-r, r);
    }
    const float variance = (1.0f - a_prev) / (1.0f - a_t) * (1.0f - a_t / a_prev);
    const float std_dev = static_cast<float>(eta_) * std::sqrt(variance);
    const at::Tensor direction = std::sqrt(1.0f - a_prev - std_dev * std_dev) * eps;
    at::Tensor prev = std::sqrt(a_prev) * x0 + direction;
    if (eta_ > 0) prev = prev + std_dev * noise_like(out, generator);
    return prev.to(model_output.scalar_type());
}

}  // namespace dtune::diffusion
