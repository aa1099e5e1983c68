// Eval loss on `dataset_type: eval` datasets (SIMPLETUNER.md §9): each eval image is noised at
// eval_timesteps fixed timesteps (the training scheduler's trailing set_timesteps) with noise from
// a generator reseeded to 0 for every image and timestep, and the loss is the mean over images and
// timesteps. Logged to output_dir/eval.jsonl (and TensorBoard eval/loss) every eval_steps_interval
// steps (validation_step_interval when unset) and at the end.
//
// A flow-matching family (Flux) is scored as SimpleTuner scores it: the fixed timesteps are the
// training scheduler's set_timesteps(eval_timesteps) (the model folder's FlowMatchEulerDiscreteScheduler
// with shift = flow_schedule_shift and sigmas from 1 to 1/T; with dynamic shifting, mu from each
// image's token count), each image gets one noise draw (a generator seeded 0) reused at every
// timestep, x = (1 - sigma) x0 + sigma noise with sigma = t / T, and the loss is the MSE against
// noise - x0, as the flow-matching training step computes it.
//
// Invariants: the same weights give the same eval loss, bit for bit on the CPU; the pass runs under
// no-grad with the model in eval mode and its own generators, so it never changes training. Eval
// latents use the VAE posterior mean and prompts the family's text encoders (no CFG).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "diffusion/flow_match.h"
#include "diffusion/loss.h"
#include "diffusion/noise_schedule.h"
#include "train/callbacks.h"
#include "train/config.h"
#include "train/run_logs.h"

namespace dtune::family {
class Denoiser;
struct TrainingObjective;
}  // namespace dtune::family

namespace dtune::report {

struct EvalSample {
    at::Tensor latents;                      // [1, C, h, w] scaled latents
    std::map<std::string, at::Tensor> cond;  // the family's conditioning, [1, ...] each
};

// diffusers DDPMScheduler.set_timesteps(n) with timestep_spacing "trailing":
// round(arange(T, 0, -T/n)) - 1, in descending order.
std::vector<int64_t> trailing_timesteps(int64_t num_train_timesteps, int64_t n);

// Mean loss over samples × timesteps (see the file comment), each computed as training computes it
// (diffusion::diffusion_loss with the run's loss_type, huber and min-SNR settings, as SimpleTuner's
// eval calls its model.loss). Restores the model's train/eval mode.
double eval_loss(family::Denoiser& model, const diffusion::NoiseSchedule& schedule,
                 diffusion::PredictionType prediction, const std::vector<EvalSample>& samples,
                 const std::vector<int64_t>& timesteps, const diffusion::LossOptions& loss = {});

// Flow matching's fixed timesteps (sigma · T, descending; see the file comment) for latents of
// `image_seq_len` 2×2-packed tokens: diffusers' set_timesteps(n, mu) on `scheduler` with SimpleTuner's
// sigma bounds [1/T, 1]. Float32 values, as the scheduler holds them.
std::vector<double> flow_eval_timesteps(const diffusion::FlowMatchConfig& scheduler, int64_t n,
                                        int64_t image_seq_len);

// The flow-matching eval loss: the mean over samples × timesteps (flow_eval_timesteps of each
// sample's latent size) of MSE(prediction, noise - x0). Restores the model's train/eval mode.
double flow_eval_loss(family::Denoiser& model, const diffusion::FlowMatchConfig& scheduler,
                      const std::vector<EvalSample>& samples, int64_t num_timesteps);

// The scheduler flow_eval_loss uses for `objective`: its flow_scheduler with flow.shift as the static
// shift. UsageError when the family gave no scheduler config.
diffusion::FlowMatchConfig flow_eval_scheduler(const family::TrainingObjective& objective);

class EvalLossCallback final : public train::TrainCallback {
  public:
    struct Options {
        std::filesystem::path model_dir;
        std::filesystem::path data_backend_config;
        int64_t interval = 100;
        int64_t num_images = 4;
        int64_t num_timesteps = 28;
    };
    explicit EvalLossCallback(Options options);
    ~EvalLossCallback() override;

    void set_scalar_sink(std::function<void(int64_t, double)> sink) { sink_ = std::move(sink); }
    // Drops eval.jsonl rows after the step the run starts from (they are computed again).
    void on_train_start(train::Trainer& trainer) override;
    void on_step_end(train::Trainer& trainer, const train::StepReport& report) override;
    void on_train_end(train::Trainer& trainer, const train::TrainResult& result) override;
    void on_error(train::Trainer& trainer, const std::exception& error) override;
    // Scores the current weights and appends to eval.jsonl; returns the loss.
    double evaluate(train::Trainer& trainer, int64_t step);

  private:
    void prepare(train::Trainer& trainer);

    Options options_;
    std::vector<EvalSample> samples_;
    std::optional<diffusion::NoiseSchedule> schedule_;  // DDPM families
    std::optional<diffusion::FlowMatchConfig> flow_;    // flow-matching families
    diffusion::PredictionType prediction_ = diffusion::PredictionType::kEpsilon;
    std::function<void(int64_t, double)> sink_;
    int64_t last_step_ = -1;
    std::unique_ptr<train::RunLog> log_;  // eval.jsonl, opened at the first row
};

// The callback when the config's data_backend_config has an eval dataset and eval_loss_disable is
// off; nullptr otherwise.
std::shared_ptr<EvalLossCallback> make_eval_loss_callback(const train::TrainConfig& config);

}  // namespace dtune::report
