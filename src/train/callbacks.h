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
    // Mean over the accumulated micro-batches (and the ranks). NaN in on_step_end when the step's
    // values are not read back yet (the default: they come one step later, see on_step_metrics).
    double loss = 0;
    double lr = 0;
    double grad_norm = 0;  // before clipping; NaN like loss

    double img_per_s = 0;      // images of this step (all ranks) / wall time of the step
    int64_t samples_seen = 0;  // images trained on so far, all ranks
    double step_seconds = 0;
    std::optional<double> gpu_memory_gib;  // peak allocated on this rank's device, when CUDA
    // Mean loss of the step's micro-batches from is_regularisation_data datasets (this rank's),
    // when there were any and the loss has been read back; SimpleTuner's regularisation_loss.
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
    // After every optimizer step, with the step's weights in the model (validation, eval loss).
    // The report's loss and grad_norm are NaN unless already read back (DTUNE_SYNC_READBACK=1).
    virtual void on_step_end(Trainer& /*trainer*/, const StepReport& /*report*/) {}
    // When a step's loss and gradient norm have reached the host: every step, in step order, after
    // its on_step_end (by default during the next step's end; before a checkpoint and at the end of
    // the run at the latest), with the report of on_step_end filled in. Where metrics are logged
    // (TensorBoard, webhooks). It may run at another point on rank 0 than on the others (before an
    // observer's metrics row), so it must not issue collectives.
    virtual void on_step_metrics(Trainer& /*trainer*/, const StepReport& /*report*/) {}
    // After a checkpoint directory is complete (guard written).
    virtual void on_checkpoint(Trainer& /*trainer*/, const std::filesystem::path& /*dir*/) {}
    // After the final outputs are written (or the run was interrupted).
    virtual void on_train_end(Trainer& /*trainer*/, const TrainResult& /*result*/) {}
    // When the run is about to fail with `error` (the exception is rethrown afterwards).
    virtual void on_error(Trainer& /*trainer*/, const std::exception& /*error*/) {}
};

}  // namespace dtune::train
