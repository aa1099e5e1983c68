// Where a training step's batch comes from: latents, prompt embeddings and SDXL time ids, behind
// one interface so the latent / text-embedding caches can replace on-the-fly encoding later.
//
// Invariants: a source is deterministic given its state and the generator passed to next(), and
// state()/load_state() capture everything needed to serve the exact next batch after a restart.
// Every random number a source draws comes from that generator (the trainer checkpoints it).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dtune::train {

struct TrainBatch {
    at::Tensor latents;                 // [B, C, h, w] scaled VAE latents (what the UNet is trained on)
    at::Tensor prompt_embeds;           // [B, 77, D] CLIP-L ⊕ CLIP-G penultimate hidden states
    at::Tensor pooled_embeds;           // [B, P] CLIP-G projected pooled output
    at::Tensor time_ids;                // [B, 6] orig_h, orig_w, crop_top, crop_left, target_h, target_w
    std::vector<std::string> paths;     // the samples' files (for error messages)
    std::vector<std::string> captions;  // the captions before dropout
};

// One caption's text embedding.
struct PromptEmbedding {
    at::Tensor prompt;  // [77, D]
    at::Tensor pooled;  // [P]
};

// Text conditioning for captions. The CLIP text encoders plug in here once they land.
class TextEmbedder {
  public:
    virtual ~TextEmbedder() = default;
    virtual PromptEmbedding encode(const std::string& caption) = 0;
};

// PLACEHOLDER until src/models has SDXL's two CLIP text encoders and encode_prompt: a fixed
// pseudo-random embedding per caption (seeded by a hash of the text), so training runs end to end
// and deterministically. A model trained with it does not follow prompts.
class HashedTextEmbedder final : public TextEmbedder {
  public:
    HashedTextEmbedder(int64_t tokens, int64_t dim, int64_t pooled_dim);
    PromptEmbedding encode(const std::string& caption) override;

  private:
    int64_t tokens_, dim_, pooled_dim_;
};

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
    SyntheticBatchOptions options_;
    int64_t served_ = 0;
};

// Encodes images with the VAE: x -> (z - shift) * scaling, z sampled from the posterior with the
// step's generator. [B, 3, H, W] in [-1, 1] -> [B, C, H/f, W/f]. With data parallelism the
// encoder draws the posterior noise for the global batch and keeps this rank's rows.
using LatentEncoder = std::function<at::Tensor(const at::Tensor& images, at::Generator& generator)>;

// SimpleTuner's vae_cache_disable path for the first image dataset of multidatabackend.json: images
// listed from instance_data_dir, resized (shorter edge) and centre-cropped to a square of the
// dataset's resolution, VAE-encoded on the fly; captions by the dataset's strategy (filename /
// textfile / instanceprompt); one square bucket served by data::BucketSampler.
struct ImageFolderOptions {
    std::filesystem::path data_backend_config;
    std::string output_dir;
    double resolution = 1024;  // the config's fallback
    std::string resolution_type = "pixel_area";
    int batch_size = 1;
    uint64_t seed = 0;
    c10::Device device = c10::Device(c10::kCPU);
    int rank = 0;  // data parallelism (see above)
    int world_size = 1;
    std::function<void()> barrier = [] {};
};

std::unique_ptr<BatchSource> make_image_folder_source(const ImageFolderOptions& options,
                                                      LatentEncoder encoder,
                                                      std::shared_ptr<TextEmbedder> embedder);

}  // namespace dtune::train
