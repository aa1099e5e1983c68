// Dynamic loss scaling for `mixed_precision fp16` (torch.amp.GradScaler's algorithm and defaults),
// kept on the device so that a step never waits for the host and a CUDA graph can capture it.
//
// fp16 gradients underflow below ~6e-8, so the loss is multiplied by `scale` before backward and
// the gradients divided by it before clipping and the optimizer. When any gradient is inf/NaN the
// optimizer step is skipped and the scale shrinks (× backoff_factor); after growth_interval clean
// steps in a row it grows (× growth_factor). Scales are powers of two in practice, so scaling and
// unscaling are exact while nothing overflows: a run with no overflow equals the unscaled run.
//
// Where things live: the scale (float32), the clean-step counter (int32), the overflow flag
// found_inf (float32, exactly 0 or 1) and the skipped-step count (int64) are 0-dim tensors on the
// parameters' device. unscale() writes found_inf with one multi-tensor kernel per gradient dtype;
// an optimizer that honours it (Optimizer::skip_step_on_overflow: every optimizer but
// CpuOffloadOptimizer) skips its update on
// the device, and update() moves the scale with at::_amp_update_scale_. Nothing is read back:
// update() returns this step's [found_inf, scale, skipped] for the trainer's deferred read-back
// (readback.h), which logs them a step later. The same calls run on the CPU (ATen has CPU kernels
// for both _amp_ ops), so the eager, graphed and CPU steps share one definition.
//
// Invariant: state() / load_state() round-trip the scale, the clean-step counter and the skipped
// count exactly (checkpointed, so a resumed fp16 run continues with the same scale).
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
    explicit LossScaler(LossScalerOptions options = {}, c10::Device device = c10::Device(c10::kCPU));

    // loss · scale (float32), on the device: no host read, capturable.
    at::Tensor scale_loss(const at::Tensor& loss) const;
    // Divides every defined gradient of `params` by the scale, in place, and sets found_inf() to 1
    // when any of them holds inf or NaN (0 otherwise). No host read; capturable.
    void unscale(const std::vector<at::Tensor>& params);
    // After the (possibly skipped) optimizer step, on the device: counts a skipped step, backs off
    // on overflow, grows after growth_interval clean steps in a row. Returns [found_inf, the scale
    // this step's loss was multiplied by, skipped steps so far] as a new float64 [3] tensor on the
    // device, for a deferred read-back.
    at::Tensor update();

    // The flag unscale() writes: [] float32 on the device, at a fixed address for the run (an
    // optimizer and a captured graph keep pointing at it).
    const at::Tensor& found_inf() const { return found_inf_; }
    // Reads found_inf on the host (a wait for the device): for optimizers that cannot skip on the
    // device, and ZeRO-2's agreement of the ranks.
    bool overflowed() const;
    // Sets found_inf (ZeRO-2: after the ranks agreed that one of them overflowed).
    void set_overflowed(bool found_inf);

    // Host reads of the device state (tests, checkpoints, logs): each waits for the device.
    double scale() const;
    int64_t growth_tracker() const;
    int64_t skipped_steps() const;
    const LossScalerOptions& options() const { return options_; }

    nlohmann::json state() const;
    void load_state(const nlohmann::json& state);

  private:
    LossScalerOptions options_;
    at::Tensor scale_;           // [] float32
    at::Tensor growth_tracker_;  // [] int32: clean steps in a row since the last change
    at::Tensor found_inf_;       // [] float32: 1 when the last unscale() saw inf/NaN
    at::Tensor skipped_;         // [] int64: optimizer steps skipped so far
};

// found_inf = max(found_inf, 1 if any element of `grads` is not finite), then grads *= inv_scale,
// like at::_amp_foreach_non_finite_check_and_unscale_ but for dtypes its CUDA kernel lacks
// (bfloat16: adamw_bf16's full fine-tunes keep bf16 gradients): per-tensor max-abs norms (NaN and
// inf carry through), one multi-tensor multiply. No host read, so a CUDA graph can hold it.
void check_and_unscale_by_norms(const std::vector<at::Tensor>& grads, at::Tensor& found_inf,
                                const at::Tensor& inv_scale);

}  // namespace dtune::train
