// Shell helpers for tests (see shell.h).
#include "support/shell.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>

namespace dtune::test {
namespace {

int exit_code_of(int status) {
    if (status == -1) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

ShellRun run_shell(const std::string& command, const std::string& mark) {
    using Clock = std::chrono::steady_clock;
    ShellRun r;
    const auto start = Clock::now();
    auto& marked = r.marked_at;
    FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
    if (!pipe) return r;
    char buf[4096];
    // read(2), not fread: each chunk is looked at as soon as it arrives, so the mark's time is
    // the time its line was written.
    for (ssize_t n; (n = ::read(::fileno(pipe), buf, sizeof buf)) != 0;) {
        if (n < 0) {
            if (errno == EINTR) continue;
            break;
        }
        r.output.append(buf, static_cast<std::size_t>(n));
        if (!marked && !mark.empty() && r.output.find(mark) != std::string::npos) marked = Clock::now();
    }
    r.exit_code = exit_code_of(::pclose(pipe));
    const auto end = r.ended_at = Clock::now();
    r.seconds = std::chrono::duration<double>(end - start).count();
    if (marked) r.seconds_after_mark = std::chrono::duration<double>(end - *marked).count();
    return r;
}

int run_status(const std::string& command) {
    return exit_code_of(std::system(command.c_str()));
}

bool contains(const std::string& haystack, const std::string& needle) {
    return haystack.find(needle) != std::string::npos;
}

bool line_with(const std::string& text, const std::string& a, const std::string& b) {
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) {
        const auto at = line.find(a);
        if (at != std::string::npos && line.find(b, at) != std::string::npos) return true;
    }
    return false;
}

bool port_free(int port) {
    if (port <= 0 || port > 65535) return false;
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    ::close(fd);
    return ok;
}

int free_port() {
    static std::mt19937 pick(std::random_device{}() ^ static_cast<unsigned>(::getpid()));
    std::uniform_int_distribution<int> below_ephemeral(20000, 32000);
    for (int attempt = 0; attempt < 200; ++attempt) {
        const int port = below_ephemeral(pick);
        if (port_free(port)) return port;
    }
    throw std::runtime_error("free_port: no free TCP port in 20000-32000 on 127.0.0.1 after 200 tries");
}

}  // namespace dtune::test
