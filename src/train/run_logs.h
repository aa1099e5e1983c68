// The JSON-lines logs of a training run (metrics.jsonl from the trainer, eval.jsonl from the eval
// loss observer): rows written whole or not at all, held and retried while the disk is full, and
// cut back to the resumed step so that every reader sees each step once.
//
// Invariants: a row is appended only by rank 0, in step order; a failed write leaves the file
// ending with the last whole row (report::AppendLog) and is said once in the log; finish() at the
// end of a run writes what was held or throws DataError naming the file, the rows and the first
// missing step (fs::AppendLog does the writing), so a run whose metrics were lost does not exit 0.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace dtune::fs {
class AppendLog;
}

namespace dtune::train {

class RunLog {
  public:
    explicit RunLog(std::filesystem::path path);
    ~RunLog();
    // Appends `row` (one JSON object with "step") as one line.
    void append(const nlohmann::json& row);
    // Writes the held rows; DataError when some still cannot be written.
    void finish();
    // Like finish() but only warns (a run that is failing anyway).
    void finish_quietly() noexcept;

  private:
    std::unique_ptr<fs::AppendLog> log_;
    int64_t first_held_step_ = -1;
};

// The lines of a JSON-lines text whose "step" is at most `max_step`, and how many were dropped
// (later steps, and lines that are not JSON objects with an integer "step").
struct StepCut {
    std::string kept;
    std::size_t dropped = 0;
};
StepCut cut_after_step(const std::string& text, int64_t max_step);

// Drops the rows of steps after `step` from a JSON-lines log (atomic rewrite; a missing file is
// fine) and says how many went: a run resumed at `step` (0: started afresh) writes them again.
void cut_log_after_step(const std::filesystem::path& path, int64_t step);

}  // namespace dtune::train
