// Webhook and GPU health observers of a training run (see run_observers.h).
#include "train/run_observers.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "core/log.h"
#include "core/redact.h"
#include "dist/fault.h"
#include "health/breaker.h"
#include "notify/webhooks.h"
#include "train/config.h"
#include "train/signals.h"
#include "train/trainer.h"

namespace dtune::train {
namespace {

constexpr auto kFlushTimeout = std::chrono::seconds(15);

std::string host_name() {
    char host[256] = "unknown";
    ::gethostname(host, sizeof host - 1);
    return host;
}

}  // namespace

// ---- webhooks ---------------------------------------------------------------------------------

WebhookObserver::WebhookObserver(std::shared_ptr<notify::Notifier> notifier, int64_t progress_interval)
    : notifier_(std::move(notifier)), progress_interval_(std::max<int64_t>(1, progress_interval)) {}

void WebhookObserver::on_train_start(Trainer& t) {
    if (!t.is_main_process()) return;
    notifier_->send(notify::lifecycle_stage("init_prepare_models", "completed"));
    const int64_t effective_batch = t.config().integer("train_batch_size") *
                                    t.config().integer("gradient_accumulation_steps") * t.world_size();
    notifier_->send(notify::training_status("running", {{"global_step", t.global_step()},
                                                        {"total_steps", t.total_steps()},
                                                        {"world_size", t.world_size()},
                                                        {"effective_batch_size", effective_batch}}));
}

void WebhookObserver::on_step_metrics(Trainer& t, const StepReport& r) {
    if (!t.is_main_process() || r.step % progress_interval_ != 0) return;
    const double eta = static_cast<double>(t.total_steps() - r.step) * r.step_seconds;
    notifier_->send(
        notify::training_progress(r.step, t.total_steps(), r.epoch, r.loss, r.lr, r.img_per_s, eta));
}

void WebhookObserver::on_checkpoint(Trainer& t, const std::filesystem::path& dir) {
    if (!t.is_main_process()) return;
    notifier_->send(notify::lifecycle_stage("checkpoint_save", "completed"));
    notifier_->send(notify::training_checkpoint(dir.string(), dir.filename().string(), false));
}

void WebhookObserver::on_train_end(Trainer& t, const TrainResult& result) {
    if (!t.is_main_process()) return;
    const nlohmann::json metrics = {{"global_step", result.global_step}, {"loss", result.last_loss}};
    switch (result.outcome) {
        case TrainOutcome::kCompleted:
            notifier_->send(
                notify::training_checkpoint((t.output_dir() / "pipeline").string(), "final", true));
            notifier_->send(notify::lifecycle_stage("model_save", "completed"));
            notifier_->send(notify::lifecycle_stage("training_complete", "completed"));
            notifier_->send(notify::training_status("completed", metrics));
            break;
        case TrainOutcome::kInterrupted:
            notifier_->send(notify::lifecycle_stage("training_abort", "completed"));
            notifier_->send(notify::training_status("interrupted", metrics));
            break;
        case TrainOutcome::kGpuFault:
            notifier_->send(notify::lifecycle_stage("training_abort", "failed"));
            notifier_->send(notify::training_status("failed", {{"global_step", result.global_step},
                                                               {"reason", "gpu_fault"},
                                                               {"fault_rank", result.fault_rank},
                                                               {"fault_gpu", result.fault_gpu}}));
            break;
    }
}

void WebhookObserver::on_error(Trainer& t, const std::exception& error) {
    if (!t.is_main_process()) return;
    notifier_->send(notify::error_event(redact_text(error.what())));
    notifier_->send(notify::training_status("failed", {{"global_step", t.global_step()}}));
}

// ---- the end of delivery ----------------------------------------------------------------------

// Added after every observer that posts, so that the events of the end (and a gpu.fault found in
// on_error) are queued before the notifier closes. The close is the one bounded wait of the run's
// end: the webhooks get kFlushTimeout in total, and a signal cuts it short (the state is saved).
namespace {
class NotifierCloser final : public TrainCallback {
  public:
    explicit NotifierCloser(std::shared_ptr<notify::Notifier> notifier) : notifier_(std::move(notifier)) {}
    void on_train_end(Trainer&, const TrainResult&) override { close(); }
    void on_error(Trainer&, const std::exception&) override { close(); }

