// DDPM training schedule (see noise_schedule.h). The float32 op order follows diffusers so the tables
// match its values to the last bit where libtorch runs the same kernels.
#include "diffusion/noise_schedule.h"

#include <cmath>
#include <numbers>
#include <vector>

#include "core/error.h"
#include "diffusion/config_json.h"
#include "diffusion/training_sampling.h"

namespace dtune::diffusion {

BetaSchedule parse_beta_schedule(const std::string& name, const std::string& key) {
    if (name == "linear") return BetaSchedule::kLinear;
    if (name == "scaled_linear") return BetaSchedule::kScaledLinear;
    if (name == "squaredcos_cap_v2") return BetaSchedule::kSquaredCosCapV2;
    throw UsageError(str(key, " \"", name,
                         "\" is not supported; use \"linear\", \"scaled_linear\" or \"squaredcos_cap_v2\""));
}

PredictionType parse_prediction_type(const std::string& name, const std::string& key) {
    if (name == "epsilon") return PredictionType::kEpsilon;
    if (name == "v_prediction") return PredictionType::kVPrediction;
    if (name == "sample") return PredictionType::kSample;
    if (name == "flow_matching") return PredictionType::kFlowMatching;
    throw UsageError(
        str(key, " \"", name,
            "\" is not supported; use \"epsilon\", \"v_prediction\", \"sample\" or \"flow_matching\""));
}

const char* to_string(BetaSchedule schedule) {
    switch (schedule) {
        case BetaSchedule::kLinear: return "linear";
        case BetaSchedule::kScaledLinear: return "scaled_linear";
        case BetaSchedule::kSquaredCosCapV2: return "squaredcos_cap_v2";
    }
    return "?";
}

const char* to_string(PredictionType type) {
    switch (type) {
        case PredictionType::kEpsilon: return "epsilon";
        case PredictionType::kVPrediction: return "v_prediction";
        case PredictionType::kSample: return "sample";
        case PredictionType::kFlowMatching: return "flow_matching";
    }
    return "?";
}

namespace {

double cosine_alpha_bar(double t) {
    const double c = std::cos((t + 0.008) / 1.008 * std::numbers::pi / 2.0);
    return c * c;
}

}  // namespace

at::Tensor make_betas(BetaSchedule schedule, int64_t n, double beta_start, double beta_end) {
    DTUNE_CHECK_AS(UsageError, n >= 2, "num_train_timesteps is ", n,
                   "; it must be at least 2 (SDXL uses 1000)");
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    switch (schedule) {
        case BetaSchedule::kLinear: return at::linspace(beta_start, beta_end, n, f32);
        case BetaSchedule::kScaledLinear:
            return at::linspace(std::sqrt(beta_start), std::sqrt(beta_end), n, f32).pow(2);
        case BetaSchedule::kSquaredCosCapV2: {
            std::vector<float> betas(static_cast<size_t>(n));
            for (int64_t i = 0; i < n; ++i) {
                const double t1 = static_cast<double>(i) / static_cast<double>(n);
                const double t2 = static_cast<double>(i + 1) / static_cast<double>(n);
                betas[static_cast<size_t>(i)] =
                    static_cast<float>(std::min(1.0 - cosine_alpha_bar(t2) / cosine_alpha_bar(t1), 0.999));
            }
            return at::tensor(betas, f32);
        }
    }
    DTUNE_FAIL("unknown beta schedule");
}

at::Tensor rescale_zero_terminal_snr(const at::Tensor& betas) {
    const at::Tensor alphas_cumprod = at::cumprod(1.0 - betas, 0);
    at::Tensor root = alphas_cumprod.sqrt();        // [T]
    const at::Tensor root_first = root[0].clone();  // sqrt(a_0), kept
    const at::Tensor root_last = root[-1].clone();  // sqrt(a_T), sent to 0
    root -= root_last;
    root *= root_first / (root_first - root_last);
    const at::Tensor alphas_bar = root.pow(2);
    const at::Tensor alphas =
        at::cat({alphas_bar.slice(0, 0, 1), alphas_bar.slice(0, 1) / alphas_bar.slice(0, 0, -1)});
    return 1 - alphas;
}

NoiseScheduleConfig NoiseScheduleConfig::from_json(const nlohmann::json& j, const std::string& source) {
    using namespace detail;
    NoiseScheduleConfig c;
    c.num_train_timesteps = get_int(j, "num_train_timesteps", c.num_train_timesteps, source);
    c.beta_start = get_double(j, "beta_start", c.beta_start, source);
    c.beta_end = get_double(j, "beta_end", c.beta_end, source);
    c.beta_schedule =
        parse_beta_schedule(get_string(j, "beta_schedule", "linear", source), source + " beta_schedule");
    c.prediction_type = parse_prediction_type(get_string(j, "prediction_type", "epsilon", source),
                                              source + " prediction_type");
    c.rescale_betas_zero_snr = get_bool(j, "rescale_betas_zero_snr", false, source);
    DTUNE_CHECK_AS(
        UsageError, !has_value(j, "trained_betas"), source,
        ": \"trained_betas\" is set; dtune builds betas from beta_schedule only. Remove trained_betas "
        "or convert the schedule");
    return c;
}

NoiseScheduleConfig NoiseScheduleConfig::sdxl() {
    NoiseScheduleConfig c;
    c.beta_start = 0.00085;
    c.beta_end = 0.012;
    c.beta_schedule = BetaSchedule::kScaledLinear;
    return c;
}

NoiseSchedule::NoiseSchedule(const NoiseScheduleConfig& config) : config_(config) {
    DTUNE_CHECK_AS(UsageError, config.prediction_type != PredictionType::kFlowMatching,
                   "a DDPM noise schedule cannot use prediction_type flow_matching; use the flow-matching "
                   "helpers (flow_matching.h) for flow models");
    betas_ = make_betas(config.beta_schedule, config.num_train_timesteps, config.beta_start, config.beta_end);
    if (config.rescale_betas_zero_snr) betas_ = rescale_zero_terminal_snr(betas_);
    alphas_cumprod_ = at::cumprod(1.0 - betas_, 0);
}

std::pair<at::Tensor, at::Tensor> NoiseSchedule::coefficients(const at::Tensor& x,
                                                              const at::Tensor& timesteps) const {
    DTUNE_CHECK(timesteps.dim() == 1 && timesteps.size(0) == x.size(0),
                "timesteps must be [B] with B = ", x.size(0), " (the batch of the samples); got shape ",
                timesteps.sizes());
    const at::Tensor t = to_device_async(timesteps, x.device()).to(at::kLong);
    if (x.device().is_cpu()) {
        alphas_cumprod_device_ = alphas_cumprod_;
    } else if (!alphas_cumprod_device_.defined() || alphas_cumprod_device_.device() != x.device()) {
        alphas_cumprod_device_ = alphas_cumprod_.to(x.device());
    }
    const at::Tensor ac = alphas_cumprod_device_.to(x.scalar_type()).index_select(0, t);  // [B]
    std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
    shape[0] = x.size(0);
    return {ac.pow(0.5).view(shape), (1 - ac).pow(0.5).view(shape)};  // [B, 1, ..., 1] each
}

at::Tensor NoiseSchedule::add_noise(const at::Tensor& x0, const at::Tensor& noise,
                                    const at::Tensor& timesteps) const {
    const auto [sqrt_a, sqrt_one_minus_a] = coefficients(x0, timesteps);
    return sqrt_a * x0 + sqrt_one_minus_a * noise;
}

at::Tensor NoiseSchedule::velocity(const at::Tensor& x0, const at::Tensor& noise,
                                   const at::Tensor& timesteps) const {
    const auto [sqrt_a, sqrt_one_minus_a] = coefficients(noise, timesteps);
    return sqrt_a * noise - sqrt_one_minus_a * x0;
}

at::Tensor NoiseSchedule::alphas_cumprod_at(const at::Tensor& timesteps) const {
    // gather, the same lookup as index_select, also runs on meta tensors: the tests run the loss
    // terms there to show that they make no host read (tests/diffusion/test_step_terms_on_device.cpp).
    const c10::Device device = timesteps.device();
    const at::Tensor t = timesteps.to(at::kLong).reshape({-1});  // [B]
    if (device.is_cpu()) return alphas_cumprod_.gather(0, t);
    if (!alphas_cumprod_device_.defined() || alphas_cumprod_device_.device() != device)
        alphas_cumprod_device_ = alphas_cumprod_.to(device);
    return alphas_cumprod_device_.gather(0, t);
}

at::Tensor NoiseSchedule::snr(const at::Tensor& timesteps) const {
    // On the timesteps' device from the cached table: no host copy, so a CUDA graph can hold it.
    const at::Tensor ac = alphas_cumprod_at(timesteps);  // [B]
    const at::Tensor alpha = ac.pow(0.5);                // [B]
    const at::Tensor sigma = (1.0 - ac).pow(0.5);        // [B]
    return (alpha / sigma).pow(2);
}

at::Tensor NoiseSchedule::target(PredictionType type, const at::Tensor& x0, const at::Tensor& noise,
                                 const at::Tensor& timesteps) const {
    switch (type) {
        case PredictionType::kEpsilon: return noise;
        case PredictionType::kVPrediction: return velocity(x0, noise, timesteps);
        case PredictionType::kSample: return x0;
        case PredictionType::kFlowMatching: return noise - x0;
    }
    DTUNE_FAIL("unknown prediction type");
}

}  // namespace dtune::diffusion
