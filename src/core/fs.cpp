// File-system helpers: atomic writes and memory-mapped reads.
#include "core/fs.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace dtune::fs {
namespace {

std::string errno_text() {
    return std::strerror(errno);
}

stdfs::path make_temp_name(const stdfs::path& path) {
    static std::atomic<uint64_t> counter{0};
    return stdfs::path(str(path.string(), ".tmp.", ::getpid(), ".", counter++));
}

}  // namespace

AtomicFile::AtomicFile(stdfs::path path) : path_(std::move(path)), temp_(make_temp_name(path_)) {
    if (path_.has_parent_path()) {
        std::error_code ec;
        stdfs::create_directories(path_.parent_path(), ec);
    }
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0)
        throw DataError(str("cannot create '", temp_.string(), "': ", errno_text(),
                            "; check that the directory exists and is writable"));
}

AtomicFile::~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(temp_.c_str());
}

void AtomicFile::write(const void* data, std::size_t size) {
    DTUNE_CHECK(!committed_, "write to '", path_.string(), "' after commit");
    const auto* p = static_cast<const char*>(data);
    while (size > 0) {
        ssize_t n = ::write(fd_, p, size);
        if (n < 0) {
            if (errno == EINTR) continue;
            throw DataError(str("writing '", temp_.string(), "' failed: ", errno_text(),
                                " (disk full?); the previous '", path_.filename().string(),
                                "' is unchanged"));
        }
        p += n;
        size -= static_cast<std::size_t>(n);
        written_ += static_cast<uint64_t>(n);
    }
}

void AtomicFile::commit() {
    DTUNE_CHECK(!committed_, "'", path_.string(), "' committed twice");
    if (::fsync(fd_) != 0) throw DataError(str("fsync of '", temp_.string(), "' failed: ", errno_text()));
    ::close(fd_);
    fd_ = -1;
    if (::rename(temp_.c_str(), path_.c_str()) != 0)
        throw DataError(
            str("renaming '", temp_.string(), "' to '", path_.string(), "' failed: ", errno_text()));
    committed_ = true;
    sync_directory(path_.has_parent_path() ? path_.parent_path() : stdfs::path("."));
}

void write_file_atomic(const stdfs::path& path, std::string_view content) {
    AtomicFile file(path);
    file.write(content);
    file.commit();
}

std::string read_file(const stdfs::path& path) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw DataError(str("cannot open '", path.string(), "': ", errno_text()));
    std::string out;
    char buf[1 << 16];
    for (;;) {
        ssize_t n = ::read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            std::string err = errno_text();
            ::close(fd);
            throw DataError(str("reading '", path.string(), "' failed: ", err));
        }
        if (n == 0) break;
        out.append(buf, static_cast<std::size_t>(n));
    }
    ::close(fd);
    return out;
}

void require_writable_dir(const stdfs::path& dir, std::string_view key) {
    std::error_code ec;
    stdfs::create_directories(dir, ec);
    std::string why;
    if (ec)
        why = ec.message();
    else if (!stdfs::is_directory(dir, ec))
        why = "it is not a folder";
    else if (::access(dir.c_str(), W_OK | X_OK) != 0)
        why = std::strerror(errno);  // e.g. a read-only mount, or another user's folder
    if (!why.empty())
        throw UsageError(str(key, " '", dir.string(), "' cannot be created or written (", why, "); set ", key,
                             " to a folder this user can write"));
}

void sync_directory(const stdfs::path& dir) {
    int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return;  // best effort: some file systems do not allow opening directories
    ::fsync(fd);
    ::close(fd);
}

MappedFile::MappedFile(const stdfs::path& path) : path_(path) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        throw DataError(str("cannot open '", path.string(), "': ", errno_text(),
                            errno == ENOENT ? "; check the path (does the file exist?)" : ""));
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        ::close(fd);
        throw DataError(str("cannot stat '", path.string(), "': ", errno_text()));
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        throw DataError(str("'", path.string(), "' is not a regular file"));
    }
    size_ = static_cast<std::size_t>(st.st_size);
    if (size_ > 0) {
        data_ = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
        if (data_ == MAP_FAILED) {
            data_ = nullptr;
            ::close(fd);
            throw DataError(str("cannot mmap '", path.string(), "': ", errno_text()));
        }
    }
    ::close(fd);
}

MappedFile::~MappedFile() {
    if (data_) ::munmap(data_, size_);
}

}  // namespace dtune::fs
