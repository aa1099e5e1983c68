// The `type: aws` storage backend: a dataset's images, metadata tables and caches in an S3 (or
// S3-compatible: R2, MinIO, SeaweedFS) bucket, configured with SimpleTuner's aws_* keys.
//
// Invariants: paths are object keys ("images/cat.jpg"), never starting with '/'; list_files()
// honours the prefix it is given (unlike SimpleTuner, which lists the whole bucket) and, for an
// empty root, the entry's aws_data_prefix; write() is a single PUT (or a completed multipart
// upload), so readers see the old or the new object, never a mix. Credentials live only inside
// the S3 client and are never part of a message.
#pragma once

#include "data/storage.h"
#include "io/s3.h"

#include <map>
#include <memory>
#include <mutex>

namespace dtune::data {

// S3 settings of one dataset entry: aws_bucket_name, aws_region_name, aws_endpoint_url,
// aws_access_key_id, aws_secret_access_key, aws_session_token, aws_max_pool_connections.
// UsageError naming the entry and key for a wrong type (the value of a secret is never shown).
io::S3Config s3_config_for(const DatasetConfig& config);
// aws_data_prefix of the entry, "" when absent; normalised to "dir/" form.
std::string s3_data_prefix_for(const DatasetConfig& config);
// aws_prefetch_depth (a dtune key): objects fetched ahead of the image decoder and the header
// scan; default min(aws_max_pool_connections, 32).
int s3_prefetch_depth_for(const DatasetConfig& config);

class S3Storage final : public StorageBackend {
  public:
    S3Storage(io::S3Config config, std::string data_prefix, int prefetch_depth = 16);
    std::string kind() const override { return "aws"; }
    std::string read(const std::string& path) const override;
    void write(const std::string& path, std::string_view bytes) override;
    bool exists(const std::string& path) const override;
    void remove(const std::string& path) override;
    std::vector<std::string> list_files(const std::string& root,
                                        const std::vector<std::string>& extensions) const override;
    std::string join(const std::string& root, const std::string& path) const override;
    std::optional<ObjectStat> stat(const std::string& path) const override;
    std::optional<std::string> read_if_exists(const std::string& path) const override;
    std::vector<std::optional<std::string>> read_many_if_exists(
        const std::vector<std::string>& paths) const override;
    std::string location() const override;
    bool remote() const override { return true; }
    int max_parallel_reads() const override { return prefetch_depth_; }
    void remember_stats(const std::vector<std::pair<std::string, ObjectStat>>& stats) override;
    std::vector<std::pair<std::string, ObjectStat>> listed_stats(
        const std::vector<std::string>& paths) const override;

    // Parallel reads over the client's connection pool (aws_max_pool_connections), in input order.
    std::vector<std::string> read_many(const std::vector<std::string>& paths) const;
    // The first `length` bytes (image headers are enough for bucketing).
    std::string read_prefix(const std::string& path, std::size_t length) const override;
    const io::S3Client& client() const { return client_; }

  private:
    io::S3Client client_;
    std::string data_prefix_;
    int prefetch_depth_;
    mutable std::mutex stats_mutex_;
    mutable std::map<std::string, ObjectStat> stats_;  // key → size and ETag, from listings
};

// One shared backend per distinct entry settings (bucket, endpoint, region, credentials, prefix).
std::shared_ptr<StorageBackend> make_s3_storage(const DatasetConfig& config);

}  // namespace dtune::data
