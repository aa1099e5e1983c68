// Learning-rate schedules: diffusers' get_scheduler curves (constant, constant_with_warmup, linear,
// cosine, cosine_with_restarts, polynomial) and SimpleTuner's `sine`. A schedule is a pure function of
// the optimizer step, so resuming needs only the step count. Torch-free.
//
// Convention (as torch's LambdaLR): lr(k) is the rate used by the k-th optimizer step, k = 0, 1, ...
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace dtune::train {

enum class LRScheduleType {
    kConstant,
    kConstantWithWarmup,
    kLinear,
    kCosine,
    kCosineWithRestarts,
    kPolynomial,
    kSine
};

// SimpleTuner's names: "constant" with warmup > 0 becomes constant_with_warmup, "cosine_with_warmup"
// is cosine. Throws UsageError listing the supported names.
LRScheduleType parse_lr_schedule(const std::string& name, int64_t warmup_steps);
const char* to_string(LRScheduleType type);

struct LRScheduleOptions {
    LRScheduleType type = LRScheduleType::kConstantWithWarmup;  // SimpleTuner's lr_scheduler default
    double base_lr = 4e-7;                                      // learning_rate
    int64_t warmup_steps = 0;                                   // lr_warmup_steps (x num_processes)
    int64_t training_steps = 0;                                 // max_train_steps (x num_processes)
    // lr_num_cycles; unset: diffusers' function defaults (cosine 0.5 = half a wave, restarts 1).
    std::optional<double> num_cycles;
    double lr_end = 4e-7;  // lr_end: polynomial's floor and sine's eta_min
    double power = 0.8;    // lr_power (SimpleTuner's default; diffusers' is 1.0)
};

class LRSchedule {
  public:
    // Validates the options for the type (training_steps > 0 where the curve needs it, lr_end < base_lr
    // for polynomial, warmup > 0 for sine, whose period is the warmup length).
    explicit LRSchedule(const LRScheduleOptions& options);

    const LRScheduleOptions& options() const { return options_; }
    // The learning rate at optimizer step `step`.
    double lr(int64_t step) const;
    // lr(step) / base_lr: what to scale other parameter groups' base rates by.
    double multiplier(int64_t step) const;

  private:
    double lambda(int64_t step) const;  // the LambdaLR factor for the diffusers curves

    LRScheduleOptions options_;
};

}  // namespace dtune::train
