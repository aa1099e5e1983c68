// Per-rank sampling as pure, resumable logic (SIMPLETUNER.md §1.3, §3.5, §4):
// - choose_dataset(): the probability-weighted dataset choice of one step, seeded by seed+step so
//   every rank picks the same dataset with no communication;
// - rank_bucket_lists(): each bucket sorted, shuffled by (seed, dataset id, bucket) and sliced per
//   rank as batch_plan.h's rank_indices() says, so all ranks partition the same list;
// - BucketSampler: batches from one bucket at a time, buckets visited in turn, samples drawn
//   without replacement within a pass; a bucket with fewer unseen samples than a batch is filled
//   with already-seen ones and becomes exhausted; when all are exhausted the pass ends.
//
// Invariants: identical inputs give identical batches on every machine (own splitmix/mt19937_64
// streams, no std::*_distribution whose output is implementation-defined); SamplerState is all it
// takes to continue with the exact next batch after a restart.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "data/batch_plan.h"

namespace dtune::data {

// A deterministic 64-bit mix (splitmix64).
uint64_t mix64(uint64_t x);
// FNV-1a of a string, for seeding from ids and bucket keys.
uint64_t hash64(const std::string& text);

struct DatasetWeight {
    std::string id;
    double probability = 1.0;
    int64_t length = 0;  // samples per epoch, for auto-weighting
    int start_epoch = 1, start_step = 0;
    std::optional<int> end_epoch, end_step;
};

// Index of the dataset used at `step` (weights: probability × len/total with auto-weighting,
// 0 outside a dataset's start/end window). nullopt when every weight is 0.
std::optional<size_t> choose_dataset(const std::vector<DatasetWeight>& datasets, int64_t step, int64_t epoch,
                                     uint64_t seed, bool auto_weighting = true);

// This rank's samples of every bucket: sorted, shuffled with (seed, id, bucket), sliced per rank.
std::map<std::string, std::vector<std::string>> rank_bucket_lists(
    const std::map<std::string, std::vector<std::string>>& buckets, const EpochPlan& plan,
    const std::string& dataset_id, uint64_t seed, int world_size, int rank, bool apply_padding);

struct SamplerBatch {
    std::string bucket;
    std::vector<std::string> samples;
};

struct SamplerState {
    int64_t epoch = 0;
    int64_t pass = 0;             // 0 .. repeats
    size_t current = 0;           // index of the bucket to serve next
    std::vector<int64_t> cursor;  // per bucket: samples consumed this pass
    std::vector<bool> exhausted;  // per bucket
    int64_t batches = 0;          // batches served this pass (seeds the fills)

    nlohmann::json to_json() const;
    static SamplerState from_json(const nlohmann::json& j);
};

class BucketSampler {
  public:
    // `buckets` are this rank's lists (duplicates allowed); `repeats` extra passes per epoch.
    BucketSampler(std::map<std::string, std::vector<std::string>> buckets, int batch_size, int repeats,
                  uint64_t seed, std::string dataset_id);

    // The next batch of this pass, or nullopt when every bucket is exhausted.
    std::optional<SamplerBatch> next();
    // Starts the next pass; false (and nothing changes) when the epoch's passes are done.
    bool next_pass();
    void begin_epoch(int64_t epoch);
    // Σ over buckets of ceil(len / batch_size) × (repeats + 1).
    int64_t batches_per_epoch() const;

    const SamplerState& state() const { return state_; }
    // Checks the state belongs to this bucket layout; UsageError otherwise (a changed dataset).
    void restore(const SamplerState& state);

  private:
    // The pass order of a bucket as indices into its list, cached until the pass changes.
    const std::vector<size_t>& order_of(size_t bucket);

    std::vector<std::string> keys_;
    std::vector<std::vector<std::string>> lists_;
    int batch_size_;
    int repeats_;
    uint64_t seed_;
    std::string id_;
    SamplerState state_;
    std::vector<std::vector<size_t>> order_cache_;
};

}  // namespace dtune::data
