// Internals of DatasetBatchSource (dataset_source.h), shared by its two translation units:
// dataset_setup.cpp (datasets, buckets, captions, caches) and dataset_source.cpp (the planner, the
// prefetch thread, collation). Not a public API.
//
// Invariants: a LoadedDataset's `global` lists are identical on every rank (they are built from
// the same bucket index, plan and seed); `plans` and `captions` hold every path of `global`.
#pragma once

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/thread_pool.h"
#include "data/batch_plan.h"
#include "data/cache_builder.h"
#include "data/sample_variants.h"
#include "data/sampler.h"
#include "train/dataset_source.h"

namespace dtune::train::detail {

// What the planner needs to re-bucket a crop_aspect-random dataset each epoch (immutable, shared
// by the planner's copies).
struct RebucketInputs {
    data::BucketSettings settings;
    std::map<std::string, data::SamplePlan> indexed;  // every served path → its bucket-index plan
    data::AspectResolutionMap pins;
    data::BatchCheckInput check;
    uint64_t seed = 0;
    int world_size = 1;
};

// One epoch's layout of a re-bucketed dataset: every rank's share per bucket and the plans.
struct EpochLayout {
    std::map<std::string, std::vector<std::string>> global;  // key → every rank's share, rank order
    std::map<std::string, data::SamplePlan> plans;
    int64_t samples = 0;
};
EpochLayout layout_for_epoch(const RebucketInputs& inputs, int64_t epoch);

struct LoadedDataset {
    data::DatasetConfig config;  // `type: aws`: paths are object keys in the entry's bucket
    // key → distinct samples (sorted). crop_aspect random: every candidate grouped by the index's
    // draw (data::redraw_candidates), out-of-range keys included; each epoch draws them again.
    std::map<std::string, std::vector<std::string>> buckets;
    std::map<std::string, data::SamplePlan> plans;             // path → bucket metadata (index plan)
    std::map<std::string, std::vector<std::string>> captions;  // path → candidate captions
    data::EpochPlan plan;
    // Files that never reached a bucket, by the setting that removed them (the bucketing plan's
    // count, plus captionless samples): carried into every later plan so the reports agree.
    std::map<std::string, int64_t> excluded_before_bucketing;
    std::map<std::string, std::vector<std::string>> global;  // key → every rank's share, rank order
    int batch_size = 1;                                      // per rank
    std::unique_ptr<data::LatentCache> latent_cache;
    std::unique_ptr<data::LatentSource> latents;
    std::shared_ptr<data::TextEmbedCache> text_cache;
    int text_batch_size = 1;  // the text_embeds entry's text_encoder_batch_size
    DatasetCacheReport report;
    data::AspectResolutionMap pins;                  // the aspect→size map bucketing used
    std::shared_ptr<const RebucketInputs> rebucket;  // set when crop_aspect is random
};

// One planned micro-batch of this rank.
struct PlannedBatch {
    size_t dataset = 0;
    std::string bucket;
    std::vector<std::string> samples;  // this rank's slice of the global batch
    int64_t epoch = 0;
    int64_t batch_in_epoch = 0;
    int64_t first_position = 0;  // position of samples[0] in the global batch
    // This epoch's plan of each sample for re-bucketed datasets; empty: the bucket-index plans.
    std::vector<data::SamplePlan> plans;
};

// Which dataset, bucket and samples come next: one global BucketSampler per dataset, the
// per-step dataset choice, epochs. Pure and copyable; state() is all a resume needs.
class Planner {
  public:
    Planner() = default;
    Planner(const std::vector<LoadedDataset>& datasets, uint64_t seed, int world_size, int rank);
    PlannedBatch next();
    int64_t batches_per_epoch() const;
    int64_t epoch() const { return epoch_; }
    nlohmann::json state() const;
    void load_state(const nlohmann::json& state);

  private:
    void begin_epoch(int64_t epoch);
    // Re-buckets the crop_aspect-random datasets for `epoch` (new samplers and plans).
    void layout_epoch(int64_t epoch);

    std::vector<data::BucketSampler> samplers_;
    std::vector<std::shared_ptr<const RebucketInputs>> rebucket_;  // null: fixed buckets
    std::vector<std::shared_ptr<const std::map<std::string, data::SamplePlan>>> epoch_plans_;
    std::vector<int> repeats_;
    std::vector<data::DatasetWeight> weights_;
    std::vector<std::string> ids_;
    std::vector<int> batch_sizes_;
    std::vector<bool> done_;
    uint64_t seed_ = 0;
    int world_size_ = 1, rank_ = 0;
    int64_t epoch_ = 0, served_ = 0, in_epoch_ = 0;
};

// A prepared batch on the CPU (pinned when the target is CUDA) and the planner state after it.
struct PreparedBatch {
    TrainBatch batch;
    nlohmann::json state_after;
    int64_t epoch = 0;
    std::exception_ptr error;
};

// Builds every dataset: buckets, captions, plans, caches (dataset_setup.cpp).
struct SetupResult {
    std::vector<LoadedDataset> datasets;
    PromptEmbedding empty_prompt;
    bool vae_released = false;
    bool text_released = false;
    data::TextEncodeFn text;  // null when released
    data::SampleConditionFn sample_conditioning;
};
SetupResult setup_datasets(const DatasetSourceOptions& options, DatasetEncoders encoders, ThreadPool& pool);

}  // namespace dtune::train::detail

struct dtune::train::DatasetBatchSource::Impl {
    DatasetSourceOptions options;
    std::unique_ptr<ThreadPool> pool;
    std::vector<detail::LoadedDataset> datasets;
    PromptEmbedding empty;
    bool vae_released = false, text_released = false;
    data::TextEncodeFn text;
    data::SampleConditionFn sample_conditioning;  // the family's per-sample conditioning (may be null)
    std::vector<DatasetCacheReport> reports;

    detail::Planner planner;     // at the consumed position whenever the thread is stopped
    nlohmann::json consumed;     // planner state after the last batch next() returned
    int64_t consumed_epoch = 0;  // epoch of that batch

    std::thread thread;
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<detail::PreparedBatch> queue;
    bool stop = false, running = false;

    detail::PreparedBatch prepare(const detail::PlannedBatch& planned);
    void producer(detail::Planner planner);
    void start();
    void halt();
};
