// One dataset from config to this rank's bucket lists: storage → stored bucket index (reused and
// refreshed: new files scanned, missing ones dropped) → aspect→resolution map pinning (persisted in
// output_dir) → max_num_samples subset → effective-batch-size plan → rank shard.
//
// crop_aspect random datasets train every epoch on a fresh draw (sample_variants.h), never on the
// index's own draw: they train from redraw_candidates() (every image that passed the per-image
// filters, whichever bucket the index drew for it), and the plan checks and shards epoch 1's draw.
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
    bool disable_bucket_pruning = false;
    bool apply_padding = true;
    bool write_index = true;
    bool show_progress = false;
    BucketMath math;
};

struct DatasetBuckets {
    BucketIndex index;
    EpochPlan plan;                                         // of epoch 1's buckets
    std::map<std::string, std::vector<std::string>> local;  // this rank's samples per bucket (epoch 1)
    int64_t newly_scanned = 0;
};

// What a dataset trains from, grouped by the index's bucket key: the index's buckets, plus for a
// crop_aspect random dataset the images whose index draw fell outside minimum/maximum_aspect_ratio
// (under that draw's key), since every epoch draws them again. `plans`: path → index plan.
struct RedrawCandidates {
    std::map<std::string, std::vector<std::string>> buckets;
    std::map<std::string, SamplePlan> plans;
};
RedrawCandidates redraw_candidates(BucketIndex index, const DatasetConfig& config);

DatasetBuckets build_dataset_buckets(const DatasetConfig& config, const BucketBuildOptions& options,
                                     ThreadPool& pool);

// The excluded_before_bucketing label of a bucket index `skipped` reason, naming the setting
// that removed the file ("removed by minimum_image_size 768"), or "unreadable (see skipped_files)".
std::string skip_kind(const DatasetConfig& config, const std::string& reason);

// SimpleTuner's max_num_samples: a deterministic subset (seeded by the dataset id) of the bucketed
// samples (for crop_aspect random, of the redraw candidates); the rest are reported as skipped.
// No-op when the limit is unset or not exceeded.
void limit_samples(BucketIndex& index, const DatasetConfig& config);

}  // namespace dtune::data
