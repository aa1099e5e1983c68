// The trainer's real data path: a BatchSource built from SimpleTuner's multidatabackend.json.
//
// At construction, for every enabled image dataset (local, or `type: aws` read straight from the
// bucket with parallel read-ahead): aspect buckets from the stored/refreshed bucket index (rank 0 writes it,
// the others wait at the barrier and read it), captions by the dataset's strategy (parquet / JSON-lines
// tables through io::read_table_file), the effective-batch-size check with SimpleTuner's error,
// then the caches: text embeddings of every caption (and of "" for caption dropout) in the
// `text_embeds` entry's cache_dir, VAE latents in each dataset's cache_dir_vae (unless
// vae_cache_disable / vae_cache_ondemand); both sharded over ranks and followed by the barrier.
// Encoders that are no longer needed (every entry is on disk) are released to free memory.
//
// Serving: one global sampler per dataset (data::BucketSampler over the concatenation of every
// rank's bucket list, batch = train_batch_size × world_size); each step picks a dataset with
// data::choose_dataset (seeded by seed + micro-batch index, so every rank picks the same one) and
// rank r takes slice [r·bs, (r+1)·bs) of the global batch: ranks serve disjoint parts of one batch
// of one bucket (same shapes everywhere). The global lists are never padded (SimpleTuner's
// apply_padding; see kPadRankShares in dataset_setup.cpp), so N ranks x bs serve exactly the
// batches one process with N·bs serves, whether or not N divides a bucket's size. A background
// thread prepares the next K batches (cache reads or decode + encode, text embeds, collate, pinned
// memory on CUDA).
//
// Per-draw variants (data/sample_variants.h): with random_flip a draw is mirrored by the same
// per-sample generator; with crop_aspect random the planner re-buckets each dataset at every epoch
// start (a pure function of seed and epoch, so resume and every rank agree); with
// vae_cache_disable each draw gets its own posterior-sample salt from that generator.
//
// Invariants: a batch is a pure function of (seed, the datasets, the planner state): per-sample
// randomness (caption choice, flip, posterior salt) comes from a generator seeded by (seed, dataset, epoch,
// batch, position), never from a stream consumed in thread order, and the trainer's generator is not used.
// state() is the planner state after the last batch next() returned, so load_state() continues with the exact
// next batch whatever the prefetch thread had prepared.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "data/cache_builder.h"
#include "data/dataset_config.h"
#include "train/batch_source.h"
#include "train/config.h"

namespace dtune::train {

// The encoders reach the data path as callables (data::DataEncoders; a model family makes them).
using DatasetEncoders = data::DataEncoders;

struct DatasetSourceOptions {
    std::filesystem::path data_backend_config;
    data::GlobalDataArgs global;  // the config.json fallbacks (output_dir, resolution, ...)
    int train_batch_size = 1;     // per rank; a dataset's own train_batch_size wins
    int gradient_accumulation_steps = 1;
    bool allow_dataset_oversubscription = false;
    bool disable_bucket_pruning = false;  // keep buckets smaller than the batch (data/batch_plan.h)
    uint64_t seed = 0;
    int prefetch_batches = 2;  // K batches prepared ahead by the loader thread (0: no thread)
    // Text encoder batch without a text_embeds entry (an entry's text_encoder_batch_size wins;
    // SimpleTuner's default 1, which `dtune cache` follows too).
    int text_encoder_batch_size = 1;
    int cache_threads = 0;  // thread pool size (0: hardware concurrency)
    bool show_progress = true;
    data::BucketMath math;
    c10::Device device = c10::Device(c10::kCPU);
    // Distributed hooks: every rank builds its own source; a null barrier is a no-op.
    int rank = 0;
    int world_size = 1;
    std::function<void()> barrier;
    // Polled between encoder batches of the cache builds; true stops them (Interrupted).
    std::function<bool()> should_stop;
};

// What construction did with one dataset's caches (for logs and tests).
struct DatasetCacheReport {
    std::string dataset;
    data::CacheBuildReport latents;  // empty when latents are not prebuilt
    data::CacheBuildReport text;     // the captions of this dataset (and "" for the first one)
    int64_t samples = 0;             // bucketed samples served per epoch pass (all ranks)
    std::vector<std::string> buckets;
};

class DatasetBatchSource final : public BatchSource {
  public:
    DatasetBatchSource(DatasetSourceOptions options, DatasetEncoders encoders);
    ~DatasetBatchSource() override;

    TrainBatch next(at::Generator& generator) override;
    int64_t batches_per_epoch() const override;
    int64_t epoch() const override;
    PromptEmbedding empty_prompt() override;
    nlohmann::json state() const override;
    void load_state(const nlohmann::json& state) override;
    bool has_regularisation_data() const override;

    const std::vector<DatasetCacheReport>& cache_reports() const;
    // Whether the encoders were dropped after caching (everything they could make is on disk).
    bool vae_released() const;
    bool text_encoder_released() const;

    struct Impl;

  private:
    std::unique_ptr<Impl> impl_;
};

// The dataset fallbacks of config.json (output_dir, resolution, resolution_type, train_batch_size,
// cache folders, compression, vae_cache_*, caption_dropout_probability, instance_prompt,
// caption_strategy, prepend/only_instance_prompt, skip_file_discovery, parquet_*_column, size
// limits). Without cache_dir_text the text cache goes to <output_dir>/cache/text.
data::GlobalDataArgs data_args_from_config(const TrainConfig& config);

}  // namespace dtune::train
