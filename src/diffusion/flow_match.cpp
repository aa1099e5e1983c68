// Flow-matching schedule and Euler sampler (see flow_match.h). The schedule is computed in double
// precision and stored in float32, as diffusers computes it in numpy float64 and converts.
#include "diffusion/flow_match.h"

#include <cmath>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "diffusion/config_json.h"

namespace dtune::diffusion {

FlowMatchConfig FlowMatchConfig::from_json(const nlohmann::json& j, const std::string& source) {
    using namespace detail;
    const std::string cls = get_string(j, "_class_name", "FlowMatchEulerDiscreteScheduler", source);
    DTUNE_CHECK_AS(UsageError, cls == "FlowMatchEulerDiscreteScheduler", source, ": _class_name \"", cls,
                   "\" is not a flow-matching scheduler dtune implements (FlowMatchEulerDiscreteScheduler)");
    FlowMatchConfig c;
    c.num_train_timesteps = get_int(j, "num_train_timesteps", c.num_train_timesteps, source);
    c.shift = get_double(j, "shift", c.shift, source);
    c.use_dynamic_shifting = get_bool(j, "use_dynamic_shifting", c.use_dynamic_shifting, source);
    c.base_shift = get_double(j, "base_shift", c.base_shift, source);
    c.max_shift = get_double(j, "max_shift", c.max_shift, source);
    c.base_image_seq_len = get_int(j, "base_image_seq_len", c.base_image_seq_len, source);
    c.max_image_seq_len = get_int(j, "max_image_seq_len", c.max_image_seq_len, source);
    c.invert_sigmas = get_bool(j, "invert_sigmas", c.invert_sigmas, source);
    c.shift_terminal = get_optional_double(j, "shift_terminal", source);
    if (c.shift_terminal && *c.shift_terminal == 0.0) c.shift_terminal.reset();  // diffusers: falsy = off
    const std::string shift_type = get_string(j, "time_shift_type", "exponential", source);
    DTUNE_CHECK_AS(UsageError, shift_type == "exponential" || shift_type == "linear", source,
                   ": time_shift_type \"", shift_type, "\" must be exponential or linear");
    c.time_shift_type = shift_type == "linear" ? TimeShiftType::kLinear : TimeShiftType::kExponential;
    c.stochastic_sampling = get_bool(j, "stochastic_sampling", c.stochastic_sampling, source);
    for (const char* key : {"use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas"})
        DTUNE_CHECK_AS(UsageError, !get_bool(j, key, false, source), source, ": ", key,
                       " is true, which dtune's flow-matching scheduler does not implement; set it false");
    DTUNE_CHECK_AS(UsageError, c.num_train_timesteps >= 1 && c.shift > 0, source,
                   ": num_train_timesteps must be >= 1 and shift > 0");
    DTUNE_CHECK_AS(UsageError, c.max_image_seq_len != c.base_image_seq_len, source,
                   ": base_image_seq_len and max_image_seq_len must differ");
    return c;
}

double flow_match_mu(const FlowMatchConfig& c, int64_t image_seq_len) {
    const double m =
        (c.max_shift - c.base_shift) / static_cast<double>(c.max_image_seq_len - c.base_image_seq_len);
    const double b = c.base_shift - m * static_cast<double>(c.base_image_seq_len);
    return static_cast<double>(image_seq_len) * m + b;
}

double flow_match_shift_sigma(const FlowMatchConfig& c, double sigma, std::optional<double> mu) {
    if (!c.use_dynamic_shifting) return c.shift * sigma / (1.0 + (c.shift - 1.0) * sigma);
    DTUNE_CHECK_AS(UsageError, mu.has_value(),
                   "this flow-matching schedule uses dynamic shifting: mu (from the image size) is required");
    const double r = 1.0 / sigma - 1.0;
    return c.time_shift_type == TimeShiftType::kExponential ? std::exp(*mu) / (std::exp(*mu) + r)
                                                            : *mu / (*mu + r);
}

at::Tensor FlowMatchEulerSampler::training_sigmas(const FlowMatchConfig& c) {
    // diffusers: timesteps = linspace(1, T, T)[::-1] in float32, sigmas = timesteps / T (float32),
    // then the static shift in float32 tensor math.
    const at::Tensor t =
        at::linspace(1, static_cast<double>(c.num_train_timesteps), c.num_train_timesteps, at::kFloat)
            .flip(0);
    at::Tensor s = t / static_cast<float>(c.num_train_timesteps);
    if (!c.use_dynamic_shifting) s = c.shift * s / (1 + (c.shift - 1) * s);
    return s;
}

FlowMatchEulerSampler::FlowMatchEulerSampler(FlowMatchConfig config) : config_(std::move(config)) {
    const at::Tensor s = training_sigmas(config_);
    sigma_max_ = s[0].item<float>();
    sigma_min_ = s[-1].item<float>();
}

void FlowMatchEulerSampler::set_timesteps(int64_t n, const std::optional<std::vector<double>>& custom,
                                          std::optional<double> mu) {
    const auto& c = config_;
    DTUNE_CHECK_AS(UsageError, n >= 1, "num_inference_steps = ", n, " must be at least 1");
    DTUNE_CHECK_AS(UsageError, !custom || static_cast<int64_t>(custom->size()) == n, "got ",
                   custom ? custom->size() : 0, " sigmas for ", n, " steps");
    const double T = static_cast<double>(c.num_train_timesteps);
    std::vector<double> sig(static_cast<size_t>(n));
    if (custom) {
        // Given sigmas: diffusers casts them to float32, and numpy keeps the shift in float32.
        for (int64_t i = 0; i < n; ++i) {
            const float x = static_cast<float>((*custom)[static_cast<size_t>(i)]);
            float y;
            if (!c.use_dynamic_shifting) {
                const auto shift = static_cast<float>(c.shift), shift_m1 = static_cast<float>(c.shift - 1.0);
                y = shift * x / (1.0f + shift_m1 * x);
            } else {
                DTUNE_CHECK_AS(UsageError, mu.has_value(),
                               "this flow-matching schedule uses dynamic shifting: mu (from the image size) "
                               "is required");
                const float r = 1.0f / x - 1.0f;
                const auto e = static_cast<float>(
                    c.time_shift_type == TimeShiftType::kExponential ? std::exp(*mu) : *mu);
                y = e / (e + r);
            }
            sig[static_cast<size_t>(i)] = y;
        }
    } else {
        // np.linspace(sigma_max·T, sigma_min·T, n) / T, shifted, in float64.
        const double a = sigma_max_ * T, b = sigma_min_ * T;
        const double step = n > 1 ? (b - a) / static_cast<double>(n - 1) : 0.0;
        for (int64_t i = 0; i < n; ++i) {
            const double t = n > 1 && i == n - 1 ? b : static_cast<double>(i) * step + a;
            sig[static_cast<size_t>(i)] = flow_match_shift_sigma(c, t / T, mu);
        }
    }
    if (c.shift_terminal) {
        const double scale = (1.0 - sig.back()) / (1.0 - *c.shift_terminal);
        for (double& v : sig) v = 1.0 - (1.0 - v) / scale;
    }
    at::Tensor sigmas = at::empty({n}, at::kFloat);
    for (int64_t i = 0; i < n; ++i) sigmas[i] = static_cast<float>(sig[static_cast<size_t>(i)]);
    at::Tensor timesteps;
    if (c.invert_sigmas) {
        sigmas = 1.0 - sigmas;
        timesteps = sigmas * static_cast<float>(T);
        sigmas = at::cat({sigmas, at::ones({1}, at::kFloat)});
    } else {
        timesteps = sigmas * static_cast<float>(T);
        sigmas = at::cat({sigmas, at::zeros({1}, at::kFloat)});
    }
    timesteps_ = timesteps;
    sigmas_ = sigmas;
}

at::Tensor FlowMatchEulerSampler::step(const at::Tensor& model_output, int64_t i, const at::Tensor& x,
                                       const std::optional<at::Generator>& generator) const {
    DTUNE_CHECK_AS(UsageError, i >= 0 && i < num_steps(), "flow-matching step ", i, " is outside 0..",
                   num_steps() - 1, " (call set_timesteps first)");
    const at::Tensor sample = x.to(at::kFloat);
    const at::Tensor v = model_output.to(at::kFloat);
    const float sigma = sigmas_[i].item<float>(), next = sigmas_[i + 1].item<float>();
    at::Tensor out;
    if (config_.stochastic_sampling) {
        const at::Tensor x0 = sample - sigma * v;
        at::Tensor noise = generator
                               ? at::randn(sample.sizes(), *generator, at::TensorOptions(generator->device()))
                               : at::randn(sample.sizes(), at::TensorOptions(at::kCPU));
        out = (1.0f - next) * x0 + next * noise.to(sample.device());
    } else {
        out = sample + (next - sigma) * v;
    }
    return out.to(model_output.scalar_type());
}

at::Tensor flow_match_noise(const at::Tensor& x0, const at::Tensor& noise, const at::Tensor& sigma) {
    at::Tensor s = sigma.to(x0.device(), at::kFloat);
    if (s.dim() == 1) {
        std::vector<int64_t> shape(static_cast<size_t>(x0.dim()), 1);
        shape[0] = -1;
        s = s.view(shape);
    }
    return ((1 - s) * x0.to(at::kFloat) + s * noise.to(at::kFloat)).to(x0.scalar_type());
}

}  // namespace dtune::diffusion
