// Progress bar implementation.
#include "core/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace dtune {

std::string format_duration(double seconds) {
    if (!std::isfinite(seconds) || seconds < 0) return "??:??";
    auto s = static_cast<int64_t>(seconds + 0.5);
    char buf[32];
    if (s >= 3600)
        std::snprintf(buf, sizeof buf, "%02lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                      static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
    else
        std::snprintf(buf, sizeof buf, "%02lld:%02lld", static_cast<long long>(s / 60),
                      static_cast<long long>(s % 60));
    return buf;
}

std::string format_rate(double per_second, const std::string& unit, const std::string& units) {
    char buf[64];
    const std::string& many = units.empty() ? unit : units;
    if (per_second <= 0 || !std::isfinite(per_second)) return "? " + many + "/s";
    if (per_second >= 1.0)
        std::snprintf(buf, sizeof buf, "%.1f %s/s", per_second, many.c_str());
    else
        std::snprintf(buf, sizeof buf, "%.2f s/%s", 1.0 / per_second, unit.c_str());
    return buf;
}

Progress::Progress(int64_t total, ProgressOptions options)
    : total_(total), options_(std::move(options)), start_(Clock::now()), last_emit_(start_) {
    if (!options_.out) options_.out = stderr;
    tty_ = options_.tty < 0 ? isatty(fileno(options_.out)) != 0 : options_.tty == 1;
}

Progress::~Progress() {
    try {
        finish();
    } catch (...) {
        // Never throw from a destructor; a lost progress line is harmless.
    }
}

std::string Progress::render(double elapsed_s, bool with_bar) const {
    const double rate = elapsed_s > 0 ? count_ / elapsed_s : 0.0;
    std::string line = options_.label.empty() ? "" : options_.label + " ";
    if (total_ > 0) {
        const double frac = std::clamp(static_cast<double>(count_) / total_, 0.0, 1.0);
        line += str(static_cast<int>(frac * 100), "%");
        if (with_bar) {
            constexpr int kWidth = 24;
            const int filled = static_cast<int>(frac * kWidth);
            line += "|" + std::string(filled, '#') + std::string(kWidth - filled, ' ') + "|";
        }
        const double eta = rate > 0 ? (total_ - count_) / rate : -1.0;
        line += str(" ", count_, "/", total_, " [", format_duration(elapsed_s), "<", format_duration(eta),
                    ", ", format_rate(rate, options_.unit, options_.units), "]");
    } else {
        line += str(count_, " ", options_.unit, " [", format_duration(elapsed_s), ", ",
                    format_rate(rate, options_.unit, options_.units), "]");
    }
    if (!postfix_.empty()) line += " " + postfix_;
    return line;
}

void Progress::emit(bool final_line) {
    if (options_.quiet) return;
    const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
    std::string line = render(elapsed, tty_);
    if (tty_) {
        // \r + clear-to-end-of-line redraws in place.
        std::fprintf(options_.out, "\r%s\033[K%s", line.c_str(), final_line ? "\n" : "");
    } else {
        std::fprintf(options_.out, "%s\n", line.c_str());
    }
    std::fflush(options_.out);
}

void Progress::update(int64_t n) {
    count_ += n;
    const auto now = Clock::now();
    const double since = std::chrono::duration<double>(now - last_emit_).count();
    const double interval = tty_ ? 0.1 : options_.log_interval_s;
    if (since >= interval) {
        last_emit_ = now;
        emit(false);
    }
}

void Progress::finish() {
    if (finished_) return;
    finished_ = true;
    emit(true);
}

}  // namespace dtune
