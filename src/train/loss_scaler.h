// Dynamic loss scaling for `mixed_precision fp16` (torch.amp.GradScaler's algorithm and defaults).
//
// fp16 gradients underflow below ~6e-8, so the loss is multiplied by `scale` before backward and
// the gradients divided by it before clipping and the optimizer. When any gradient is inf/NaN the
// optimizer step is skipped and the scale shrinks (× backoff_factor); after growth_interval clean
// steps in a row it grows (× growth_factor). Scales are powers of two in practice, so scaling and
// unscaling are exact while nothing overflows: a run with no overflow equals the unscaled run.
//
// Invariant: state() / load_state() round-trip the scale and the clean-step counter exactly
// (checkpointed, so a resumed fp16 run continues with the same scale).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

namespace dtune::train {

struct LossScalerOptions {
    double init_scale = 65536.0;  // 2^16
    double growth_factor = 2.0;
    double backoff_factor = 0.5;
    int64_t growth_interval = 2000;
};

class LossScaler {
  public:
    explicit LossScaler(LossScalerOptions options = {});

    // loss · scale (float32).
    at::Tensor scale_loss(const at::Tensor& loss) const;
    // Divides every defined gradient of `params` by the scale, in place. Returns false when any
    // gradient holds inf or NaN (the step must then be skipped).
    bool unscale(const std::vector<at::Tensor>& params);
    // After the (possibly skipped) step: back off on overflow, grow after growth_interval clean steps.
    void update(bool found_inf);

    double scale() const { return scale_; }
    int64_t growth_tracker() const { return growth_tracker_; }
    int64_t skipped_steps() const { return skipped_; }

    nlohmann::json state() const;
    void load_state(const nlohmann::json& state);

  private:
    LossScalerOptions options_;
    double scale_;
    int64_t growth_tracker_ = 0;
    int64_t skipped_ = 0;
};

}  // namespace dtune::train
