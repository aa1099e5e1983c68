// Appending whole records to a run's log files (metrics.jsonl, eval.jsonl, TensorBoard event
// files), so that a full disk or a quota loses no record and splices none into another.
//
// append() writes the record with write(2) at the end of the file (O_APPEND). When the write fails
// or is short (ENOSPC, EDQUOT, EIO), the file is cut back to its length before the write, so it
// ends with the last whole record, and the record is held in memory; every later append() first
// writes the held records, in order, so the file keeps step order once space is back. retry()
// does the same without a new record (the end of a run), and the caller reports what is still
// held. Log-free: callers say what happened in their own words.
//
// Invariants: the file only ever holds whole records in the order they were given; held records
// are bounded (DataError past `max_held`, naming the file) so a disk that never frees up stops
// the run instead of growing memory without end. One writer per file (dtune.lock sees to that).
#pragma once

#include <cstddef>
#include <deque>
#include <filesystem>
#include <string>

namespace dtune::fs {

class AppendLog {
  public:
    explicit AppendLog(std::filesystem::path path, std::size_t max_held = 100000);
    ~AppendLog();
    AppendLog(const AppendLog&) = delete;
    AppendLog& operator=(const AppendLog&) = delete;

    // Writes the held records, then `record`; false when one failed (it and the rest stay held).
    bool append(std::string record);
    // Writes the held records; false when some remain.
    bool retry();
    std::size_t held() const { return held_.size(); }
    // Why the last write failed ("No space left on device"); empty before any failure.
    const std::string& error() const { return error_; }
    const std::filesystem::path& path() const { return path_; }

  private:
    bool write_one(const std::string& record);

    std::filesystem::path path_;
    std::size_t max_held_;
    std::deque<std::string> held_;
    std::string error_;
    int fd_ = -1;
};

}  // namespace dtune::fs
