// Observers of a training run: metrics writers, TensorBoard, the HTML report, validation, webhooks
// and the health monitor hook into the trainer here instead of editing the loop.
//
// Invariants: callbacks run on the training thread, in the order they were added, on every rank
// (a callback that writes files checks `is_main_process`). A callback must not draw from the
// trainer's generators (validation uses its own), so adding or removing one never changes the
// trained weights. An exception thrown by a callback ends the run like any training error.
#pragma once

#include <cstdint>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>

namespace dtune::train {

class Trainer;
struct TrainResult;

// What one optimizer step did (the trainer fills it after the step).
struct StepReport {
    int64_t step = 0;  // global step after the update (1-based)
    int64_t epoch = 0;
    double loss = 0;  // mean over the accumulated micro-batches (NaN when not read back)
    double lr = 0;
    double grad_norm = 0;      // before clipping (NaN when not computed)
    double img_per_s = 0;      // images of this step (all ranks) / wall time of the step
    int64_t samples_seen = 0;  // images trained on so far, all ranks
    double step_seconds = 0;
    std::optional<double> gpu_memory_gib;  // peak allocated on this rank's device, when CUDA
    // Mean loss of the step's micro-batches from is_regularisation_data datasets (this rank's),
    // when there were any and the loss was read back; SimpleTuner's regularisation_loss.
    std::optional<double> regularisation_loss;
    // The step's last micro-batch was regularisation data: SimpleTuner logs the gradient norm as
    // regularisation_grad_norm for such steps.
    bool regularisation_step = false;
};

class TrainCallback {
  public:
    virtual ~TrainCallback() = default;
    // After the model, data, optimizer and any resume are ready, before the first step.
    virtual void on_train_start(Trainer& /*trainer*/) {}
    // After every optimizer step.
    virtual void on_step_end(Trainer& /*trainer*/, const StepReport& /*report*/) {}
    // After a checkpoint directory is complete (guard written).
    virtual void on_checkpoint(Trainer& /*trainer*/, const std::filesystem::path& /*dir*/) {}
    // After the final outputs are written (or the run was interrupted).
    virtual void on_train_end(Trainer& /*trainer*/, const TrainResult& /*result*/) {}
    // When the run is about to fail with `error` (the exception is rethrown afterwards).
    virtual void on_error(Trainer& /*trainer*/, const std::exception& /*error*/) {}
};

}  // namespace dtune::train
