// EMA of the trainable parameters (see ema.h).
#include "train/ema.h"

#include <algorithm>
#include <map>

#include "core/error.h"
#include "train/config.h"

namespace dtune::train {

EMAOptions ema_options_from(const TrainConfig& config) {
    EMAOptions o;
    o.decay = config.real("ema_decay");
    DTUNE_CHECK_AS(UsageError, o.decay >= 0 && o.decay < 1, "ema_decay = ", o.decay,
                   " must be in [0, 1); 0.995 (SimpleTuner's default) to 0.9999 are usual");
    o.update_interval = config.opt_integer("ema_update_interval");
    DTUNE_CHECK_AS(UsageError, !o.update_interval || *o.update_interval >= 1,
                   "ema_update_interval = ", o.update_interval.value_or(0),
                   " must be at least 1 (or unset: every step)");
    o.warmup_steps = config.integer("ema_warmup_steps");
    DTUNE_CHECK_AS(UsageError, o.warmup_steps >= 0, "ema_warmup_steps = ", o.warmup_steps, " must be >= 0");
    o.on_cpu = config.text("ema_device") == "cpu" || config.flag("ema_cpu_only");
    o.foreach = !config.flag("ema_foreach_disable");
    return o;
}

EMAModel::EMAModel(io::TensorList params, EMAOptions options)
    : params_(std::move(params)), options_(options) {
    at::NoGradGuard no_grad;
    for (const auto& [name, p] : params_) {
        const c10::Device device = options_.on_cpu ? c10::Device(c10::kCPU) : p.device();
        shadows_.emplace_back(name, p.detach().to(device, at::kFloat, /*non_blocking=*/false, /*copy=*/true));
    }
}

double EMAModel::decay_at(int64_t step) const {
    if (options_.warmup_steps > 0) return step < options_.warmup_steps ? 0.0 : options_.decay;
    const double k = static_cast<double>(std::max<int64_t>(0, step - 1));
    if (k <= 0) return 0.0;
    return std::min((1 + k) / (10 + k), options_.decay);
}

bool EMAModel::step(int64_t step) {
    if (options_.update_interval && step % *options_.update_interval != 0) return false;
    optimization_step_ = step;
    last_decay_ = decay_at(step);
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> shadows, targets;  // float32 copies of the parameters next to the shadows
    for (std::size_t i = 0; i < params_.size(); ++i) {
        shadows.push_back(shadows_[i].second);
        targets.push_back(params_[i].second.detach().to(shadows_[i].second.device(), at::kFloat));
    }
    if (last_decay_ == 0.0) {
        for (std::size_t i = 0; i < shadows.size(); ++i) shadows[i].copy_(targets[i]);
        return true;
    }
    const double one_minus = 1.0 - last_decay_;
    if (options_.foreach) {
        at::_foreach_sub_(shadows, at::_foreach_sub(shadows, targets), one_minus);  // s -= (1-d)(s-p)
    } else {
        for (std::size_t i = 0; i < shadows.size(); ++i) shadows[i].sub_(shadows[i] - targets[i], one_minus);
    }
    return true;
}

nlohmann::json EMAModel::state() const {
    return {{"optimization_step", optimization_step_},
            {"last_decay", last_decay_},
            {"decay", options_.decay},
            {"warmup_steps", options_.warmup_steps},
            {"parameters", shadows_.size()}};
}

void EMAModel::load(const io::TensorList& shadows, const nlohmann::json& state, const std::string& where) {
    std::map<std::string, at::Tensor> by_name(shadows.begin(), shadows.end());
    at::NoGradGuard no_grad;
    for (auto& [name, s] : shadows_) {
        auto it = by_name.find(name);
        DTUNE_CHECK_AS(DataError, it != by_name.end(), where, " has no EMA weight ", name,
                       "; it was written without use_ema or for another model_type; set use_ema false or "
                       "resume from a checkpoint of this run");
        DTUNE_CHECK_AS(DataError, it->second.sizes() == s.sizes(), where, ": EMA weight ", name, " is ",
                       it->second.sizes(), " but the model's is ", s.sizes());
        s.copy_(it->second);
    }
    optimization_step_ = state.value("optimization_step", int64_t{0});
    last_decay_ = state.value("last_decay", 0.0);
}

void EMAModel::copy_to_params() const {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params_.size(); ++i) params_[i].second.copy_(shadows_[i].second);
}

EMAWeightsGuard::EMAWeightsGuard(const EMAModel& ema) {
    at::NoGradGuard no_grad;
    for (const auto& [_, p] : ema.params()) {
        params_.push_back(p);
        // On the CPU: a full fine-tune's copy would otherwise double the UNet on the GPU.
        saved_.push_back(p.detach().to(c10::Device(c10::kCPU), p.scalar_type(), false, /*copy=*/true));
    }
    ema.copy_to_params();
}

EMAWeightsGuard::~EMAWeightsGuard() {
    restore();
}

EMAWeightsGuard::EMAWeightsGuard(EMAWeightsGuard&& other) noexcept
    : params_(std::move(other.params_)), saved_(std::move(other.saved_)) {
    other.params_.clear();
    other.saved_.clear();
}

EMAWeightsGuard& EMAWeightsGuard::operator=(EMAWeightsGuard&& other) noexcept {
    if (this != &other) {
        restore();
        params_ = std::move(other.params_);
        saved_ = std::move(other.saved_);
        other.params_.clear();
        other.saved_.clear();
    }
    return *this;
}

void EMAWeightsGuard::restore() noexcept {
    if (saved_.empty()) return;
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params_.size(); ++i) params_[i].copy_(saved_[i]);
    params_.clear();
    saved_.clear();
}

}  // namespace dtune::train
