// The run observers dtune train attaches from the config: TensorBoard scalars and images
// (report_to: tensorboard), validation images, eval loss, and output_dir/report.html rewritten at
// each checkpoint and at the end. Each is a TrainCallback; add_observers() wires them together.
//
// Invariant: observers never draw from the trainer's generators and only rank 0 writes files, so
// attaching them does not change the trained weights.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "report/tensorboard.h"
#include "train/callbacks.h"
#include "train/config.h"

namespace dtune::notify {
class Notifier;
}

namespace dtune::report {

// Writes train/loss, train/lr, train/grad_norm, train/img_per_s, train/samples_seen (and
// train/gpu_memory_gib on CUDA) every step, to output_dir/logs/dtune/events.out.tfevents.*. A write
// that fails is a warning that ends TensorBoard logging, not the run.
class TensorBoardCallback final : public train::TrainCallback {
  public:
    void on_train_start(train::Trainer& trainer) override;
    // Every step's scalars once read back (their on_step_end report has no loss yet).
    void on_step_metrics(train::Trainer& trainer, const train::StepReport& report) override;
    // For validation images and eval loss (no-op before on_train_start or on other ranks).
    void add_scalar(const std::string& tag, double value, int64_t step);
    void add_png(const std::string& tag, int width, int height, std::string png, int64_t step);

    void on_train_end(train::Trainer& trainer, const train::TrainResult& result) override;
    void on_error(train::Trainer& trainer, const std::exception& error) override;

  private:
    // Runs a write; a failure is a warning and ends TensorBoard logging, never the run.
    template <typename F>
    void guarded(F&& write);
    // Says once when records start being held (disk full) and when they are written again.
    void check_writes();

    std::unique_ptr<EventWriter> writer_;
    bool holding_ = false;
};

// Rewrites output_dir/report.html at each checkpoint and at the end (or failure) of the run. It
// never ends a run: a report that cannot be written is a warning.
class ReportCallback final : public train::TrainCallback {
  public:
    void on_checkpoint(train::Trainer& trainer, const std::filesystem::path& dir) override;
    void on_train_end(train::Trainer& trainer, const train::TrainResult& result) override;
    void on_error(train::Trainer& trainer, const std::exception& error) override;

  private:
    // Writes the report; a failure is logged as a warning (nullopt), never thrown.
    std::optional<std::filesystem::path> write(train::Trainer& trainer, const std::string& status);
    const nlohmann::json& dataset(train::Trainer& trainer);
    std::optional<nlohmann::json> dataset_;  // computed once (it walks the image folders)
};

// One line per multidatabackend.json entry: type, folder, resolution, caption strategy and, for
// local folders, the image count. null when there is no readable data_backend_config.
nlohmann::json dataset_summary(const train::TrainConfig& config);

// True when report_to names tensorboard, wandb (written as TensorBoard files) or "all".
bool reports_to_tensorboard(const train::TrainConfig& config);

// Adds the observers the trainer's config asks for: TensorBoard, validation (when a validation
// prompt or prompt library is set), eval loss (when the dataset config has dataset_type eval),
// and the HTML report (always).
// `notifier` (the run's webhooks, may be null) receives validation_preview frames.
void add_observers(train::Trainer& trainer, std::shared_ptr<notify::Notifier> notifier = nullptr);

}  // namespace dtune::report
