// Errors that reach the user. Every message names the value at fault and, where we know it, the
// fix. Exceptions are thrown at API/config/IO boundaries and caught once, in the CLI, which maps
// them to an exit code.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace dtune {

// Exit codes the CLI returns; documented in the README so orchestrators can act on them.
enum class ExitCode : int {
    kOk = 0,
    kError = 1,         // an unexpected failure
    kUsage = 2,         // bad command line or config
    kData = 3,          // bad or missing input data / model files
    kInterrupted = 4,   // stopped by a signal after saving state
    kUnavailable = 69,  // dtune health: the check could not run (no NVML, no GPU to look at); EX_UNAVAILABLE
    kGpuFault = 75,     // GPU health circuit breaker tripped: replace the instance
};

class Error : public std::runtime_error {
  public:
    explicit Error(const std::string& message, ExitCode code = ExitCode::kError)
        : std::runtime_error(message), code_(code) {}
    ExitCode code() const { return code_; }

  private:
    ExitCode code_;
};

// A problem with what the user gave us (config key, CLI flag): exit code 2.
class UsageError : public Error {
  public:
    explicit UsageError(const std::string& message) : Error(message, ExitCode::kUsage) {}
};

// A problem with a file or dataset (missing, truncated, corrupt): exit code 3.
class DataError : public Error {
  public:
    explicit DataError(const std::string& message) : Error(message, ExitCode::kData) {}
};

// Concatenates any streamable values: str("bucket ", 1.75, " has ", 3, " samples").
template <typename... Args>
std::string str(Args&&... args) {
    std::ostringstream out;
    (out << ... << std::forward<Args>(args));
    return out.str();
}

}  // namespace dtune

// DTUNE_CHECK(cond, parts...) throws dtune::Error with the concatenated parts when cond is false.
// Write the parts as "<what is wrong, naming the value>; <how to fix it>".
#define DTUNE_CHECK(cond, ...)                                        \
    do {                                                              \
        if (!(cond)) throw ::dtune::Error(::dtune::str(__VA_ARGS__)); \
    } while (0)

// Same, with a chosen error class (UsageError, DataError, ...).
#define DTUNE_CHECK_AS(ErrorType, cond, ...)                     \
    do {                                                         \
        if (!(cond)) throw ErrorType(::dtune::str(__VA_ARGS__)); \
    } while (0)

// Compares two values and puts both into the message: "<parts> (got a=3, expected b=4)".
#define DTUNE_CHECK_EQ(a, b, ...)                                                                           \
    do {                                                                                                    \
        const auto& dtune_a_ = (a);                                                                         \
        const auto& dtune_b_ = (b);                                                                         \
        if (!(dtune_a_ == dtune_b_))                                                                        \
            throw ::dtune::Error(                                                                           \
                ::dtune::str(__VA_ARGS__, " (got " #a "=", dtune_a_, ", expected " #b "=", dtune_b_, ")")); \
    } while (0)

#define DTUNE_FAIL(...) throw ::dtune::Error(::dtune::str(__VA_ARGS__))
