// Discovery and the persisted bucket index of one dataset.
//
// scan_image_headers() reads image sizes from headers only, on the thread pool, with a progress
// bar. BucketIndex holds bucket key → sample paths and path → per-image metadata, and persists
// both next to the data through the storage backend, in SimpleTuner's file names and layout:
//   <instance_data_dir>/aspect_ratio_bucket_indices_<suffix>.json
//   <instance_data_dir>/aspect_ratio_bucket_metadata_<suffix>.json
// plus dtune's <instance_data_dir>/skipped_files_<suffix>.json listing every file left out and why.
// refresh() lists the folder, drops samples whose file is gone, scans only new files, and rebuilds
// everything when the bucketing settings changed since the files were written. Images whose bucket
// is outside minimum/maximum_aspect_ratio are left out of the buckets but keep their metadata (as
// SimpleTuner's metadata file does), so a refresh does not rescan them and a crop_aspect random
// dataset can draw them again every epoch (dataset_buckets.h, redraw_candidates).
//
// Invariants: every path in a bucket has metadata; a path is in exactly one bucket; per-image
// plans are deterministic (the RNG is seeded from the dataset seed and the path), so rescans and
// other ranks agree.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "data/buckets.h"

namespace dtune {
class ThreadPool;
}

namespace dtune::data {

class StorageBackend;

struct HeaderScan {
    std::vector<std::pair<std::string, Size>> images;         // path → display size, input order
    std::vector<std::pair<std::string, std::string>> failed;  // path → reason
};

// Reads every header on `pool`; unreadable files land in `failed`, never abort the scan.
HeaderScan scan_image_headers(const std::vector<std::string>& paths, ThreadPool& pool,
                              bool show_progress = true, const std::string& label = "scanning");
// The same through `storage`: local folders as above; remote ones (S3) read each file's first
// 64 KiB with storage.max_parallel_reads() requests in flight ahead of the parser.
HeaderScan scan_image_headers(const std::vector<std::string>& paths, const StorageBackend& storage,
                              ThreadPool& pool, bool show_progress = true,
                              const std::string& label = "scanning");

struct FilterStats {
    int64_t total_processed = 0;
    int64_t too_small = 0;
    int64_t aspect_filtered = 0;
    int64_t error = 0;
    int64_t not_found = 0;
};

class BucketIndex {
  public:
    std::map<std::string, std::vector<std::string>> buckets;  // key ("1.75") → sorted paths
    std::map<std::string, SamplePlan> metadata;               // path → plan
    // path → plan of the images whose bucket is outside minimum/maximum_aspect_ratio (not in
    // `buckets` or `metadata`; listed in `skipped` too).
    std::map<std::string, SamplePlan> out_of_range;
    std::vector<std::pair<std::string, std::string>> skipped;  // path → why it is not in a bucket
    FilterStats stats;

    // Brings the index up to date with the files in the dataset folder. `map` may be null.
    // Returns the number of newly scanned files.
    int64_t refresh(StorageBackend& storage, const DatasetConfig& config, const BucketSettings& settings,
                    ThreadPool& pool, AspectResolutionMap* map, uint64_t seed, bool show_progress = false);

    // Writes both JSON files atomically. Reads them back; false when absent or from other settings.
    void save(StorageBackend& storage, const DatasetConfig& config) const;
    bool load(const StorageBackend& storage, const DatasetConfig& config);

    std::map<std::string, int64_t> sizes() const;
    int64_t sample_count() const;

    static std::string indices_path(const DatasetConfig& config);
    static std::string metadata_path(const DatasetConfig& config);
    // dtune's report of files not bucketed: {path: reason} (unreadable, too small, aspect filter).
    static std::string skipped_path(const DatasetConfig& config);

  private:
    void add(const std::string& path, const SamplePlan& plan);
    void remove_missing(const std::vector<std::string>& present);
};

}  // namespace dtune::data
