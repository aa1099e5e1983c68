// SimpleTuner's preserve_data_backend_cache: the file listing of a dataset (and, for S3, every
// object's size and ETag) is stored in <output_dir>/all_image_files_<id>.json after each listing,
// and a later run with the flag on reuses it instead of relisting the bucket (one ListObjectsV2
// page per 1,000 objects, which dominates the start-up of very large datasets).
//
// Invariants: the stored listing is used only when the flag is on and it was written for the same
// location (bucket and endpoint, or local), root folder and extension filter; otherwise the
// dataset is relisted and the file rewritten. While the flag is on, objects added or removed since
// the listing are not seen (a removed image is still served from its cached latents, or skipped
// as unreadable when it has to be decoded). Torch-free.
#pragma once

#include <memory>
#include <string>

#include "data/storage.h"

namespace dtune::data {

// Where the listing of `dataset_id` is stored (SimpleTuner's file name, dtune's content).
std::string listing_cache_path(const std::string& output_dir, const std::string& dataset_id);

// `inner` with list_files() answered from (and recorded to) the stored listing; every other
// method is forwarded. `preserve` false: always relists, still records.
class ListingCacheStorage final : public StorageBackend {
  public:
    ListingCacheStorage(std::shared_ptr<StorageBackend> inner, std::string path, bool preserve);
    std::string kind() const override { return inner_->kind(); }
    std::string read(const std::string& path) const override { return inner_->read(path); }
    void write(const std::string& path, std::string_view bytes) override { inner_->write(path, bytes); }
    bool exists(const std::string& path) const override { return inner_->exists(path); }
    void remove(const std::string& path) override { inner_->remove(path); }
    std::vector<std::string> list_files(const std::string& root,
                                        const std::vector<std::string>& extensions) const override;
    std::string join(const std::string& root, const std::string& path) const override {
        return inner_->join(root, path);
    }
    std::optional<ObjectStat> stat(const std::string& path) const override { return inner_->stat(path); }
    std::optional<std::string> read_if_exists(const std::string& path) const override {
        return inner_->read_if_exists(path);
    }
    std::vector<std::optional<std::string>> read_many_if_exists(
        const std::vector<std::string>& paths) const override {
        return inner_->read_many_if_exists(paths);
    }
    std::string read_prefix(const std::string& path, std::size_t length) const override {
        return inner_->read_prefix(path, length);
    }
    std::string location() const override { return inner_->location(); }
    bool remote() const override { return inner_->remote(); }
    int max_parallel_reads() const override { return inner_->max_parallel_reads(); }
    void remember_stats(const std::vector<std::pair<std::string, ObjectStat>>& stats) override {
        inner_->remember_stats(stats);
    }
    std::vector<std::pair<std::string, ObjectStat>> listed_stats(
        const std::vector<std::string>& paths) const override {
        return inner_->listed_stats(paths);
    }
    // True when the last list_files() came from the stored listing.
    bool reused() const { return reused_; }

  private:
    std::shared_ptr<StorageBackend> inner_;
    std::string path_;
    bool preserve_;
    mutable bool reused_ = false;
};

}  // namespace dtune::data
