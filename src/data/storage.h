// Storage backends: where a dataset's files (and its bucket/metadata JSON) live: local folders or
// an S3 bucket (data/s3_storage.h), so nothing above this layer touches paths directly.
//
// Invariants: paths handed out by list_files() are absolute in the backend's namespace and sorted;
// write() is atomic (a reader sees the old or the new content, never a mix).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dtune::data {

struct DatasetConfig;

class StorageBackend {
  public:
    virtual ~StorageBackend() = default;
    virtual std::string kind() const = 0;
    virtual std::string read(const std::string& path) const = 0;
    virtual void write(const std::string& path, std::string_view bytes) = 0;
    virtual bool exists(const std::string& path) const = 0;
    virtual void remove(const std::string& path) = 0;
    // Every file under `root` (recursively) whose lower-case extension is in `extensions`
    // (".jpg", ...); all files when `extensions` is empty. Sorted.
    virtual std::vector<std::string> list_files(const std::string& root,
                                                const std::vector<std::string>& extensions) const = 0;
    // `path` joined onto `root` when relative; as-is when absolute.
    virtual std::string join(const std::string& root, const std::string& path) const = 0;
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
};

// The backend a dataset entry asks for: LocalStorage, or S3Storage (data/s3_storage.h) for "aws".
std::unique_ptr<StorageBackend> make_storage(const DatasetConfig& config);

}  // namespace dtune::data
