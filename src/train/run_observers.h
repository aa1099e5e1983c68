// Webhooks and GPU health for a training run, as TrainCallbacks (SIMPLETUNER.md §8).
//
// WebhookObserver posts SimpleTuner's events from rank 0 only: training.status running at the
// start, training.progress every `progress_interval` steps (once the step's loss is read back,
// on_step_metrics), lifecycle.stage checkpoint_save and training.checkpoint per checkpoint,
// model_save / training_complete / training.status completed at the end (interrupted or failed
// otherwise), and error on an exception.
//
// GpuHealthObserver runs the HealthMonitor (NVML polling thread) on local rank 0 of each node from
// on_train_start: a fatal finding posts gpu.fault from that node, writes a "GPU fault on node ..."
// line to stderr (what `dtune launch` reports) and requests the fault stop, which the ranks agree
// on at the next step boundary (see DataParallel::agree). A CUDA error thrown by a step is
// classified on the rank that saw it (is_cuda_error) and reported the same way; the other ranks,
// stopped by the fault channel (dist::PeerFailure), post nothing, so gpu.fault goes out once. Warnings
// (thermal slowdown) post gpu.fault with severity warning once and training goes on.
//
// Invariants: no observer blocks the training thread on the network (notify::Notifier queues);
// at the end (on_train_end or on_error) the notifier is closed once, after every observer that
// posts: the last events get at most 15 s in total to leave, whatever the endpoints do, then what
// is left is dropped with one warning; a SIGINT/SIGTERM during that wait ends it at once.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "train/callbacks.h"

namespace dtune::notify {
class Notifier;
}
namespace dtune::health {
class HealthMonitor;
class CircuitBreaker;
struct Finding;
}  // namespace dtune::health

namespace dtune::train {

class TrainConfig;

class WebhookObserver final : public TrainCallback {
  public:
    WebhookObserver(std::shared_ptr<notify::Notifier> notifier, int64_t progress_interval);
    void on_train_start(Trainer& trainer) override;
    void on_step_metrics(Trainer& trainer, const StepReport& report) override;  // with its read-back loss
    void on_checkpoint(Trainer& trainer, const std::filesystem::path& dir) override;
    void on_train_end(Trainer& trainer, const TrainResult& result) override;
    void on_error(Trainer& trainer, const std::exception& error) override;

  private:
    std::shared_ptr<notify::Notifier> notifier_;
    int64_t progress_interval_;
};

class GpuHealthObserver final : public TrainCallback {
  public:
    // `notifier` may be null (no webhook_config): faults are still logged and stop the run.
    explicit GpuHealthObserver(std::shared_ptr<notify::Notifier> notifier);
    ~GpuHealthObserver() override;
    void on_train_start(Trainer& trainer) override;
    void on_step_end(Trainer& trainer, const StepReport& report) override;
    void on_train_end(Trainer& trainer, const TrainResult& result) override;
    void on_error(Trainer& trainer, const std::exception& error) override;

  private:
    void report(const health::Finding& finding);

    std::shared_ptr<notify::Notifier> notifier_;
    std::unique_ptr<health::HealthMonitor> monitor_;
    std::unique_ptr<health::CircuitBreaker> cuda_breaker_;
    std::string node_;
    int rank_ = 0;
    int local_rank_ = 0;
    std::atomic<int64_t> step_{0};
};

// The observers `dtune train` adds: webhooks when webhook_config is set, the GPU health monitor
// always (it is idle where neither NVML nor an injected fault exists). The notifier posts on rank
// 0 and, for gpu.fault, on the rank that saw the fault. Returns the notifier (null without
// webhook_config) for other observers that post (validation previews); call
// add_notifier_closer() after the last of them.
std::shared_ptr<notify::Notifier> add_run_observers(Trainer& trainer, const TrainConfig& config);

// Closes `notifier` (when set) at the end of the run, after every observer added before it.
void add_notifier_closer(Trainer& trainer, std::shared_ptr<notify::Notifier> notifier);

}  // namespace dtune::train
