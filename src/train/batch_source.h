// Where a training step's batch comes from: latents and the family's conditioning, behind
// one interface: SyntheticBatchSource (tests, benchmarks) and DatasetBatchSource (dataset_source.h).
//
// Invariants: a source is deterministic given its state and the generator passed to next(), and
// state()/load_state() capture everything needed to serve the exact next batch after a restart.
// Random numbers come from that generator (the trainer checkpoints it) or, for DatasetBatchSource,
// from generators seeded by the sample's position (so a prefetch thread cannot change them).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dtune::train {

// The model family's conditioning of a batch: name → [B, ...] (family/model_family.h). SDXL:
// prompt_embeds [B, 77, 2048] (CLIP-L ⊕ CLIP-G penultimate states), pooled_prompt_embeds [B, 1280],
// time_ids [B, 6] (orig h, w, crop top, left, target h, w). Flux: prompt_embeds [B, L, 4096] (T5),
// pooled_prompt_embeds [B, 768] (CLIP-L), attention_mask [B, L].
using Conditioning = std::map<std::string, at::Tensor>;

struct TrainBatch {
    at::Tensor latents;                 // [B, C, h, w] scaled VAE latents (what the model is trained on)
    Conditioning cond;                  // see above
    std::vector<std::string> paths;     // the samples' files (for error messages)
    std::vector<std::string> captions;  // the captions before dropout
    // From a dataset with is_regularisation_data: a LoRA run trains it toward the base model's
    // prediction (step.h); a full fine-tune trains it as ordinary data. Its loss is logged apart.
    bool regularisation = false;
};

// One caption's text embedding: the family's text-cache entry (no batch dimension).
using PromptEmbedding = Conditioning;

class BatchSource {
  public:
    virtual ~BatchSource() = default;
    // The next micro-batch (on the source's device). Advances the epoch when one ends.
    virtual TrainBatch next(at::Generator& generator) = 0;
    // Micro-batches per epoch (for num_train_epochs -> steps).
    virtual int64_t batches_per_epoch() const = 0;
    virtual int64_t epoch() const = 0;
    // The empty caption's embedding, for caption dropout.
    virtual PromptEmbedding empty_prompt() = 0;
    virtual nlohmann::json state() const = 0;
    // UsageError when the state does not fit this source (a changed dataset or batch size).
    virtual void load_state(const nlohmann::json& state) = 0;
    // Whether any batch can come from a regularisation dataset.
    virtual bool has_regularisation_data() const { return false; }
};

// Data parallelism: every source's options carry `rank`, `world_size` and `barrier`. Rank r of
// world_size serves rows [r*B, (r+1)*B) of the global micro-batch of world_size*B samples that one
// process with batch world_size*B would serve, and draws its random numbers for that global batch
// (keeping its rows), so the union over ranks is exactly the single-process batch. `barrier` waits
// for every rank (a no-op in one process); a source calls it where ranks must not run ahead (after
// rank 0 builds a shared list or cache).

// Random latents and embeddings of fixed shapes, drawn from the step's generator: for unit tests
// and benchmarks with no dataset.
struct SyntheticBatchOptions {
    int64_t batch_size = 1;
    int64_t latent_channels = 4;
    int64_t latent_size = 8;  // h = w
    int64_t pixel_size = 64;  // what the time ids report
    int64_t tokens = 77;
    int64_t dim = 64;
    int64_t pooled_dim = 32;
    int64_t batches_per_epoch = 4;
    // 0: every batch is drawn anew; N: the first N batches are drawn and then served in turn (the
    // benchmarks: no host work per step; a resumed run draws them again).
    int64_t distinct_batches = 0;
    c10::Device device = c10::Device(c10::kCPU);
    int rank = 0;
    int world_size = 1;
    std::function<void()> barrier = [] {};
};

class SyntheticBatchSource final : public BatchSource {
  public:
    explicit SyntheticBatchSource(SyntheticBatchOptions options);
    TrainBatch next(at::Generator& generator) override;
    int64_t batches_per_epoch() const override { return options_.batches_per_epoch; }
    int64_t epoch() const override { return served_ / options_.batches_per_epoch; }
    PromptEmbedding empty_prompt() override;
    nlohmann::json state() const override;
    void load_state(const nlohmann::json& state) override;

  private:
    TrainBatch draw(at::Generator& generator);

    SyntheticBatchOptions options_;
    int64_t served_ = 0;
    std::vector<TrainBatch> drawn_;  // distinct_batches > 0: the batches served in turn
};

// The real data path (multidatabackend.json, buckets, caches, text encoders) is
// DatasetBatchSource in train/dataset_source.h.

}  // namespace dtune::train
