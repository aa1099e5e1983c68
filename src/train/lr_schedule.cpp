// LR schedules (see lr_schedule.h). The formulas are diffusers.optimization's lambdas and SimpleTuner's
// Sine.get_lr, evaluated in double like Python floats.
#include "train/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace dtune::train {

LRScheduleType parse_lr_schedule(const std::string& name, int64_t warmup_steps) {
    if (name == "constant")
        return warmup_steps > 0 ? LRScheduleType::kConstantWithWarmup : LRScheduleType::kConstant;
    if (name == "constant_with_warmup") return LRScheduleType::kConstantWithWarmup;
    if (name == "linear") return LRScheduleType::kLinear;
    if (name == "cosine" || name == "cosine_with_warmup") return LRScheduleType::kCosine;
    if (name == "cosine_with_restarts") return LRScheduleType::kCosineWithRestarts;
    if (name == "polynomial") return LRScheduleType::kPolynomial;
    if (name == "sine") return LRScheduleType::kSine;
    throw UsageError(str("lr_scheduler \"", name,
                         "\" is not supported; use constant, constant_with_warmup, linear, cosine, "
                         "cosine_with_restarts, polynomial or sine"));
}

const char* to_string(LRScheduleType type) {
    switch (type) {
        case LRScheduleType::kConstant: return "constant";
        case LRScheduleType::kConstantWithWarmup: return "constant_with_warmup";
        case LRScheduleType::kLinear: return "linear";
        case LRScheduleType::kCosine: return "cosine";
        case LRScheduleType::kCosineWithRestarts: return "cosine_with_restarts";
        case LRScheduleType::kPolynomial: return "polynomial";
        case LRScheduleType::kSine: return "sine";
    }
    return "?";
}

LRSchedule::LRSchedule(const LRScheduleOptions& o) : options_(o) {
    const char* name = to_string(o.type);
    DTUNE_CHECK_AS(UsageError, o.warmup_steps >= 0, "lr_warmup_steps is ", o.warmup_steps,
                   "; it must be >= 0");
    const bool needs_total = o.type == LRScheduleType::kLinear || o.type == LRScheduleType::kCosine ||
                             o.type == LRScheduleType::kCosineWithRestarts ||
                             o.type == LRScheduleType::kPolynomial;
    DTUNE_CHECK_AS(UsageError, !needs_total || o.training_steps > 0, "lr_scheduler ", name,
                   " needs the total number of training steps; set max_train_steps (or num_train_epochs)");
    if (o.type == LRScheduleType::kPolynomial) {
        DTUNE_CHECK_AS(UsageError, o.base_lr > o.lr_end, "lr_end (", o.lr_end,
                       ") must be smaller than learning_rate (", o.base_lr,
                       ") for the polynomial schedule; lower lr_end");
    }
    if (o.type == LRScheduleType::kSine) {
        // SimpleTuner uses the warmup length as the sine's half-period and has no default for it.
        DTUNE_CHECK_AS(
            UsageError, o.warmup_steps > 0,
            "lr_scheduler sine uses lr_warmup_steps as its period and needs it > 0; set lr_warmup_steps");
    }
}

double LRSchedule::lambda(int64_t step) const {
    const auto& o = options_;
    const double s = static_cast<double>(step);
    const double w = static_cast<double>(o.warmup_steps);
    if (o.type == LRScheduleType::kConstant) return 1.0;
    if (step < o.warmup_steps) return s / std::max(1.0, w);
    const double total = static_cast<double>(o.training_steps);
    const double progress = (s - w) / std::max(1.0, total - w);
    switch (o.type) {
        case LRScheduleType::kConstantWithWarmup: return 1.0;
        case LRScheduleType::kLinear: return std::max(0.0, (total - s) / std::max(1.0, total - w));
        case LRScheduleType::kCosine: {
            const double cycles = o.num_cycles.value_or(0.5);
            return std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * cycles * 2.0 * progress)));
        }
        case LRScheduleType::kCosineWithRestarts: {
            if (progress >= 1.0) return 0.0;
            const double cycles = o.num_cycles.value_or(1.0);
            return std::max(0.0,
                            0.5 * (1.0 + std::cos(std::numbers::pi * std::fmod(cycles * progress, 1.0))));
        }
        case LRScheduleType::kPolynomial: {
            if (step > o.training_steps) return o.lr_end / o.base_lr;
            const double remaining = 1.0 - (s - w) / (total - w);
            return ((o.base_lr - o.lr_end) * std::pow(remaining, o.power) + o.lr_end) / o.base_lr;
        }
        default: break;
    }
    DTUNE_FAIL("unreachable LR schedule ", to_string(o.type));
}

double LRSchedule::lr(int64_t step) const {
    const auto& o = options_;
    if (o.type != LRScheduleType::kSine) return o.base_lr * lambda(step);
    // SimpleTuner's Sine: a continuous wave of period 2 x warmup between lr_end and learning_rate, no
    // warmup ramp, truncated to 1e-9 as it writes it into the optimizer.
    const double wave =
        0.5 *
        (1.0 + std::sin(std::numbers::pi * static_cast<double>(step) / static_cast<double>(o.warmup_steps)));
    return std::floor((o.lr_end + (o.base_lr - o.lr_end) * wave) * 1e9) / 1e9;
}

double LRSchedule::multiplier(int64_t step) const {
    return options_.base_lr != 0 ? lr(step) / options_.base_lr : 0.0;
}

}  // namespace dtune::train
