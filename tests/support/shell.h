// Running commands from tests (the `dtune` binary, `dtune launch` jobs): a command's exit code and
// its combined stdout+stderr, a free loopback port for a rendezvous, and text checks on output.
#pragma once

#include <chrono>
#include <optional>
#include <string>

namespace dtune::test {

struct ShellRun {
    int exit_code = -1;  // the exit code, or 128 + signal when the shell was killed
    std::string output;  // stdout and stderr, interleaved
    double seconds = 0;  // wall time until the command exited
    // Wall time from the moment `mark` first appeared in the output until the command exited;
    // -1 when no mark was given or it never appeared.
    double seconds_after_mark = -1;
    // The same moments as time points, to relate commands that ran side by side.
    std::optional<std::chrono::steady_clock::time_point> marked_at;
    std::chrono::steady_clock::time_point ended_at;
};

// Runs `command` with /bin/sh, capturing stdout and stderr together as they arrive.
ShellRun run_shell(const std::string& command, const std::string& mark = "");
// Runs `command` with /bin/sh (output not captured); its exit code, or 128 + signal.
int run_status(const std::string& command);

bool contains(const std::string& haystack, const std::string& needle);
// Whether one line of `text` contains `a` and, after it, `b`.
bool line_with(const std::string& text, const std::string& a, const std::string& b);

// A TCP port on 127.0.0.1 that was free a moment ago, so that tests running in parallel do not
// collide: a random one below the kernel's ephemeral range (32768 and up on Linux), which no
// process gets by an automatic bind (Gloo's pair sockets, outgoing connections) in the moment
// between this check and the test's own listen. A port the kernel picks could be handed to such a
// socket in that moment (seen once in a ctest -j2 run: EADDRINUSE at the rendezvous).
int free_port();
// Whether a TCP listener could bind `port` on 127.0.0.1 right now (false outside 1..65535).
bool port_free(int port);

}  // namespace dtune::test
