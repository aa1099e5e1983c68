// Run observers (see observers.h).
#include "report/observers.h"
#include "report/step_profiler.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <optional>
#include <set>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/redact.h"
#include "data/dataset_config.h"
#include "data/storage.h"
#include "io/image.h"
#include "report/eval_loss.h"
#include "report/html_report.h"
#include "report/step_profiler.h"
#include "report/validation.h"
#include "train/dataset_source.h"
#include "train/trainer.h"

namespace dtune::report {

// TensorBoard only records the run: a writer that fails (output_dir/logs not writable, a full
// disk) is dropped with one warning and training goes on; metrics.jsonl still has every row.
template <typename F>
void TensorBoardCallback::guarded(F&& write) {
    try {
        write();
    } catch (const std::exception& e) {
        writer_.reset();
        log::warn() << "TensorBoard logging stopped: " << e.what()
                    << "; training goes on (metrics.jsonl still has every step)";
    }
}

void TensorBoardCallback::on_train_start(train::Trainer& trainer) {
    if (trainer.is_main_process() && !writer_)
        guarded([&] { writer_ = std::make_unique<EventWriter>(trainer.output_dir() / "logs" / "dtune"); });
}

void TensorBoardCallback::on_step_metrics(train::Trainer&, const train::StepReport& r) {
    if (!writer_) return;
    guarded([&] {
        writer_->add_scalar("train/loss", r.loss, r.step);
        writer_->add_scalar("train/lr", r.lr, r.step);
        writer_->add_scalar("train/grad_norm", r.grad_norm, r.step);
        writer_->add_scalar("train/img_per_s", r.img_per_s, r.step);
        writer_->add_scalar("train/samples_seen", static_cast<double>(r.samples_seen), r.step);
        if (r.gpu_memory_gib) writer_->add_scalar("train/gpu_memory_gib", *r.gpu_memory_gib, r.step);
        if (r.regularisation_loss)
            writer_->add_scalar("train/regularisation_loss", *r.regularisation_loss, r.step);
        if (r.regularisation_step) writer_->add_scalar("train/regularisation_grad_norm", r.grad_norm, r.step);
        check_writes();
    });
}

void TensorBoardCallback::add_scalar(const std::string& tag, double value, int64_t step) {
    if (writer_)
        guarded([&] {
            writer_->add_scalar(tag, value, step);
            check_writes();
        });
}

void TensorBoardCallback::add_png(const std::string& tag, int width, int height, std::string png,
                                  int64_t step) {
    if (writer_)
        guarded([&] {
            writer_->add_image(tag, ImageSummary{width, height, 3, std::move(png)}, step);
            check_writes();
        });
}

void TensorBoardCallback::check_writes() {
    const bool holding = writer_->held() > 0;
    if (holding && !holding_)
        log::warn() << "writing " << writer_->path().string() << " failed (" << writer_->error()
                    << "): TensorBoard records are kept in memory and written when the disk has space "
                    << "again; free space on " << writer_->path().parent_path().string();
    else if (!holding && holding_)
        log::info() << "the held TensorBoard records were written to " << writer_->path().string();
    holding_ = holding;
}

// Records still held at the end are lost: a warning, since TensorBoard only mirrors metrics.jsonl
// (whose own rows are never dropped silently) and must not fail a finished run.
void TensorBoardCallback::on_train_end(train::Trainer&, const train::TrainResult&) {
    if (!writer_ || writer_->retry()) return;
    log::warn() << writer_->held() << " TensorBoard record(s) could not be written to "
                << writer_->path().string() << " (" << writer_->error()
                << "); the records before them are whole, and metrics.jsonl holds every step";
}

void TensorBoardCallback::on_error(train::Trainer&, const std::exception&) {
    if (writer_ && !writer_->retry())
        log::warn() << writer_->held() << " TensorBoard record(s) could not be written to "
                    << writer_->path().string() << " (" << writer_->error() << ")";
}

nlohmann::json dataset_summary(const train::TrainConfig& config) {
    if (config.is_null("data_backend_config")) return nullptr;
    const std::filesystem::path file = config.text("data_backend_config");
    std::error_code ec;
    if (!std::filesystem::is_regular_file(file, ec)) return nullptr;
    const auto root = nlohmann::json::parse(fs::read_file(file), nullptr, false);
    if (!root.is_array()) return nullptr;
    // Only the entries training reads: disabled ones are left out (when the file parses at all).
    std::optional<std::set<std::string>> enabled;
    try {
        enabled.emplace();
        for (const auto& d :
             data::load_data_backend_config(file, train::data_args_from_config(config)).datasets)
            enabled->insert(d.id);
    } catch (const std::exception&) {
        enabled.reset();
    }
    nlohmann::json out = nlohmann::json::object();
    for (const auto& d : root) {
        if (!d.is_object()) continue;
        if (enabled &&
            !(d.contains("id") && d["id"].is_string() && enabled->count(d["id"].get<std::string>())))
            continue;
        const std::string type = d.value("dataset_type", "image");
        std::string line = str(type, ", ", d.value("type", "local"));
        if (d.contains("instance_data_dir")) {
            const std::string dir = d.value("instance_data_dir", "");
            line += ", " + dir;
            if (d.value("type", "local") == "local" && std::filesystem::is_directory(dir, ec)) {
                // Discovery's own listing: unreadable subfolders are left out with its warning.
                try {
                    const auto images =
                        data::LocalStorage().list_files(dir, {".png", ".jpg", ".jpeg", ".webp"});
                    line += str(", ", images.size(), " images");
                } catch (const std::exception& e) {
                    line += ", images not counted: " + std::string(e.what());
                }
            }
        }
        if (d.contains("resolution"))
            line += ", resolution " + d.at("resolution").dump() + " " + d.value("resolution_type", "");
        if (d.contains("caption_strategy")) line += ", captions: " + d.value("caption_strategy", "");
        if (d.contains("cache_dir")) line += ", cache " + d.value("cache_dir", "");
        out[d.value("id", str("entry ", out.size()))] = redact_text(line);  // report.html is shared
    }
    return out;
}

const nlohmann::json& ReportCallback::dataset(train::Trainer& trainer) {
    if (!dataset_) dataset_ = dataset_summary(trainer.config());
    return *dataset_;
}

std::optional<std::filesystem::path> ReportCallback::write(train::Trainer& trainer,
                                                           const std::string& status) {
    // The report only describes the run: whatever stops it from being written (an unreadable
    // folder, a full disk, report.html being a folder) is a warning, never the end of training.
    try {
        return write_report(trainer.output_dir(), status, dataset(trainer));
    } catch (const std::exception& e) {
        log::warn() << "could not write " << (trainer.output_dir() / "report.html").string() << " (" << status
                    << "): " << e.what() << "; training goes on, the report is tried again at the next "
                    << "checkpoint and at the end";
        return std::nullopt;
    }
}

void ReportCallback::on_checkpoint(train::Trainer& trainer, const std::filesystem::path& dir) {
    if (trainer.is_main_process())
        write(trainer, str("running (", dir.filename().string(), " saved at step ", trainer.global_step(),
                           " of ", trainer.total_steps(), ")"));
}

void ReportCallback::on_train_end(train::Trainer& trainer, const train::TrainResult& result) {
    if (!trainer.is_main_process()) return;
    const auto path =
        write(trainer, str(result.outcome == train::TrainOutcome::kCompleted ? "finished" : "interrupted",
                           " at step ", result.global_step, " of ", trainer.total_steps()));
    if (path) log::info() << "report: " << path->string();
}

void ReportCallback::on_error(train::Trainer& trainer, const std::exception& error) {
    if (trainer.is_main_process())
        write(trainer, str("failed at step ", trainer.global_step(), ": ", redact_text(error.what())));
}

bool reports_to_tensorboard(const train::TrainConfig& config) {
    for (const std::string& r : config.report_to_list())
        if (r == "tensorboard" || r == "wandb" || r == "all") return true;
    return false;
}

void add_observers(train::Trainer& trainer, std::shared_ptr<notify::Notifier> notifier) {
    const auto& config = trainer.config();
    std::shared_ptr<TensorBoardCallback> tb;
    const auto trackers = config.report_to_list();
    // A SimpleTuner config made for wandb trains the same here; dtune has no wandb client (and
    // training machines often have no network), so the metrics go to TensorBoard's files instead.
    if (trainer.is_main_process() && std::count(trackers.begin(), trackers.end(), "wandb"))
        log::warn() << "report_to wandb: wandb is not available in dtune; writing TensorBoard logs to "
                    << (trainer.output_dir() / "logs" / "dtune").string()
                    << " instead (metrics.jsonl as always)";
    if (reports_to_tensorboard(config)) {
        tb = std::make_shared<TensorBoardCallback>();
        trainer.add_callback(tb);
    }
    const std::filesystem::path model_dir = config.text("pretrained_model_name_or_path");
    auto settings = validation_settings(config);
    if (!settings.prompts.empty()) {
        auto v = std::make_shared<ValidationCallback>(std::move(settings), model_dir);
        v->set_notifier(notifier);
        if (tb)
            v->add_scalar_sink([tb](int64_t step, const std::string& tag, double value) {
                tb->add_scalar(tag, value, step);
            });
        if (tb)
            v->add_sink([tb](int64_t step, const std::string& name, int i, const std::string& res,
                             const io::RgbImage& im) {
                tb->add_png(str("validation/", name, "_", i, "_", res), im.width, im.height,
                            io::encode_png(im), step);
            });
        trainer.add_callback(v);
    }
    if (auto eval = make_eval_loss_callback(config)) {
        if (tb)
            eval->set_scalar_sink(
                [tb](int64_t step, double loss) { tb->add_scalar("eval/loss", loss, step); });
        trainer.add_callback(eval);
    }
    trainer.add_callback(std::make_shared<ReportCallback>());
    if (auto profiler = make_step_profiler(std::getenv("DTUNE_PROFILE_STEPS")))
        trainer.add_callback(profiler);
}

}  // namespace dtune::report
