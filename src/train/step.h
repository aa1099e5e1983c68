// One micro-batch of the training step (SIMPLETUNER.md §1.3): caption dropout, noise and timesteps,
// noisy latents, the UNet's prediction, the target for the prediction type and the (min-SNR) loss.
// Backward, accumulation, clipping and the optimizer are the trainer's.
//
// Invariant: every random number comes from the generator passed in (drawn on the CPU), so a CPU run
// in deterministic mode is a function of the seed and the checkpointed generator state.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "diffusion/loss.h"
#include "diffusion/noise_schedule.h"
#include "diffusion/training_sampling.h"
#include "train/batch_source.h"

namespace dtune::models {
class UNet2DConditionModelImpl;
}

namespace dtune::train {

struct StepOptions {
    diffusion::NoiseOptions noise;
    diffusion::TimestepSamplingOptions timesteps;
    diffusion::LossOptions loss;
    diffusion::PredictionType prediction = diffusion::PredictionType::kEpsilon;
    double caption_dropout_probability = 0.0;
    // Autocast dtype for the UNet's forward (kFloat: none).
    c10::ScalarType compute_dtype = at::kFloat;
    // Data parallelism: this rank holds rows [rank*B, (rank+1)*B) of a global micro-batch of
    // world_size*B rows. Every draw is made for the global batch (same generator state on every
    // rank) and this rank's rows are kept, so N ranks x B equal 1 rank x N*B draw for draw.
    int64_t rank = 0;
    int64_t world_size = 1;
};

// SimpleTuner's caption dropout for SDXL: each sample with probability p trains on the empty
// caption's embedding with a zeroed pooled embedding and zeroed time ids. Returns how many were
// dropped. One uniform draw per sample from `generator`, always (so the stream does not depend on p).
// With world_size > 1 the draws are made for the global batch and rows of `rank` are used.
int64_t apply_caption_dropout(TrainBatch& batch, const PromptEmbedding& empty, double probability,
                              at::Generator& generator, int64_t rank = 0, int64_t world_size = 1);

struct MicroStep {
    at::Tensor loss;       // scalar float32 with the graph attached
    at::Tensor timesteps;  // [B] int64 (CPU)
};

// Forward of one micro-batch: loss = per-sample loss averaged over the batch.
MicroStep micro_step(models::UNet2DConditionModelImpl& unet, const TrainBatch& batch,
                     const diffusion::NoiseSchedule& schedule, const StepOptions& options,
                     int64_t global_step, at::Generator& generator);

}  // namespace dtune::train
