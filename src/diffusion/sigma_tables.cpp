// NumPy-faithful timestep and sigma tables (see sigma_tables.h).
#include "diffusion/sigma_tables.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace dtune::diffusion::detail {

std::vector<double> np_linspace(double start, double stop, int64_t num) {
    std::vector<double> out(static_cast<size_t>(std::max<int64_t>(num, 0)));
    if (num == 1) out[0] = start;
    if (num <= 1) return out;
    const double step = (stop - start) / static_cast<double>(num - 1);
    for (int64_t i = 0; i < num; ++i) out[static_cast<size_t>(i)] = static_cast<double>(i) * step + start;
    out.back() = stop;
    return out;
}

std::vector<double> np_arange(double start, double stop, double step) {
    const double len = std::ceil((stop - start) / step);
    std::vector<double> out;
    if (!(len > 0)) return out;
    const auto n = static_cast<int64_t>(len);
    const double delta = (start + step) - start;
    out.reserve(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out.push_back(start + static_cast<double>(i) * delta);
    return out;
}

double np_round(double x) {
    // nearbyint under the default rounding mode (to nearest, ties to even) is np.round's rule.
    return std::nearbyint(x);
}

double np_interp_index(double x, const std::vector<double>& fp) {
    const auto n = static_cast<int64_t>(fp.size());
    if (x <= 0) return fp.front();
    if (x >= static_cast<double>(n - 1)) return fp.back();
    const auto j = static_cast<int64_t>(std::floor(x));
    const double slope = fp[static_cast<size_t>(j + 1)] - fp[static_cast<size_t>(j)];  // dx = 1
    return slope * (x - static_cast<double>(j)) + fp[static_cast<size_t>(j)];
}

std::vector<double> spaced_timesteps(TimestepSpacing spacing, int64_t num_train, int64_t n,
                                     int64_t steps_offset, bool round_linspace) {
    DTUNE_CHECK_AS(UsageError, n >= 1 && n <= num_train, "number of inference steps is ", n,
                   "; it must be between 1 and num_train_timesteps (", num_train, ")");
    std::vector<double> t;
    switch (spacing) {
        case TimestepSpacing::kLinspace:
            t = np_linspace(0, static_cast<double>(num_train - 1), n);
            if (round_linspace) {
                for (double& v : t) v = np_round(v);
            } else {
                for (double& v : t) v = static_cast<float>(v);  // Euler: np.linspace(dtype=float32)
            }
            std::reverse(t.begin(), t.end());
            break;
        case TimestepSpacing::kLeading: {
            const int64_t ratio = num_train / n;
            for (int64_t i = n - 1; i >= 0; --i) t.push_back(static_cast<double>(i * ratio + steps_offset));
            break;
        }
        case TimestepSpacing::kTrailing: {
            const double ratio = static_cast<double>(num_train) / static_cast<double>(n);
            for (double v : np_arange(static_cast<double>(num_train), 0.0, -ratio))
                t.push_back(np_round(v) - 1);
            break;
        }
    }
    return t;
}

std::vector<double> multistep_timesteps(TimestepSpacing spacing, int64_t num_train, int64_t last, int64_t n,
                                        int64_t steps_offset) {
    DTUNE_CHECK_AS(UsageError, n >= 1 && n <= num_train, "number of inference steps is ", n,
                   "; it must be between 1 and num_train_timesteps (", num_train, ")");
    std::vector<double> t;
    switch (spacing) {
        case TimestepSpacing::kLinspace: {
            const auto v = np_linspace(0, static_cast<double>(last - 1), n + 1);
            for (int64_t k = n; k >= 1; --k) t.push_back(np_round(v[static_cast<size_t>(k)]));
            break;
        }
        case TimestepSpacing::kLeading: {
            const int64_t ratio = last / (n + 1);
            for (int64_t k = n; k >= 1; --k) t.push_back(static_cast<double>(k * ratio + steps_offset));
            break;
        }
        case TimestepSpacing::kTrailing: {
            const double ratio = static_cast<double>(num_train) / static_cast<double>(n);
            for (double v : np_arange(static_cast<double>(last), 0.0, -ratio)) t.push_back(np_round(v) - 1);
            break;
        }
    }
    return t;
}

std::vector<double> train_sigmas(const at::Tensor& alphas_cumprod) {
    const at::Tensor s = ((1 - alphas_cumprod) / alphas_cumprod).pow(0.5).contiguous();  // [T] float32
    const float* p = s.data_ptr<float>();
    return std::vector<double>(p, p + s.numel());
}

std::vector<double> log_of_float(const std::vector<double>& sigmas) {
    std::vector<double> out;
    out.reserve(sigmas.size());
    for (double s : sigmas) out.push_back(std::log(static_cast<float>(s)));  // float32 log, as np.log(f32)
    return out;
}

std::vector<double> karras_sigmas(double sigma_min, double sigma_max, int64_t n) {
    constexpr double kRho = 7.0;
    const double min_inv = std::pow(sigma_min, 1.0 / kRho);
    const double max_inv = std::pow(sigma_max, 1.0 / kRho);
    std::vector<double> out;
    for (double r : np_linspace(0, 1, n)) out.push_back(std::pow(max_inv + r * (min_inv - max_inv), kRho));
    return out;
}

double sigma_to_t(double sigma, const std::vector<double>& log_sigmas) {
    const double log_sigma = std::log(std::max(sigma, 1e-10));
    const auto n = static_cast<int64_t>(log_sigmas.size());
    // diffusers: the last index whose log-sigma is <= log_sigma (0 if none), clipped to n - 2.
    int64_t count = 0;
    for (double ls : log_sigmas) count += (log_sigma - ls >= 0) ? 1 : 0;
    // cumsum(...).argmax() is the first index reaching the maximum count: with a monotone table that
    // is count - 1, and 0 when no entry qualifies.
    int64_t low = 0;
    if (count > 0) {
        int64_t running = 0;
        for (int64_t j = 0; j < n; ++j) {
            running += (log_sigma - log_sigmas[static_cast<size_t>(j)] >= 0) ? 1 : 0;
            if (running == count) {
                low = j;
                break;
            }
        }
    }
    low = std::min(low, n - 2);
    const double lo = log_sigmas[static_cast<size_t>(low)];
    const double hi = log_sigmas[static_cast<size_t>(low + 1)];
    const double w = std::clamp((lo - log_sigma) / (lo - hi), 0.0, 1.0);
    return (1 - w) * static_cast<double>(low) + w * static_cast<double>(low + 1);
}

at::Tensor to_float_tensor(const std::vector<double>& values) {
    std::vector<float> f(values.begin(), values.end());
    return at::tensor(f, at::kFloat);
}

}  // namespace dtune::diffusion::detail
