// Storage backends: where a dataset's files (and its bucket/metadata JSON) live: local folders or
// an S3 bucket (data/s3_storage.h), so nothing above this layer touches paths directly.
//
// Invariants: paths handed out by list_files() are absolute in the backend's namespace and sorted;
// write() is atomic (a reader sees the old or the new content, never a mix); every method is
// thread-safe. S3 backends are shared per bucket/endpoint/credentials within a process
// (make_storage), so what one listing learnt (object sizes and ETags) serves later stat() calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtune::data {

struct DatasetConfig;

// What identifies one version of a file: its size and a version stamp (the modification time
// in ns on local disk, the ETag on S3), named by `version_name` in cache keys.
struct ObjectStat {
    std::uint64_t size = 0;
    std::string version_name;  // "source_mtime_ns" or "source_etag"
    std::string version;
};

class StorageBackend {
  public:
    virtual ~StorageBackend() = default;
    virtual std::string kind() const = 0;
    virtual std::string read(const std::string& path) const = 0;
    virtual void write(const std::string& path, std::string_view bytes) = 0;
    virtual bool exists(const std::string& path) const = 0;
    virtual void remove(const std::string& path) = 0;
    // Every file under `root` (recursively) whose lower-case extension is in `extensions`
    // (".jpg", ...); all files when `extensions` is empty. Sorted. Locally, a subfolder that cannot
    // be listed is left out with one warning per folder per process; an unlistable root is a DataError.
    virtual std::vector<std::string> list_files(const std::string& root,
                                                const std::vector<std::string>& extensions) const = 0;
    // `path` joined onto `root` when relative; as-is when absolute.
    virtual std::string join(const std::string& root, const std::string& path) const = 0;

    // nullopt when the file does not exist.
    virtual std::optional<ObjectStat> stat(const std::string& path) const = 0;
    // nullopt when absent; other failures throw (one request on S3, not HEAD + GET).
    virtual std::optional<std::string> read_if_exists(const std::string& path) const = 0;
    // In input order; remote backends fetch in parallel over their connection pool.
    virtual std::vector<std::optional<std::string>> read_many_if_exists(
        const std::vector<std::string>& paths) const;
    // At least the first `length` bytes (the whole file when shorter); image headers for bucketing.
    virtual std::string read_prefix(const std::string& path, std::size_t length) const;
    // Where the backend points, for listing caches and logs ("local", "s3://bucket at endpoint");
    // never contains a credential.
    virtual std::string location() const = 0;
    // True for backends where a read costs a network round trip: callers prefetch in parallel.
    virtual bool remote() const { return false; }
    // Parallel requests this backend is configured for (aws_max_pool_connections); 1 locally.
    virtual int max_parallel_reads() const { return 1; }
    // Stats learnt elsewhere (a preserved listing), so stat() needs no request for them.
    virtual void remember_stats(const std::vector<std::pair<std::string, ObjectStat>>& stats) { (void)stats; }
    // Stats of every file of the last list_files() call (empty for local folders: stat is cheap).
    virtual std::vector<std::pair<std::string, ObjectStat>> listed_stats(
        const std::vector<std::string>& paths) const {
        (void)paths;
        return {};
    }
};

class LocalStorage final : public StorageBackend {
  public:
    std::string kind() const override { return "local"; }
    std::string read(const std::string& path) const override;
    void write(const std::string& path, std::string_view bytes) override;
    bool exists(const std::string& path) const override;
    void remove(const std::string& path) override;
    std::vector<std::string> list_files(const std::string& root,
                                        const std::vector<std::string>& extensions) const override;
    std::string join(const std::string& root, const std::string& path) const override;
    std::optional<ObjectStat> stat(const std::string& path) const override;
    std::optional<std::string> read_if_exists(const std::string& path) const override;
    std::string location() const override { return "local"; }
};

// The backend a dataset entry asks for: LocalStorage, or S3Storage (data/s3_storage.h) for "aws"
// (one shared instance per bucket, endpoint, region and credentials in this process).
std::shared_ptr<StorageBackend> make_storage(const DatasetConfig& config);

}  // namespace dtune::data
