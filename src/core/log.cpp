// Logging implementation: one mutex around both sinks so lines never interleave.
#include "core/log.h"
#include "core/redact.h"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <mutex>

#include "core/error.h"

namespace dtune::log {
namespace {

struct State {
    std::mutex mutex;
    Level level = Level::kInfo;
    int rank = 0;
    int world_size = 1;
    bool to_stderr = true;
    std::ofstream file;
};

State& state() {
    static State s;
    return s;
}

const char* level_name(Level level) {
    switch (level) {
        case Level::kDebug: return "debug";
        case Level::kInfo: return "info";
        case Level::kWarn: return "warn";
        case Level::kError: return "error";
    }
    return "?";
}

std::string timestamp() {
    auto now = std::chrono::system_clock::now();
    std::time_t t = std::chrono::system_clock::to_time_t(now);
    std::tm tm{};
    localtime_r(&t, &tm);
    char buf[32];
    std::strftime(buf, sizeof buf, "%H:%M:%S", &tm);
    return buf;
}

}  // namespace

std::optional<Level> parse_level(std::string_view name) {
    std::string lower;
    for (char c : name) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (lower == "debug") return Level::kDebug;
    if (lower == "info") return Level::kInfo;
    if (lower == "warn" || lower == "warning") return Level::kWarn;
    if (lower == "error") return Level::kError;
    return std::nullopt;
}

void set_level(Level level) {
    std::lock_guard lock(state().mutex);
    state().level = level;
}

Level level() {
    return state().level;
}

void set_rank(int rank, int world_size) {
    std::lock_guard lock(state().mutex);
    state().rank = rank;
    state().world_size = world_size;
}

void set_file(const std::filesystem::path& path) {
    std::lock_guard lock(state().mutex);
    State& s = state();
    if (s.file.is_open()) s.file.close();
    if (path.empty()) return;
    std::error_code ec;
    if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
    s.file.open(path, std::ios::app);
    if (!s.file)
        throw Error(str("cannot open log file '", path.string(), "' for appending; check that the ",
                        "directory is writable or choose another --log_file"));
}

void set_stderr(bool enabled) {
    std::lock_guard lock(state().mutex);
    state().to_stderr = enabled;
}

std::string format_line(Level level, std::string_view message) {
    const State& s = state();
    std::string line = timestamp() + " " + level_name(level);
    if (s.world_size > 1) line += str(" [rank ", s.rank, "/", s.world_size, "]");
    line += ": ";
    line += message;
    return line;
}

void write(Level level, std::string_view message) {
    State& s = state();
    if (level < s.level) return;
    // No line carries a URL's password or query tokens, whoever formatted it (see redact.h).
    std::string line = format_line(
        level, message.find("://") == std::string_view::npos ? std::string(message) : redact_text(message));
    std::lock_guard lock(s.mutex);
    if (s.to_stderr) {
        std::fputs(line.c_str(), stderr);
        std::fputc('\n', stderr);
    }
    if (s.file.is_open()) {
        s.file << line << '\n';
        s.file.flush();
    }
}

Line::~Line() {
    if (enabled_) write(level_, stream_.str());
}

}  // namespace dtune::log
