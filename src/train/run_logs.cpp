// metrics.jsonl / eval.jsonl writing and the resume cut (see run_logs.h).
#include "train/run_logs.h"

#include "core/append_log.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"

namespace dtune::train {

RunLog::RunLog(std::filesystem::path path) : log_(std::make_unique<fs::AppendLog>(std::move(path))) {}

RunLog::~RunLog() = default;

void RunLog::append(const nlohmann::json& row) {
    const std::size_t held_before = log_->held();
    if (log_->append(row.dump() + "\n")) {
        if (held_before > 0)
            log::info() << "wrote the " << held_before << " held row(s) to " << log_->path().string()
                        << " (steps " << first_held_step_ << " on)";
        first_held_step_ = -1;
        return;
    }
    if (held_before > 0) return;  // already said
    first_held_step_ = row.value("step", int64_t{-1});
    log::warn() << "writing " << log_->path().string() << " failed (" << log_->error()
                << "): the row of step " << first_held_step_
                << " and later ones are kept in memory and written when the disk has "
                << "space again; free space on " << log_->path().parent_path().string();
}

void RunLog::finish() {
    if (log_->retry()) return;
    throw DataError(str(log_->held(), " row(s) from step ", first_held_step_, " on could not be written to ",
                        log_->path().string(), " (", log_->error(),
                        "); the rows before them are whole. Free space on that disk: the checkpoints "
                        "saved so far are intact and a resumed run writes the missing steps again"));
}

void RunLog::finish_quietly() noexcept {
    try {
        finish();
    } catch (const std::exception& e) {
        log::warn() << e.what();
    }
}

StepCut cut_after_step(const std::string& text, int64_t max_step) {
    StepCut out;
    std::size_t pos = 0;
    while (pos < text.size()) {
        const std::size_t end = std::min(text.find('\n', pos), text.size());
        const std::string line = text.substr(pos, end - pos);
        pos = end + 1;
        const auto j = nlohmann::json::parse(line, nullptr, false);
        const bool keep = !j.is_discarded() && j.is_object() && j.contains("step") &&
                          j["step"].is_number_integer() && j["step"].get<int64_t>() <= max_step;
        if (keep)
            out.kept += line + "\n";
        else
            ++out.dropped;
    }
    return out;
}

void cut_log_after_step(const std::filesystem::path& path, int64_t step) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) return;
    const StepCut cut = cut_after_step(fs::read_file(path), step);
    if (cut.dropped == 0) return;
    fs::write_file_atomic(path, cut.kept);
    log::info() << path.filename().string() << ": dropped " << cut.dropped << " row(s) after step " << step
                << " (" << (step > 0 ? "resumed at that step" : "started afresh")
                << "; those steps are written again)";
}

}  // namespace dtune::train
