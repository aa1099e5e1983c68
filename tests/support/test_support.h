// Helpers shared by the test suites: fixture paths and scratch directories.
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>
#include <string>

namespace dtune::test {

// The shared reference fixtures folder (DTUNE_FIXTURES env, else the path CMake found). Fails
// the calling test with a clear message when it does not exist.
std::filesystem::path fixtures_dir();

// A fresh empty directory under the system temp dir, removed when the object goes away.
class TempDir {
  public:
    TempDir();
    ~TempDir();
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    const std::filesystem::path& path() const { return path_; }
    std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

  private:
    std::filesystem::path path_;
};

// Runs `body` in a forked child as an unprivileged user, so permission bits deny access as they
// do for a real user (root reads a chmod 000 folder regardless). As root the child first drops to
// `nobody`; otherwise it keeps the current user. `exit_code` is what body returned (125 when it
// threw); `skip_reason` is set instead when no unprivileged child could be made. The child ends
// with _exit: gtest assertions there are lost, so body reports through its return value and stderr.
struct ChildRun {
    int exit_code = -1;
    std::string skip_reason;
};
ChildRun run_unprivileged(const std::function<int()>& body);

// A tmpfs of `bytes` mounted on a fresh folder for the life of the object: a real file system
// that fills up. Needs root (CAP_SYS_ADMIN); otherwise `why` says why it is not mounted and the
// test skips itself (GTEST_SKIP() << m.why).
class SmallTmpfs {
  public:
    explicit SmallTmpfs(std::size_t bytes);
    ~SmallTmpfs();
    SmallTmpfs(const SmallTmpfs&) = delete;
    SmallTmpfs& operator=(const SmallTmpfs&) = delete;
    bool mounted() const { return mounted_; }
    const std::string& why() const { return why_; }
    const std::filesystem::path& path() const { return dir_.path(); }
    std::filesystem::path operator/(const std::string& name) const { return dir_ / name; }
    // Writes `file` until the file system is full (ENOSPC); returns the bytes written.
    std::size_t fill(const std::filesystem::path& file) const;

  private:
    TempDir dir_;
    bool mounted_ = false;
    std::string why_;
};

// Writes bytes to a file (not atomically: tests use this to build malformed inputs).
void write_bytes(const std::filesystem::path& path, const std::string& bytes);

}  // namespace dtune::test
