// UniPC (Zhao et al. 2023) multistep predictor-corrector in data-prediction form, orders 1 and 2,
// B(h) variants bh1/bh2: diffusers' UniPCMultistepScheduler (predict_x0, no disabled correctors, no
// solver_p). Each step first corrects the incoming sample with the new model output (UniC), then
// predicts the next one (UniP); steps must run in order.
#pragma once

#include <array>

#include "diffusion/sampler.h"

namespace dtune::diffusion {

class UniPCSampler : public Sampler {
  public:
    explicit UniPCSampler(const SchedulerConfig& config);

    void set_timesteps(int64_t num_inference_steps) override;
    at::Tensor step(const at::Tensor& model_output, int64_t i, const at::Tensor& x,
                    const std::optional<at::Generator>& generator = std::nullopt) override;

  private:
    float sigma_at(int64_t i) const { return sigmas_[i].item<float>(); }
    float b_of_h(float hh) const;
    // UniC: recomputes the sample at step i from last_sample_ with the model's new prediction (the
    // predictor's result is replaced, not refined, as in diffusers).
    at::Tensor correct(const at::Tensor& x0_now, int64_t i) const;
    // UniP: from x at step i to step i + 1.
    at::Tensor predict(const at::Tensor& x, int64_t i, int64_t order) const;

    std::array<at::Tensor, 2> history_;  // data predictions: [0] older, [1] newest
    at::Tensor last_sample_;             // the (corrected) sample the last prediction started from
    int64_t this_order_ = 0;             // order of the last prediction; the next correction uses it
    int64_t lower_order_nums_ = 0;
    int64_t next_step_ = 0;
};

}  // namespace dtune::diffusion
