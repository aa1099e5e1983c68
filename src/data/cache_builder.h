// Building the latent and text-embedding caches, and the LatentSource the trainer reads from.
//
// build_latent_cache(): this rank's share of every bucket (contiguous slices as rank_indices()
// cuts them, so ranks build disjoint shares whose union is the whole dataset) is checked against
// the cache on the thread pool; valid entries are reused, the rest are grouped by target shape
// into full encoder batches and run through a bounded pipeline: decode/resize/crop on the pool,
// straight into the rows of each batch tensor (pinned when a GPU takes it), enough batches ahead
// to keep every pool thread busy → encode on the calling thread (the GPU thread in real runs),
// one batch in flight: the next batch is queued on the device before the previous one's latents
// are read back → atomic writes on the pool. Batch composition does not depend on timing, so
// the entries are the same whatever the thread count. Unreadable images are skipped, counted and
// listed in the report file; the build continues.
//
// Encoders come in as callables; this layer never links the models:
//   LatentEncodeFn: images [B, 3, H, W] in [-1, 1] (CPU float32, possibly pinned) and one noise
//                   salt per image (LatentRequest::noise_salt) → latents [B, C, H/8, W/8] on any
//                   device (the caller moves them to the CPU; a GPU encoder should not wait for its
//                   result); the result for an image must depend only on its pixels and its salt
//                   (not on the batch it came in)
//   TextEncodeFn:   captions (B) → named tensors, each [B, ...]: what the model family's text
//                   encoders give (SDXL: prompt_embeds [B, 77, 2048], pooled_prompt_embeds
//                   [B, 1280]; Flux: prompt_embeds [B, L, 4096], pooled_prompt_embeds [B, 768],
//                   attention_mask [B, L]); one cache entry holds one row of each
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "data/cache_store.h"

namespace dtune {
class ThreadPool;
}

