// Exponential moving average of the trainable parameters (SimpleTuner's EMAModel, `use_ema`).
//
// After each optimizer step s (1-based global step), when s % ema_update_interval == 0:
//     shadow <- shadow - (1 - d) · (shadow - param)
// with SimpleTuner's decay schedule d(s):
//     ema_warmup_steps > 0:  d = 0 while s < ema_warmup_steps (a plain copy), then ema_decay;
//     otherwise:             k = s - 1; d = 0 when k <= 0, else min((1 + k) / (10 + k), ema_decay).
// d = 0 is done as an exact copy (the formula would round).
// Shadows are float32 (whatever the parameters' dtype) and live on the CPU (`ema_device cpu`, the
// default) or on the training device (`ema_device accelerator`). A CPU shadow is updated on the CPU
// from a float32 copy of the parameter (SimpleTuner moves it to the accelerator and back unless
// `ema_cpu_only`; the arithmetic is the same formula).
//
// Invariants: state() / load_state() round-trip exactly (resume continues bit for bit); a
// WeightsSwap puts the shadows into the parameters and restores the exact previous values when it
// ends (validation with EMA weights leaves training untouched).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"

namespace dtune::train {

class TrainConfig;

struct EMAOptions {
    double decay = 0.995;                    // ema_decay
    std::optional<int64_t> update_interval;  // ema_update_interval (None: every step)
    int64_t warmup_steps = 0;                // ema_warmup_steps
    bool on_cpu = true;                      // ema_device cpu (else the parameters' device)
    bool foreach = true;                     // !ema_foreach_disable
};

// From use_ema's companions: ema_decay, ema_device, ema_cpu_only, ema_update_interval,
// ema_warmup_steps, ema_foreach_disable (UsageError for out-of-range values).
EMAOptions ema_options_from(const TrainConfig& config);

class EMAModel {
  public:
    // Shadows start as float32 copies of `params` (names are kept for files and errors).
    EMAModel(io::TensorList params, EMAOptions options);

    // SimpleTuner's decay for global step `step` (see the file comment).
    double decay_at(int64_t step) const;
    // After the optimizer step that made global step `step`; false when the interval skips it.
    bool step(int64_t step);

    const io::TensorList& shadows() const { return shadows_; }
    const io::TensorList& params() const { return params_; }
    int64_t optimization_step() const { return optimization_step_; }
    double last_decay() const { return last_decay_; }

    // The counters and settings for checkpoints (the tensors are shadows()).
    nlohmann::json state() const;
    // Restores shadows (by name; a missing or mis-shaped one is a DataError naming `where`) and state.
    void load(const io::TensorList& shadows, const nlohmann::json& state, const std::string& where);

    // Writes the shadows into the parameters (converted to their dtype/device).
    void copy_to_params() const;

  private:
    io::TensorList params_;
    io::TensorList shadows_;
    EMAOptions options_;
    int64_t optimization_step_ = 0;
    double last_decay_ = 0;
};

// Swaps EMA weights into the model for its lifetime and puts the trained weights back afterwards.
// Default-constructed (no EMA): does nothing. Movable, not copyable.
class EMAWeightsGuard {
  public:
    EMAWeightsGuard() = default;
    explicit EMAWeightsGuard(const EMAModel& ema);
    ~EMAWeightsGuard();
    EMAWeightsGuard(EMAWeightsGuard&& other) noexcept;
    EMAWeightsGuard& operator=(EMAWeightsGuard&& other) noexcept;
    EMAWeightsGuard(const EMAWeightsGuard&) = delete;
    EMAWeightsGuard& operator=(const EMAWeightsGuard&) = delete;

    bool active() const { return !saved_.empty(); }

  private:
    void restore() noexcept;

    std::vector<at::Tensor> params_;
    std::vector<at::Tensor> saved_;  // the trained values, restored at the end
};

}  // namespace dtune::train
