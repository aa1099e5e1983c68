// Deferred read-back of a training step's scalars: the micro-batches' losses, the gradient norm and
// (several ranks) the ranks' agreement reach the host through one non_blocking copy into pinned
// memory and an event on the current stream, so the host queues the next step instead of waiting
// for this one. The trainer reads a step's values one step later (or at once where it must: a
// checkpoint, the end, a metrics row written by an observer); see Trainer::read_back_steps.
//
// Invariants: a StepScalars' tensors are read in stream order right after the step that wrote them
// (a CUDA graph's static outputs are copied before its next replay); every value reaches the host
// as the double that `.item<double>()` would have given, and the step's mean loss is summed in
// micro-batch order and divided exactly as the host did before (a device divide by a tensor, not
// by a reciprocal), so deferred and immediate read-back log bit-identical values. On the CPU the
// same path runs with the values available at once (a Gloo collective is waited for at wait()).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "train/callbacks.h"

namespace dtune::dist {
class Pending;
}

namespace dtune::train {

// What one optimizer step leaves for the host to read, as device tensors (no wait).
struct StepScalars {
    std::vector<at::Tensor> losses;    // per micro-batch, in order: 0-dim, detached
    at::Tensor grad_norm;              // 0-dim before clipping; undefined when no gradient (logged 0)
    std::vector<bool> regularisation;  // per micro-batch: from an is_regularisation_data dataset
    std::vector<std::string> batches;  // per micro-batch: its files, for the non-finite loss error

    // Records one micro-batch: its loss (detached, not read), whether it came from a
    // regularisation dataset, and its files joined by ", ".
    void add_micro_batch(const at::Tensor& loss, bool regularisation, const std::vector<std::string>& paths);
};

// [losses..., grad_norm, this rank's mean loss] as float64 on the losses' device: the mean is
// (((0 + l0) + l1) + ...) / n, the host's order and rounding.
at::Tensor pack_step_scalars(const StepScalars& scalars);

// Float64 values on their way to the host.
class DeferredRead {
  public:
    DeferredRead();
    // Starts reading the concatenation of `parts` (1-D float64, one device). `before`, when set,
    // is a collective that writes into `parts` in place: on CUDA it is ordered before the copy on
    // the current stream (NCCL's wait returns once queued); on the CPU (Gloo) wait() waits for it.
    explicit DeferredRead(std::vector<at::Tensor> parts, std::unique_ptr<dist::Pending> before = nullptr);
    DeferredRead(DeferredRead&&) noexcept;
    DeferredRead& operator=(DeferredRead&&) noexcept;
    ~DeferredRead();
    // Whether wait() would return without blocking.
    bool ready();
    // The values (blocks until the copy, or the collective, has finished).
    const std::vector<double>& wait();

  private:
    std::vector<at::Tensor> parts_;          // CPU: the values (read at wait); CUDA: the pinned host copy
    std::unique_ptr<dist::Pending> before_;  // CPU only
    std::optional<c10::Event> copied_;       // CUDA: recorded after the copy
    std::vector<double> values_;
    bool done_ = false;
};

// A step whose row and observers wait for its values.
struct PendingStep {
    StepReport report;                                     // all but loss, grad_norm and regularisation_loss
    nlohmann::json row_fields = nlohmann::json::object();  // taken at the step (CUDA graph counters)
    bool writes_row = false;                               // step % metrics_interval == 0
    std::vector<bool> regularisation;
    std::vector<std::string> batches;
    DeferredRead values;  // pack_step_scalars, then the agreement's flags with several ranks
};

// How the trainer reads steps back (DTUNE_SYNC_READBACK=1: lag 0, the reference the deferred
// path is checked against).
struct ReadbackOptions {
    int lag = 1;  // a step's values are read at the end of the step `lag` steps later
    // DTUNE_SYNC_READBACK, read once: "1" gives lag 0, unset or "0" lag 1; UsageError otherwise.
    static ReadbackOptions from_env();
};

}  // namespace dtune::train