  private:
    void close() {
        begin_shutdown();
        notifier_->close(kFlushTimeout, [] { return shutdown_signal_received(); });
    }
    std::shared_ptr<notify::Notifier> notifier_;
};
}  // namespace

// ---- GPU health -------------------------------------------------------------------------------

GpuHealthObserver::GpuHealthObserver(std::shared_ptr<notify::Notifier> notifier)
    : notifier_(std::move(notifier)),
      cuda_breaker_(std::make_unique<health::CircuitBreaker>()),
      node_(host_name()) {}

GpuHealthObserver::~GpuHealthObserver() = default;

void GpuHealthObserver::report(const health::Finding& f) {
    const nlohmann::json fault = health::fault_json(f, node_, step_.load());
    if (notifier_)
        notifier_->send(notify::gpu_fault(health::fault_type_name(f.type), f.fatal ? "critical" : "warning",
                                          f.message, fault));
    if (!f.fatal) return;
    // The launcher quotes this line when it reports why the job ended.
    std::fprintf(stderr, "GPU fault on node %s (rank %d, local rank %d), GPU %d%s%s: %s\n", node_.c_str(),
                 rank_, local_rank_, f.gpu_index, f.reading ? " " : "",
                 f.reading ? f.reading->uuid.c_str() : "", f.message.c_str());
    std::fflush(stderr);
    request_gpu_fault_stop(f.gpu_index);
}

void GpuHealthObserver::on_train_start(Trainer& t) {
    rank_ = t.rank();
    local_rank_ = t.local_rank();
    step_ = t.global_step();
    if (local_rank_ != 0) return;  // one monitor per node polls all of its GPUs
    std::string why;
    auto source = health::open_monitor_source(&why);
    if (!source) {
        log::info() << "GPU health monitor off: " << why;
        return;
    }
    health::BreakerConfig config;
    if (const char* s = std::getenv("DTUNE_HEALTH_INTERVAL_S"); s && *s)
        config.poll_interval_s = std::atof(s);
    DTUNE_CHECK_AS(UsageError, config.poll_interval_s > 0, "DTUNE_HEALTH_INTERVAL_S='",
                   std::getenv("DTUNE_HEALTH_INTERVAL_S"), "' is not a positive number of seconds");
    monitor_ = std::make_unique<health::HealthMonitor>(std::move(source), config,
                                                       [this](const health::Finding& f) { report(f); });
    log::info() << "GPU health monitor: polling every " << config.poll_interval_s << " s on node " << node_;
}

void GpuHealthObserver::on_step_end(Trainer&, const StepReport& report) {
    step_ = report.step;
}

void GpuHealthObserver::on_train_end(Trainer&, const TrainResult&) {
    monitor_.reset();  // joins the polling thread; NotifierCloser delivers what it reported
}

void GpuHealthObserver::on_error(Trainer& t, const std::exception& error) {
    monitor_.reset();
    // Another rank's fault reached this one through the fault channel: that rank's node reported
    // it (gpu.fault goes out once, from the node that saw it).
    if (dist::is_peer_failure(error)) return;
    const auto* torch_error = dynamic_cast<const c10::Error*>(&error);  // what() has a backtrace
    if (auto finding = cuda_breaker_->record_cuda_error(torch_error ? torch_error->what_without_backtrace()
                                                                    : error.what())) {
        if (t.device().is_cuda()) finding->gpu_index = t.device().index();
        report(*finding);  // NotifierCloser, next, delivers it
    }
}

std::shared_ptr<notify::Notifier> add_run_observers(Trainer& trainer, const TrainConfig& config) {
    std::shared_ptr<notify::Notifier> notifier;
    if (!config.is_null("webhook_config")) {
        const nlohmann::json& raw = config.raw("webhook_config");
        const std::string value = raw.is_string() ? raw.get<std::string>() : raw.dump();
        if (!value.empty()) {
            // Every rank may post a gpu.fault it saw; routine events come from rank 0 only.
            const std::string job = trainer.output_dir().filename().string();
            notifier = std::make_shared<notify::Notifier>(notify::parse_webhook_config(value, "dtune"),
                                                          job.empty() ? "dtune" : job, true);
            trainer.add_callback(
                std::make_shared<WebhookObserver>(notifier, config.integer("metrics_interval")));
        }
    }
    trainer.add_callback(std::make_shared<GpuHealthObserver>(notifier));
    return notifier;
}

void add_notifier_closer(Trainer& trainer, std::shared_ptr<notify::Notifier> notifier) {
    if (notifier) trainer.add_callback(std::make_shared<NotifierCloser>(std::move(notifier)));
}

}  // namespace dtune::train
