// Scheduled sampling: SimpleTuner's rollout plan and the DDIM/Euler rollout step (see
// scheduled_sampling.h).
#include "diffusion/scheduled_sampling.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"

namespace dtune::diffusion {

RolloutStrategy parse_rollout_strategy(const std::string& name) {
    if (name == "uniform") return RolloutStrategy::kUniform;
    if (name == "biased_early") return RolloutStrategy::kBiasedEarly;
    if (name == "biased_late") return RolloutStrategy::kBiasedLate;
    throw UsageError(
        str("scheduled_sampling_strategy \"", name, "\" is not one of uniform, biased_early, biased_late"));
}

double rollout_probability(const ScheduledSamplingOptions& o, int64_t global_step) {
    // SimpleTuner: float(prob_start or p), float(prob_end or p).
    const double p = o.probability;
    const double start = o.prob_start != 0.0 ? o.prob_start : p;
    const double end = o.prob_end != 0.0 ? o.prob_end : p;
    if (o.ramp_steps > 0 && global_step >= o.start_step) {
        double progress = static_cast<double>(global_step - o.start_step) /
                          static_cast<double>(std::max<int64_t>(o.ramp_steps, 1));
        progress = std::min(1.0, std::max(0.0, progress));
        if (o.cosine_ramp) progress = 0.5 - 0.5 * std::cos(M_PI * progress);
        return start + (end - start) * progress;
    }
    return o.ramp_steps > 0 ? start : p;
}

RolloutPlan plan_rollout(const at::Tensor& t, int64_t num_train_timesteps, const ScheduledSamplingOptions& o,
                         double probability, at::Generator& generator) {
    const at::Tensor base = t.to(at::kCPU, at::kLong).reshape({-1});
    const int64_t b = base.size(0);
    RolloutPlan plan;
    if (o.max_step_offset <= 0) {
        plan.offsets = at::zeros_like(base);
        plan.source = base.clone();
        return plan;
    }
    const at::Tensor p = at::full({}, std::max(0.0, probability), at::kFloat);
    plan.offsets = draw_rollout_offsets(b, o, p.to(generator.device()), probability < 1.0, generator,
                                        generator.device());
    plan.source = (base + plan.offsets).clamp_max(num_train_timesteps - 1);
    return plan;
}

at::Tensor draw_rollout_offsets(int64_t n, const ScheduledSamplingOptions& o, const at::Tensor& probability,
                                bool draw_mask, const std::optional<at::Generator>& generator,
                                const at::Device& device) {
    const auto on = at::TensorOptions().device(device);
    at::Tensor mask;  // [n] int64 0/1; undefined: every sample
    if (draw_mask) mask = at::bernoulli(probability.expand({n}).contiguous(), generator).to(at::kLong);
    at::Tensor offsets;  // [n] int64
    const auto m = static_cast<double>(o.max_step_offset);
    switch (o.strategy) {
        case RolloutStrategy::kUniform:
            offsets = at::randint(0, o.max_step_offset + 1, {n}, generator, on.dtype(at::kLong));
            break;
        case RolloutStrategy::kBiasedEarly:
            offsets = at::round(at::rand({n}, generator, on.dtype(at::kFloat)).pow(2) * m).to(at::kLong);
            break;
        case RolloutStrategy::kBiasedLate:
            offsets =
                at::round((1.0 - at::rand({n}, generator, on.dtype(at::kFloat)).pow(2)) * m).to(at::kLong);
            break;
    }
    return mask.defined() ? offsets * mask : offsets;
}

bool rollout_probability_varies(const ScheduledSamplingOptions& o) {
    const double start = o.prob_start != 0.0 ? o.prob_start : o.probability;
    const double end = o.prob_end != 0.0 ? o.prob_end : o.probability;
    return o.ramp_steps > 0 && start != end;
}

namespace {

// One DDIM step back from the model's prediction, in float32: x0 and eps from x at the current
// timestep (coefficients sa = sqrt(a), s1a = sqrt(1 - a)), then recombined at the previous one (sp,
// s1p). The coefficients are doubles (one timestep for the batch) or [B, 1, ..., 1] float tensors.
template <typename C>
at::Tensor step_back(PredictionType type, const at::Tensor& x, const at::Tensor& pred, const C& sa,
                     const C& s1a, const C& sp, const C& s1p) {
    const at::Tensor xf = x.to(at::kFloat), p = pred.to(at::kFloat);
    at::Tensor x0, eps;
    if (type == PredictionType::kEpsilon) {
        eps = p;
        x0 = (xf - s1a * eps) / sa;
    } else {
        x0 = sa * xf - s1a * p;
        eps = s1a * xf + sa * p;
    }
    return (sp * x0 + s1p * eps).to(x.scalar_type());
}

}  // namespace

at::Tensor rollout_step(const NoiseSchedule& schedule, PredictionType type, const at::Tensor& x,
                        const at::Tensor& pred, const at::Tensor& t, const at::Tensor& t_prev) {
    DTUNE_CHECK_AS(UsageError, type == PredictionType::kEpsilon || type == PredictionType::kVPrediction,
                   "scheduled sampling rolls out epsilon and v-prediction models only");
    std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
    shape[0] = x.size(0);  // [B, 1, ..., 1]
    const auto coef = [&](const at::Tensor& c) { return c.to(at::kFloat).view(shape); };
    const at::Tensor a = schedule.alphas_cumprod_at(t).to(at::kDouble);  // [B]
    const at::Tensor a_prev =
        at::where(t_prev >= 0, schedule.alphas_cumprod_at(t_prev.clamp_min(0)).to(at::kDouble),
                  at::ones_like(a));  // [B]
    const at::Tensor sa = coef(a.sqrt()), s1a = coef((1.0 - a).sqrt());
    const at::Tensor sp = coef(a_prev.sqrt()), s1p = coef((1.0 - a_prev).sqrt());
    return step_back(type, x, pred, sa, s1a, sp, s1p);
}

at::Tensor rollout_step(const NoiseSchedule& schedule, PredictionType type, const at::Tensor& x,
                        const at::Tensor& pred, int64_t t, int64_t t_prev) {
    DTUNE_CHECK_AS(UsageError, type == PredictionType::kEpsilon || type == PredictionType::kVPrediction,
                   "scheduled sampling rolls out epsilon and v-prediction models only");
    const auto& ac = schedule.alphas_cumprod();
    const double a = ac[t].item<double>(), a_prev = t_prev >= 0 ? ac[t_prev].item<double>() : 1.0;
    return step_back(type, x, pred, std::sqrt(a), std::sqrt(1.0 - a), std::sqrt(a_prev),
                     std::sqrt(1.0 - a_prev));
}

}  // namespace dtune::diffusion
