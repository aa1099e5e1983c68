// Exclusive folder locks through fcntl (see dir_lock.h).
#include "core/dir_lock.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>

#include "core/error.h"
#include "core/log.h"

namespace dtune::fs {
namespace {

constexpr const char* kLockFile = "dtune.lock";

std::string host_name() {
    char host[256] = "unknown";
    ::gethostname(host, sizeof host - 1);
    return host;
}

std::string utc_now() {
    const std::time_t t = std::time(nullptr);
    std::tm tm{};
    ::gmtime_r(&t, &tm);
    char b[32];
    std::strftime(b, sizeof b, "%Y-%m-%dT%H:%M:%SZ", &tm);
    return b;
}

// 0 when locked, else errno (EAGAIN/EACCES: held by another; ENOLCK/EOPNOTSUPP: no locks here).
int try_lock(int fd) {
    struct flock fl {};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
#ifdef F_OFD_SETLK
    // OFD locks belong to this open file, not to the process: a second open in the same process
    // conflicts too, and a thread closing another descriptor of the file does not drop the lock.
    if (::fcntl(fd, F_OFD_SETLK, &fl) == 0) return 0;
    if (errno != EINVAL) return errno;
#endif
    if (::fcntl(fd, F_SETLK, &fl) == 0) return 0;
    return errno;
}

bool held_by_another(int err) {
    return err == EAGAIN || err == EACCES;
}

LockHolder parse_holder(const std::string& text) {
    LockHolder h;
    size_t pos = 0;
    while (pos < text.size()) {
        const size_t end = std::min(text.find('\n', pos), text.size());
        const std::string line = text.substr(pos, end - pos);
        const size_t eq = line.find('=');
        if (eq != std::string::npos) {
            const std::string key = line.substr(0, eq), value = line.substr(eq + 1);
            if (key == "host") h.host = value;
            if (key == "since") h.since = value;
            if (key == "pid") h.pid = std::atoll(value.c_str());
        }
        pos = end + 1;
    }
    return h;
}

std::string read_fd(int fd) {
    std::string out;
    char buf[512];
    for (off_t off = 0;;) {
        const ssize_t n = ::pread(fd, buf, sizeof buf, off);
        if (n <= 0) break;
        out.append(buf, static_cast<size_t>(n));
        off += n;
        if (out.size() > 4096) break;  // the file is a few lines; anything longer is not ours
    }
    return out;
}

}  // namespace

std::string LockHolder::describe() const {
    std::string out = pid > 0 ? str("pid ", pid) : std::string("a process");
    out += " on host " + (host.empty() ? std::string("unknown") : host);
    if (!since.empty()) out += " since " + since;
    // The kernel drops the lock with its holder, so a dead pid on this host means another process
    // still has the file open (a child that inherited the descriptor).
    if (pid > 0 && host == host_name() && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)
        out += " (that process has exited; a process it started still holds the lock file open)";
    return out;
}

std::optional<LockHolder> DirLock::holder(const std::filesystem::path& dir) {
    const int fd = ::open((dir / kLockFile).c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return std::nullopt;
    const int err = try_lock(fd);
    std::optional<LockHolder> out;
    if (held_by_another(err)) out = parse_holder(read_fd(fd));
    ::close(fd);  // drops the probe's own lock, if it took one
    return out;
}

std::unique_ptr<DirLock> DirLock::acquire(const std::filesystem::path& dir, std::string_view key) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    const std::filesystem::path path = dir / kLockFile;
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        throw UsageError(str(key, " '", dir.string(), "': cannot create the lock file ", path.string(), " (",
                             std::strerror(errno), "); set ", key, " to a folder this user can write"));
    const int err = try_lock(fd);
    if (held_by_another(err)) {
        const LockHolder h = parse_holder(read_fd(fd));
        ::close(fd);
        throw UsageError(str(key, " '", dir.string(), "' is in use by another dtune run (", h.describe(),
                             "; lock file ", path.string(),
                             "). Two runs on one folder overwrite each other's checkpoints and mix "
                             "their metrics: wait for that run to end or stop it, or choose another ",
                             key));
    }
    if (err != 0) {
        log::warn() << key << " '" << dir.string() << "' is on a file system without file locks ("
                    << std::strerror(err) << "): a second run started on it would not be detected";
        return std::unique_ptr<DirLock>(new DirLock(path, fd));
    }
    const std::string text = str("host=", host_name(), "\npid=", ::getpid(), "\nsince=", utc_now(), "\n");
    // Written in place (no rename: the lock belongs to this inode); a reader sees at worst a mix of
    // two holders' lines, which only affects the message.
    if (::pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size()) ||
        ::ftruncate(fd, static_cast<off_t>(text.size())) != 0)
        log::warn() << "could not write the holder into " << path.string() << " (" << std::strerror(errno)
                    << "); the folder is locked all the same";
    return std::unique_ptr<DirLock>(new DirLock(path, fd));
}

DirLock::~DirLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the lock; the file stays (removing it would race a new holder)
}

}  // namespace dtune::fs
