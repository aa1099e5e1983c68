// An exclusive lock on a folder that one process writes (dtune train's output_dir), so that a second
// run started on the same folder stops at once instead of interleaving its files with the first's.
//
// `<dir>/dtune.lock` is locked with an open-file-description lock (fcntl F_OFD_SETLK, falling back
// to a classic POSIX record lock where the kernel lacks OFD locks). The kernel releases the lock
// when the holder exits however it exits (kill -9 included), and on NFS the server's lock manager
// does, when the dead client's lease runs out (NFSv4: about 90 s), so a lock never outlives its
// holder and there is no stale lock to clean up. The file's content (host, pid, start time as
// JSON) is only there to name the holder in the second run's message. A file system without
// locks (ENOLCK, e.g. NFS mounted with `nolock`) gets a warning and no lock.
//
// Invariants: one DirLock per folder per process; the lock is held from acquire() until the
// DirLock is destroyed or the process ends.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace dtune::fs {

// Who holds a folder's lock, as its lock file says.
struct LockHolder {
    std::string host;
    int64_t pid = 0;
    std::string since;             // UTC, ISO 8601
    std::string describe() const;  // "pid 123 on host gpu-a17 since 2026-11-26T22:47:28Z"
};

class DirLock {
  public:
    // Takes the lock of `dir` (created if missing) or throws UsageError naming `key` (the option that
    // chose the folder), the folder and the holder, and what to do.
    static std::unique_ptr<DirLock> acquire(const std::filesystem::path& dir, std::string_view key);
    // The holder named in `dir`'s lock file when another process holds the lock; nullopt when the
    // lock is free (or the file system has no locks).
    static std::optional<LockHolder> holder(const std::filesystem::path& dir);
    ~DirLock();
    DirLock(const DirLock&) = delete;
    DirLock& operator=(const DirLock&) = delete;

    const std::filesystem::path& path() const { return path_; }

  private:
    DirLock(std::filesystem::path path, int fd) : path_(std::move(path)), fd_(fd) {}
    std::filesystem::path path_;
    int fd_ = -1;
};

}  // namespace dtune::fs
