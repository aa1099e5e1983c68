// One dataset from config to this rank's bucket lists: storage → stored bucket index (reused and
// refreshed: new files scanned, missing ones dropped) → aspect→resolution map pinning (persisted in
// output_dir) → max_num_samples subset → effective-batch-size plan → rank shard.
//
// Invariants: every rank given the same files and options computes the same plan and disjoint
// contiguous shards (padding aside); the bucket JSON is written only when `write_index` (rank 0 of
// a node in SimpleTuner's scheme), other ranks read what it wrote.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "data/batch_plan.h"
#include "data/bucket_index.h"

namespace dtune {
class ThreadPool;
}

namespace dtune::data {

struct BucketBuildOptions {
    std::string output_dir;  // where aspect_resolution_map-<MP>.json lives
    uint64_t seed = 0;
    int world_size = 1;
    int rank = 0;
    int gradient_accumulation_steps = 1;
    bool allow_dataset_oversubscription = false;
    bool apply_padding = true;
    bool write_index = true;
    bool show_progress = false;
    BucketMath math;
};

struct DatasetBuckets {
    BucketIndex index;
    EpochPlan plan;
    std::map<std::string, std::vector<std::string>> local;  // this rank's samples per bucket
    int64_t newly_scanned = 0;
};

DatasetBuckets build_dataset_buckets(const DatasetConfig& config, const BucketBuildOptions& options,
                                     ThreadPool& pool);

// SimpleTuner's max_num_samples: a deterministic subset (seeded by the dataset id) of the bucketed
// samples; the rest are reported as skipped. No-op when the limit is unset or not exceeded.
void limit_samples(BucketIndex& index, const DatasetConfig& config);

}  // namespace dtune::data
