// Training loss (see loss.h).
#include "diffusion/loss.h"

#include <cmath>
#include <vector>

#include "core/error.h"

namespace dtune::diffusion {

LossType parse_loss_type(const std::string& name) {
    if (name == "l2") return LossType::kL2;
    if (name == "huber") return LossType::kHuber;
    if (name == "smooth_l1") return LossType::kSmoothL1;
    throw UsageError(
        str("loss_type \"", name, "\" is not supported; use \"l2\", \"huber\" or \"smooth_l1\""));
}

HuberSchedule parse_huber_schedule(const std::string& name) {
    if (name == "constant") return HuberSchedule::kConstant;
    if (name == "exponential") return HuberSchedule::kExponential;
    if (name == "snr") return HuberSchedule::kSnr;
    throw UsageError(
        str("huber_schedule \"", name, "\" is not supported; use \"constant\", \"exponential\" or \"snr\""));
}

at::Tensor min_snr_weights(const at::Tensor& snr, double gamma, PredictionType schedule_prediction) {
    const at::Tensor clipped = at::clamp_max(snr, gamma);  // min(SNR, gamma)
    const at::Tensor divisor = schedule_prediction == PredictionType::kVPrediction ? snr + 1 : snr;
    return clipped / divisor;
}

at::Tensor scheduled_huber_c(const at::Tensor& timesteps, const LossOptions& o, const NoiseSchedule* schedule,
                             bool flow_matching) {
    // Everything stays on the timesteps' device: a CUDA graph captures it, nothing is read back.
    const at::Tensor t = timesteps.to(at::kFloat);  // [B]
    switch (o.huber_schedule) {
        case HuberSchedule::kConstant: return at::full({t.size(0)}, o.huber_c, t.options());
        case HuberSchedule::kExponential: {
            DTUNE_CHECK(schedule != nullptr || flow_matching,
                        "huber_schedule exponential needs the noise schedule");
            const double num = flow_matching ? 1000.0 : static_cast<double>(schedule->num_train_timesteps());
            const double alpha = -std::log(o.huber_c) / num;
            return at::exp(-alpha * t);
        }
        case HuberSchedule::kSnr: {
            at::Tensor sigmas;
            if (flow_matching) {
                const at::Tensor s = t / 1000;
                sigmas = ((1.0 - s) / (s + 0.0001)).pow(0.5);
            } else {
                DTUNE_CHECK(schedule != nullptr, "huber_schedule snr needs the noise schedule");
                const at::Tensor ac = schedule->alphas_cumprod_at(timesteps);  // [B] float32, same device
                sigmas = ((1.0 - ac) / ac).pow(0.5);
            }
            return (1 - o.huber_c) / (1 + sigmas).pow(2) + o.huber_c;
        }
    }
    DTUNE_FAIL("unknown huber schedule");
}

at::Tensor elementwise_loss(const at::Tensor& pred, const at::Tensor& target, LossType type,
                            const at::Tensor& huber_c) {
    const at::Tensor diff_sq = (pred - target).pow(2);
    if (type == LossType::kL2) return diff_sq;
    std::vector<int64_t> shape(static_cast<size_t>(pred.dim()), 1);
    at::Tensor c = huber_c.to(pred.device(), pred.scalar_type());
    if (c.dim() == 1) {
        shape[0] = c.size(0);
        c = c.view(shape);  // [B, 1, ..., 1]
    }
    const at::Tensor root = at::sqrt(diff_sq + c * c) - c;
    return type == LossType::kHuber ? 2 * c * root : 2 * root;
}

namespace {

at::Tensor broadcast_per_sample(const at::Tensor& w, const at::Tensor& like) {
    std::vector<int64_t> shape(static_cast<size_t>(like.dim()), 1);
    shape[0] = like.size(0);
    return w.to(like.device(), like.scalar_type()).view(shape);  // [B, 1, ..., 1]
}

}  // namespace

at::Tensor per_sample_loss(const at::Tensor& pred_in, const at::Tensor& target_in,
                           const at::Tensor& timesteps, PredictionType prediction,
                           const NoiseSchedule* schedule, const LossOptions& o) {
    DTUNE_CHECK(pred_in.sizes() == target_in.sizes(), "model prediction ", pred_in.sizes(), " and target ",
                target_in.sizes(), " differ in shape");
    const at::Tensor pred = pred_in.to(at::kFloat);
    const at::Tensor target = target_in.to(at::kFloat);
    const bool flow = prediction == PredictionType::kFlowMatching;
    at::Tensor loss;
    if (o.loss_type == LossType::kL2) {
        loss = elementwise_loss(pred, target, o.loss_type, at::Tensor());
    } else {
        loss = elementwise_loss(pred, target, o.loss_type, scheduled_huber_c(timesteps, o, schedule, flow));
    }
    const bool min_snr = !flow && o.snr_gamma.has_value() && *o.snr_gamma > 0;
    if (min_snr) {
        DTUNE_CHECK_AS(
            UsageError, prediction != PredictionType::kSample,
            "snr_gamma (min-SNR weighting) is defined for epsilon and v_prediction models, not for "
            "prediction_type sample; unset snr_gamma");
        DTUNE_CHECK(schedule != nullptr, "min-SNR weighting needs the noise schedule");
        const auto& cfg = schedule->config();
        DTUNE_CHECK_AS(
            UsageError, !(cfg.rescale_betas_zero_snr && cfg.prediction_type == PredictionType::kEpsilon),
            "snr_gamma with rescale_betas_zero_snr and an epsilon schedule divides by SNR = 0 at the "
            "last timestep; use prediction_type v_prediction with zero-terminal SNR, or unset snr_gamma");
        const at::Tensor w =
            min_snr_weights(schedule->snr(timesteps), *o.snr_gamma, cfg.prediction_type);  // [B]
        loss = loss * broadcast_per_sample(w, loss);
    } else if (!flow && o.loss_type == LossType::kL2) {
        loss = o.snr_weight * loss;
    }
    std::vector<int64_t> dims;
    for (int64_t d = 1; d < loss.dim(); ++d) dims.push_back(d);
    return dims.empty() ? loss : loss.mean(dims);
}

at::Tensor diff2flow_prediction(const at::Tensor& pred_in, const at::Tensor& noisy_in,
                                const at::Tensor& timesteps, PredictionType prediction,
                                const NoiseSchedule& schedule) {
    DTUNE_CHECK_AS(UsageError,
                   prediction == PredictionType::kEpsilon || prediction == PredictionType::kVPrediction,
                   "diff2flow_loss converts epsilon or v_prediction models only; unset diff2flow_loss");
    const at::Tensor pred = pred_in.to(at::kFloat), noisy = noisy_in.to(at::kFloat);
    const at::Tensor a = broadcast_per_sample(schedule.alphas_cumprod_at(timesteps.to(pred.device())), pred);
    if (prediction == PredictionType::kVPrediction) {
        const at::Tensor sa = a.sqrt(), s1a = (1 - a).sqrt();
        const at::Tensor x0 = sa * noisy - s1a * pred;
        const at::Tensor eps = sa * pred + s1a * noisy;
        return eps - x0;
    }
    const at::Tensor x0 = (1.0 / a).sqrt() * noisy - (1.0 / a - 1.0).sqrt() * pred;
    return pred - x0;
}

}  // namespace dtune::diffusion