namespace dtune::data {

using LatentEncodeFn =
    std::function<at::Tensor(const at::Tensor& images, const std::vector<uint64_t>& noise_salts)>;

// A batch of text embeddings: name → [B, ...] (see TextEncodeFn above).
using TextEmbeds = std::map<std::string, at::Tensor>;
using TextEncodeFn = std::function<TextEmbeds(const std::vector<std::string>& captions)>;

// Conditioning a batch gets beyond its captions' embeddings, from its samples' plans and flips
// (SDXL: time_ids [B, 6] from the crop geometry), written into `batch` by name.
using SampleConditionFn = std::function<void(TextEmbeds& batch, const std::vector<SamplePlan>& plans,
                                             const std::vector<bool>& flips)>;

// A model family's data side (family/model_family.h): the encoders as callables, what identifies
// them in cache keys, and the shapes their entries have. The VAE callable must be deterministic
// per (image, noise salt) so that caches built by different ranks, runs, batchings or `dtune cache`
// agree. Dropping a callable frees the model it owns.
struct DataEncoders {
    LatentEncodeFn vae;
    std::string vae_identity;  // part of every latent cache key
    int64_t latent_channels = 4;
    TextEncodeFn text;
    std::string text_identity;  // part of every text cache key
    std::vector<std::string> text_tensor_names{"pooled_prompt_embeds",
                                               "prompt_embeds"};  // one entry's tensors
    SampleConditionFn sample_conditioning;                        // null: none
};

struct CacheBuildOptions {
    int batch_size = 4;  // vae_batch_size / text_encoder_batch_size
    int world_size = 1;
    int rank = 0;
    int prefetch_batches = 2;  // decoded batches waiting for the encoder (bounded queue; raised
                               // so that about two images per pool thread are being decoded)
    // Decode into pinned host memory so uploads to the encoder's GPU are asynchronous; unset:
    // when a CUDA device is present.
    std::optional<bool> pin_memory;
    bool show_progress = false;
    std::string label = "caching";
    // Where unreadable images are listed ({path: reason} JSON); empty: no file.
    std::string report_path;
    // Polled between encoder batches: true stops the build once the batches already encoded are
    // written (they stay valid entries), and it throws Interrupted. Null: never stops.
    std::function<bool()> should_stop;
};

struct CacheBuildReport {
    int64_t total = 0;            // entries this rank is responsible for
    int64_t built = 0;            // missing, encoded now
    int64_t reused = 0;           // valid, untouched
    int64_t rebuilt_stale = 0;    // inputs changed (key differs)
    int64_t rebuilt_corrupt = 0;  // damaged entries
    int64_t skipped = 0;          // unreadable images
    int64_t encoder_calls = 0;
    double seconds = 0;
    // Where a latent build's time went (seconds): decode and write summed over pool threads; the
    // rest on the calling thread: waiting for decodes, inside the encoder call, waiting for the
    // device's latents. The build is decode-bound when wait_decode is a large part of `seconds`.
    struct Stages {
        double decode = 0, write = 0, wait_decode = 0, encode_call = 0, wait_device = 0;
    } stages;
    std::string unit = "img", units = "img";  // what an entry is made from: "prompt"/"prompts" for text
    std::vector<std::pair<std::string, std::string>> skipped_files;  // path → reason
    std::string summary() const;                                     // one line for logs and `dtune cache`
};

// This rank's share of `buckets` (key → requests): per bucket, the requests sorted by path and
// sliced as rank_indices() (no padding, no duplicates).
std::map<std::string, std::vector<LatentRequest>> shard_requests(
    const std::map<std::string, std::vector<LatentRequest>>& buckets, int world_size, int rank);

CacheBuildReport build_latent_cache(const LatentCache& cache,
                                    const std::map<std::string, std::vector<LatentRequest>>& buckets,
                                    const LatentEncodeFn& encode, const CacheBuildOptions& options,
                                    ThreadPool& pool);

// The latent entries a run needs before its first step, per bucket: every sample of `buckets`
// with its plan (the epoch-0 plan for crop_aspect random, see sample_variants.h), and with
// random_flip its mirrored variant too. `dtune train` and `dtune cache` both build exactly these,
// so a cache built by either serves the other.
std::map<std::string, std::vector<LatentRequest>> prebuild_requests(
    const DatasetConfig& config, const std::map<std::string, std::vector<std::string>>& buckets,
    const std::map<std::string, SamplePlan>& plans, uint64_t seed, const AspectResolutionMap& pins,
    const BucketMath& math);

// Encodes every distinct caption of this rank's share (sorted distinct captions, contiguous slice)
// that has no valid entry, in batches of options.batch_size; writes on the pool.
CacheBuildReport build_text_cache(const TextEmbedCache& cache, const std::vector<std::string>& captions,
                                  const TextEncodeFn& encode, const CacheBuildOptions& options,
                                  ThreadPool& pool);

// Batched embeddings of `captions` from the cache; missing or invalid entries are encoded (and
// stored unless `store` is false).
TextEmbeds text_embeds_for(const TextEmbedCache& cache, const std::vector<std::string>& captions,
                           const TextEncodeFn& encode, bool store = true);

// Where a training batch's latents come from.
class LatentSource {
  public:
    virtual ~LatentSource() = default;
    // Latents [B, C, h, w] for one batch of one bucket (all requests share the target size).
    virtual at::Tensor get(const std::vector<LatentRequest>& batch) = 0;
    virtual int64_t encoded() const = 0;  // samples encoded so far (not read from the cache)
};

enum class LatentMode {
    kCache,       // read the cache; missing/stale/corrupt entries are encoded and stored
                  // (vae_cache_ondemand, and the fallback of a prebuilt cache)
    kEncodeOnly,  // vae_cache_disable: encode every time, never store
};
LatentMode latent_mode_for(const DatasetConfig& config);

// `cache` must outlive the source (ignored, may be null, for kEncodeOnly). Images are read from
// `images` (null: the cache's image storage, else local files); on a remote store a batch's images
// and entries are fetched in parallel.
std::unique_ptr<LatentSource> make_latent_source(LatentMode mode, const LatentCache* cache,
                                                 LatentEncodeFn encode, ThreadPool& pool,
                                                 std::shared_ptr<StorageBackend> images = nullptr);

}  // namespace dtune::data
