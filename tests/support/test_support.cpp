// Test helpers implementation.
#include "support/test_support.h"

#include <fcntl.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <pwd.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

namespace dtune::test {

std::filesystem::path fixtures_dir() {
    std::filesystem::path dir = DTUNE_FIXTURES_DIR;
    if (const char* env = std::getenv("DTUNE_FIXTURES")) dir = env;
    if (!std::filesystem::is_directory(dir)) {
        ADD_FAILURE() << "reference fixtures not found at '" << dir.string()
                      << "'; set DTUNE_FIXTURES to the shared/fixtures folder";
    }
    return dir;
}

TempDir::TempDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("dtune-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
}

TempDir::~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
}

ChildRun run_unprivileged(const std::function<int()>& body) {
    uid_t uid = ::getuid();
    gid_t gid = ::getgid();
    if (::geteuid() == 0) {
        const struct passwd* nobody = ::getpwnam("nobody");
        if (nobody == nullptr) return {-1, "running as root and there is no user 'nobody' to drop to"};
        uid = nobody->pw_uid;
        gid = nobody->pw_gid;
    }
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t pid = ::fork();
    if (pid < 0) return {-1, std::string("fork failed: ") + std::strerror(errno)};
    if (pid == 0) {
        if (::geteuid() == 0 && (::setgroups(0, nullptr) != 0 || ::setgid(gid) != 0 || ::setuid(uid) != 0)) {
            std::fprintf(stderr, "dropping root failed: %s\n", std::strerror(errno));
            ::_exit(126);
        }
        if (::geteuid() == 0) ::_exit(126);
        int code = 125;
        try {
            code = body();
        } catch (const std::exception& e) {
            std::fprintf(stderr, "the unprivileged child threw: %s\n", e.what());
        }
        std::fflush(stdout);
        std::fflush(stderr);
        ::_exit(code);
    }
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 126)
        return {-1, "could not drop root privileges to user 'nobody' in the child"};
    return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), ""};
}

SmallTmpfs::SmallTmpfs(std::size_t bytes) {
    if (::geteuid() != 0) {
        why_ = "needs root to mount a small tmpfs (a real file system that fills up)";
        return;
    }
    const std::string options = "size=" + std::to_string(bytes);
    if (::mount("tmpfs", dir_.path().c_str(), "tmpfs", 0, options.c_str()) != 0) {
        why_ = std::string("mounting a tmpfs failed: ") + std::strerror(errno) + " (no CAP_SYS_ADMIN?)";
        return;
    }
    mounted_ = true;
}

SmallTmpfs::~SmallTmpfs() {
    if (mounted_) ::umount2(dir_.path().c_str(), MNT_DETACH);
}

std::size_t SmallTmpfs::fill(const std::filesystem::path& file) const {
    const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) return 0;
    const std::string block(4096, 'x');
    std::size_t total = 0;
    for (std::size_t chunk = block.size(); chunk > 0;) {
        const ssize_t n = ::write(fd, block.data(), chunk);
        if (n > 0) {
            total += static_cast<std::size_t>(n);
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        chunk /= 2;  // the last partial page, if any
    }
    ::close(fd);
    return total;
}

void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace dtune::test
