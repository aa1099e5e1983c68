// Dynamic loss scaling on the device (see loss_scaler.h).
#include "train/loss_scaler.h"

#include <ATen/core/grad_mode.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <utility>

#include "core/error.h"

namespace dtune::train {

LossScaler::LossScaler(LossScalerOptions options, c10::Device device) : options_(options) {
    DTUNE_CHECK_AS(UsageError,
                   options_.init_scale > 0 && options_.growth_factor > 1 && options_.backoff_factor > 0 &&
                       options_.backoff_factor < 1 && options_.growth_interval >= 1,
                   "loss scaler: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                   "growth_interval >= 1");
    const auto on = at::TensorOptions().device(device);
    scale_ = at::full({}, options_.init_scale, on.dtype(at::kFloat));
    growth_tracker_ = at::zeros({}, on.dtype(at::kInt));
    found_inf_ = at::zeros({}, on.dtype(at::kFloat));
    skipped_ = at::zeros({}, on.dtype(at::kLong));
}

at::Tensor LossScaler::scale_loss(const at::Tensor& loss) const {
    return loss.to(at::kFloat) * scale_;
}

void LossScaler::unscale(const std::vector<at::Tensor>& params) {
    at::NoGradGuard no_grad;
    // One fused kernel per (device, dtype) group, as GradScaler does: it multiplies by 1/scale and
    // sets the group's flag when any element is not finite.
    std::map<std::pair<std::string, c10::ScalarType>, std::vector<at::Tensor>> groups;
    for (const auto& p : params) {
        const at::Tensor& g = p.grad();
        if (g.defined()) groups[{g.device().str(), g.scalar_type()}].push_back(g);
    }
    found_inf_.zero_();
    // GradScaler's reciprocal: in float64, then float32 (exact for the powers of two used here).
    const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
    for (auto& [key, grads] : groups) {
        const c10::Device device = grads.front().device();
        // ATen's CUDA kernel takes float32 and float16 only: bfloat16 gradients go by their norms.
        const bool by_norms = device.is_cuda() && key.second == at::kBFloat16;
        if (device == found_inf_.device()) {
            if (by_norms)
                check_and_unscale_by_norms(grads, found_inf_, inv_scale);
            else
                at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf_, inv_scale);
            continue;
        }
        // Gradients on another device (not in the trainer's runs): their own flag, folded in.
        at::Tensor flag = at::zeros({}, found_inf_.options().device(device));
        if (by_norms)
            check_and_unscale_by_norms(grads, flag, inv_scale.to(device));
        else
            at::_amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale.to(device));
        found_inf_.copy_(at::maximum(found_inf_, flag.to(found_inf_.device())));
    }
}

at::Tensor LossScaler::update() {
    at::NoGradGuard no_grad;
    skipped_.add_(found_inf_.to(at::kLong));
    // The scale this step used, before the update moves it.
    at::Tensor out =
        at::stack({found_inf_.to(at::kDouble), scale_.to(at::kDouble), skipped_.to(at::kDouble)});
    at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, options_.growth_factor,
                           options_.backoff_factor, options_.growth_interval);
    return out;  // [3] float64
}

bool LossScaler::overflowed() const {
    return found_inf_.item<float>() != 0.0f;
}

void LossScaler::set_overflowed(bool found_inf) {
    found_inf_.fill_(found_inf ? 1.0 : 0.0);
}

double LossScaler::scale() const {
    return scale_.item<double>();
}

int64_t LossScaler::growth_tracker() const {
    return growth_tracker_.item<int64_t>();
}

int64_t LossScaler::skipped_steps() const {
    return skipped_.item<int64_t>();
}

nlohmann::json LossScaler::state() const {
    return {{"scale", scale()},
            {"growth_tracker", growth_tracker()},
            {"skipped_steps", skipped_steps()},
            {"growth_factor", options_.growth_factor},
            {"backoff_factor", options_.backoff_factor},
            {"growth_interval", options_.growth_interval}};
}

void LossScaler::load_state(const nlohmann::json& state) {
    const double scale = state.at("scale").get<double>();
    DTUNE_CHECK_AS(DataError, std::isfinite(scale) && scale > 0, "loss scaler state: scale ", scale,
                   " is not a positive finite number; the file is damaged: restore it or resume from an "
                   "earlier checkpoint");
    scale_.fill_(scale);
    growth_tracker_.fill_(state.at("growth_tracker").get<int64_t>());
    skipped_.fill_(state.value("skipped_steps", int64_t{0}));
    found_inf_.zero_();
}

void check_and_unscale_by_norms(const std::vector<at::Tensor>& grads, at::Tensor& found_inf,
                                const at::Tensor& inv_scale) {
    if (grads.empty()) return;
    at::NoGradGuard no_grad;
    // Checked before the multiply, as the fused kernel does (a finite value times inv_scale > 1
    // could overflow only after it).
    const std::vector<at::Tensor> norms = at::_foreach_norm(grads, std::numeric_limits<double>::infinity());
    const at::Tensor bad = at::stack(norms).isfinite().logical_not().any().to(found_inf.scalar_type());
    found_inf.copy_(at::maximum(found_inf, bad));
    at::_foreach_mul_(grads, inv_scale);
}

}  // namespace dtune::train
