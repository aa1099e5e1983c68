// DPM-Solver++ multistep (Lu et al. 2022), orders 1 and 2 ("DPM++ 2M"), midpoint or Heun second-order
// update, optional Karras sigmas ("DPM++ 2M Karras"): diffusers' DPMSolverMultistepScheduler with
// algorithm_type dpmsolver++. It keeps the previous step's data prediction, so steps must run in order.
#pragma once

#include <array>

#include "diffusion/sampler.h"

namespace dtune::diffusion {

class DPMSolverSampler : public Sampler {
  public:
    explicit DPMSolverSampler(const SchedulerConfig& config);

    void set_timesteps(int64_t num_inference_steps) override;
    at::Tensor step(const at::Tensor& model_output, int64_t i, const at::Tensor& x,
                    const std::optional<at::Generator>& generator = std::nullopt) override;

  private:
    float sigma_at(int64_t i) const { return sigmas_[i].item<float>(); }
    at::Tensor data_prediction(const at::Tensor& model_output, const at::Tensor& x, int64_t i) const;
    at::Tensor first_order(const at::Tensor& x0, const at::Tensor& x, int64_t i) const;
    at::Tensor second_order(const at::Tensor& x, int64_t i) const;

    std::array<at::Tensor, 2> history_;  // data predictions of the previous and the current step
    int64_t lower_order_nums_ = 0;       // steps taken so far, capped at solver_order
    int64_t next_step_ = 0;              // the step index step() expects next
};

}  // namespace dtune::diffusion
