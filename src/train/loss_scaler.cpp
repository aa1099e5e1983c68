// Dynamic loss scaling (see loss_scaler.h).
#include "train/loss_scaler.h"

#include <map>
#include <utility>

#include "core/error.h"

namespace dtune::train {

LossScaler::LossScaler(LossScalerOptions options) : options_(options), scale_(options.init_scale) {
    DTUNE_CHECK_AS(UsageError,
                   options_.init_scale > 0 && options_.growth_factor > 1 && options_.backoff_factor > 0 &&
                       options_.backoff_factor < 1 && options_.growth_interval >= 1,
                   "loss scaler: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                   "growth_interval >= 1");
}

at::Tensor LossScaler::scale_loss(const at::Tensor& loss) const {
    return loss.to(at::kFloat) * scale_;
}

bool LossScaler::unscale(const std::vector<at::Tensor>& params) {
    // One fused kernel per (device, dtype) group, as GradScaler does: it multiplies by 1/scale and
    // sets found_inf when any element is not finite, without a host sync per tensor.
    std::map<std::pair<std::string, c10::ScalarType>, std::vector<at::Tensor>> groups;
    for (const auto& p : params) {
        const at::Tensor& g = p.grad();
        if (g.defined()) groups[{g.device().str(), g.scalar_type()}].push_back(g);
    }
    bool finite = true;
    for (auto& [key, grads] : groups) {
        const auto opts = at::TensorOptions().dtype(at::kFloat).device(grads.front().device());
        at::Tensor found_inf = at::zeros({1}, opts);
        const at::Tensor inv_scale = at::full({1}, 1.0 / scale_, opts);
        at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
        if (found_inf.item<float>() != 0.0f) finite = false;
    }
    return finite;
}

void LossScaler::update(bool found_inf) {
    if (found_inf) {
        scale_ *= options_.backoff_factor;
        growth_tracker_ = 0;
        ++skipped_;
        return;
    }
    if (++growth_tracker_ == options_.growth_interval) {
        scale_ *= options_.growth_factor;
        growth_tracker_ = 0;
    }
}

nlohmann::json LossScaler::state() const {
    return {{"scale", scale_},
            {"growth_tracker", growth_tracker_},
            {"skipped_steps", skipped_},
            {"growth_factor", options_.growth_factor},
            {"backoff_factor", options_.backoff_factor},
            {"growth_interval", options_.growth_interval}};
}

void LossScaler::load_state(const nlohmann::json& state) {
    scale_ = state.at("scale").get<double>();
    growth_tracker_ = state.at("growth_tracker").get<int64_t>();
    skipped_ = state.value("skipped_steps", int64_t{0});
}

}  // namespace dtune::train
