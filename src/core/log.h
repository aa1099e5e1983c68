// Logging: levels, a rank-aware prefix ("[rank 3/8]" once distributed), stderr plus an optional
// log file. Thread-safe: each line is written whole.
//
//   dtune::log::info() << "cached " << n << " latents";
#pragma once

#include <filesystem>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

namespace dtune::log {

enum class Level { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

// Parses "debug", "info", "warn"/"warning", "error" (case-insensitive); nullopt otherwise.
std::optional<Level> parse_level(std::string_view name);
void set_level(Level level);
Level level();
// Sets the prefix printed on every line once world_size > 1.
void set_rank(int rank, int world_size);
// Also appends every line to `path` (created with parents). Empty path stops file logging.
void set_file(const std::filesystem::path& path);
// Turns stderr output off or on (the file, if any, still gets every line). Used by tests.
void set_stderr(bool enabled);

// The formatted line as it would be written (without the trailing newline).
std::string format_line(Level level, std::string_view message);
void write(Level level, std::string_view message);

// Collects one line and writes it on destruction.
class Line {
  public:
    explicit Line(Level level) : level_(level) {}
    Line(const Line&) = delete;
    Line& operator=(const Line&) = delete;
    ~Line();
    template <typename T>
    Line& operator<<(const T& value) {
        if (enabled_) stream_ << value;
        return *this;
    }

  private:
    Level level_;
    bool enabled_ = level_ >= level();
    std::ostringstream stream_;
};

inline Line debug() {
    return Line(Level::kDebug);
}
inline Line info() {
    return Line(Level::kInfo);
}
inline Line warn() {
    return Line(Level::kWarn);
}
inline Line error() {
    return Line(Level::kError);
}

}  // namespace dtune::log
