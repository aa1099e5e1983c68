// Whole-record appends with rollback (see append_log.h).
#include "core/append_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace dtune::fs {

AppendLog::AppendLog(std::filesystem::path path, std::size_t max_held)
    : path_(std::move(path)), max_held_(max_held) {}

AppendLog::~AppendLog() {
    if (fd_ >= 0) ::close(fd_);
}

bool AppendLog::write_one(const std::string& record) {
    if (fd_ < 0) {
        fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (fd_ < 0) {
            error_ = std::strerror(errno);
            return false;
        }
    }
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
        error_ = std::strerror(errno);
        return false;
    }
    const char* p = record.data();
    std::size_t left = record.size();
    while (left > 0) {
        const ssize_t n = ::write(fd_, p, left);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            error_ = n < 0 ? std::strerror(errno) : "short write";
            // Cut the partial record off, so the next record does not start inside it.
            if (::ftruncate(fd_, st.st_size) != 0)
                error_ += str("; cutting the partial record off failed too (", std::strerror(errno), ")");
            return false;
        }
        p += n;
        left -= static_cast<std::size_t>(n);
    }
    return true;
}

bool AppendLog::retry() {
    while (!held_.empty()) {
        if (!write_one(held_.front())) return false;
        held_.pop_front();
    }
    return true;
}

bool AppendLog::append(std::string record) {
    held_.push_back(std::move(record));
    if (retry()) return true;
    if (held_.size() > max_held_)
        throw DataError(str("writing ", path_.string(), " has failed for ", held_.size(),
                            " records in a row (", error_,
                            "); free space on its disk (or raise the quota) and resume the run"));
    return false;
}

}  // namespace dtune::fs
