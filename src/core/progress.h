// A progress bar with rate and ETA. On a terminal it redraws one line (at most ~10 times a
// second); when the output is not a terminal (CI, a log file, a pipe) it degrades to a plain log
// line every `log_interval` seconds, so long jobs still show progress without control codes.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace dtune {

struct ProgressOptions {
    std::string label;
    std::string unit = "it";
    std::string units;  // plural for rates ("prompts/s"); empty: `unit`
    // nullptr means stderr; tests pass a tmpfile.
    std::FILE* out = nullptr;
    // -1 = detect with isatty(out), 0 = plain log lines, 1 = redraw in place.
    int tty = -1;
    double log_interval_s = 10.0;
    // Disables all output (e.g. on non-zero ranks).
    bool quiet = false;
};

class Progress {
  public:
    using Clock = std::chrono::steady_clock;
    // total <= 0 means unknown: no percentage or ETA, just count and rate.
    Progress(int64_t total, ProgressOptions options);
    ~Progress();

    void update(int64_t n = 1);
    void set_postfix(std::string text) { postfix_ = std::move(text); }
    // Prints the final line (always, on both kinds of output). Idempotent.
    void finish();

    int64_t count() const { return count_; }
    // The status text for `count` items after `elapsed_s` seconds, e.g.
    // "caching  42%|########        | 420/1000 [00:10<00:13, 41.2 img/s]".
    std::string render(double elapsed_s, bool with_bar) const;

  private:
    void emit(bool final_line);

    int64_t total_;
    int64_t count_ = 0;
    ProgressOptions options_;
    bool tty_;
    bool finished_ = false;
    std::string postfix_;
    Clock::time_point start_;
    Clock::time_point last_emit_;
};

// "01:02:03" for >= 1 h, else "02:03".
std::string format_duration(double seconds);
// "41.2 img/s", or "3.10 s/img" when slower than one per second. `units` (the plural, e.g.
// "prompts") is used in the first form when given.
std::string format_rate(double per_second, const std::string& unit, const std::string& units = "");

}  // namespace dtune
