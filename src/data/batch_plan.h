// The effective-batch-size check and the per-epoch plan of one dataset's buckets
// (SIMPLETUNER.md §3.3 pruning, §3.4 check and oversubscription, §4 rank split).
//
// effective batch size (EBS) = train_batch_size × world_size × gradient_accumulation_steps (1
// world for eval datasets). A bucket fails when samples × (repeats + 1) < EBS; without
// allow_dataset_oversubscription (or with repeats set by the user) that is a UsageError whose
// text follows SimpleTuner's. With oversubscription, each failing bucket alone gets
// auto_repeat = ceil(EBS / n) − 1 and is scheduled as ceil(n·(auto_repeat+1) / EBS)·EBS indices,
// split evenly over ranks and wrapping modulo n.
//
// Beyond SimpleTuner, the plan never drops anything silently: every bucket reports how many
// samples it contributes per epoch and how many were excluded, and why.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dtune::data {

struct BatchCheckInput {
    std::string dataset_id;
    int train_batch_size = 4;
    int world_size = 1;
    int gradient_accumulation_steps = 1;
    int repeats = 0;
    bool repeats_set_by_user = false;  // "repeats" present in the dataset entry
    bool allow_oversubscription = false;
    // Top every rank's share up to ceil(n / world) with the bucket's last sample (SimpleTuner
    // pads when oversubscribing or when max_train_steps is unset).
    bool apply_padding = true;
    bool disable_bucket_pruning = false;
    bool is_eval = false;
};

struct BucketEpochPlan {
    std::string key;      // "1.75"
    int64_t samples = 0;  // distinct samples in the bucket
    int repeats = 0;      // passes beyond the first (auto_repeat when oversubscribed)
    bool oversubscribed = false;
    int64_t scheduled = 0;          // oversubscribed: indices scheduled over all ranks
    std::vector<int64_t> per_rank;  // indices each rank holds (padding and duplicates included)
    int64_t batches_per_rank = 0;   // batches each rank draws from this bucket per epoch (max)
    int64_t samples_per_epoch = 0;  // over all ranks: per-rank indices × passes (duplicates included)
    int64_t filled = 0;             // batch slots the sampler fills with already-seen samples
    int64_t padded = 0;             // duplicates added so ranks hold equal counts
    int64_t excluded = 0;           // samples that never reach training
    std::string excluded_reason;    // empty when excluded == 0
};

struct EpochPlan {
    std::string dataset_id;
    int64_t effective_batch_size = 0;
    int64_t total_samples = 0;
    int max_auto_repeat = 0;  // > 0 when oversubscription changed anything
    std::vector<BucketEpochPlan> buckets;
    std::vector<std::string> warnings;
    // Files left out before bucketing (unreadable, too small, aspect filter, max_num_samples):
    // reason → count, filled by the caller that knows them.
    std::map<std::string, int64_t> excluded_before_bucketing;

    int64_t samples_per_epoch() const;
    int64_t excluded() const;
    // A human-readable table: one line per bucket with contribution and exclusions.
    std::string report() const;
};

// Checks and plans. `bucket_sizes` maps bucket key → distinct samples. Throws UsageError with
// SimpleTuner's "Dataset configuration will produce zero usable batches." text on failure.
EpochPlan plan_epoch(const BatchCheckInput& input, const std::map<std::string, int64_t>& bucket_sizes);

// The indices (into the bucket's shuffled list of `plan.samples`) that `rank` holds: a contiguous
// slice [r·q + min(r, rem), …) padded with the last index, or for oversubscribed buckets
// scheduled/world indices from rank·local wrapping modulo the bucket size.
std::vector<int64_t> rank_indices(const BucketEpochPlan& plan, int world_size, int rank, bool apply_padding);

}  // namespace dtune::data
