// The on-disk latent and text-embedding caches: one file per entry, each a safetensors buffer
// (optionally wrapped in zstd or gzip, see cache_codec.h) whose `__metadata__` records what the
// entry was built from. Layout (README "Caches"):
//   <cache_dir_vae>/<image subdirs below instance_data_dir>/<sha256(image stem)><variant>.safetensors
//     tensor "latents" [C, H/8, W/8]; <variant> is "" for the planned crop, "-flip" for its mirror
//     image, and crop_aspect-random datasets add "-<target WxH>_<resize WxH>" before it
//   <text cache_dir>/<sha256(caption)[:32]>-<model_family>-<sha256(encoder identity)[:12]>.safetensors
//     tensors "prompt_embeds" [T, D], "pooled_prompt_embeds" [P]
//
// Invariants: an entry is trusted only when it parses, its format/version match, its recorded
// `key` equals the key recomputed from the live inputs (image path, size, mtime, every preparation
// setting and the encoder identity; or caption and encoder identity), every recorded metadata
// value equals the expected one, the data CRC-32 matches and the shapes are the expected ones.
// Anything else is reported as stale (inputs changed) or corrupt (damaged) and the entry is
// rebuilt; writes go through AtomicFile, so a crash never leaves a half-written entry in place.
// Entries live in a storage backend (local folders, or an S3 bucket for an `aws` image_embeds /
// text_embeds entry, where cache_dir is a key prefix and a PUT is atomic too); images are stat'ed
// (size and mtime locally, size and ETag on S3) through their dataset's backend.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/buckets.h"
#include "data/cache_codec.h"
#include "data/storage.h"

namespace dtune {
class ThreadPool;
}

namespace dtune::data {

inline constexpr const char* kLatentFormat = "dtune.latent";
inline constexpr const char* kTextEmbedFormat = "dtune.text_embed";
inline constexpr int kCacheFormatVersion = 1;

enum class EntryStatus { kValid, kMissing, kStale, kCorrupt };
const char* to_string(EntryStatus status);

// One image to encode: its path and the plan the bucket index computed for it.
struct LatentRequest {
    std::string path;
    SamplePlan plan;  // the crop offsets are those of the unmirrored image
    bool flip = false;
    // Mixed into the posterior sample's seed by the VAE callable: 0 for cache entries (one latent
    // per variant), a per-draw value under vae_cache_disable (a fresh sample every epoch).
    uint64_t noise_salt = 0;
};

struct LatentCacheSettings {
    std::string cache_dir;         // cache_dir_vae
    std::string data_root;         // instance_data_dir: image subfolders are mirrored below cache_dir
    std::string encoder_identity;  // which encoder (and scaling) made the latents; part of the key
    std::string dataset_settings;  // canonical text of the dataset's preparation settings
    CacheCompression compression = CacheCompression::kZstd;
    int64_t latent_channels = 4;
    int downsample = 8;                       // pixels per latent cell
    bool size_in_name = false;                // crop_aspect random: one entry per geometry (see the layout)
    std::shared_ptr<StorageBackend> storage;  // where entries live; null: local folders
    std::shared_ptr<StorageBackend> images;   // where the images live; null: local folders
};

// The preparation settings of a dataset that decide its pixels: resolution, resolution_type,
// crop, crop_style, crop_aspect (+ buckets), size limits. Canonical, one "key=value" per line.
std::string dataset_settings_text(const DatasetConfig& config);

// The latent cache of one image dataset: cache_dir_vae, instance_data_dir, its preparation
// settings and compress_cache (zstd when on).
LatentCacheSettings latent_cache_settings(const DatasetConfig& config, const std::string& encoder_identity);

struct EntryLookup {
    EntryStatus status = EntryStatus::kMissing;
    std::string reason;  // why an entry is stale or corrupt
    at::Tensor value;    // kValid only
};

class LatentCache {
  public:
    explicit LatentCache(LatentCacheSettings settings);
    const LatentCacheSettings& settings() const { return settings_; }

    // The entry of the planned, unmirrored variant (datasets without per-epoch sizes).
    std::filesystem::path entry_path(const std::string& image_path) const;
    // The entry of one variant (flip, and the geometry for crop_aspect random).
    std::filesystem::path entry_path(const LatentRequest& request) const;
    // Canonical text of everything an entry depends on (the key is its SHA-256). Stats the image;
    // DataError when it is gone.
    std::string key_text(const LatentRequest& request) const;
    // Reads and verifies the entry of `request`; `value` is [C, h, w].
    EntryLookup load(const LatentRequest& request) const;
    // The same for many requests: on a remote store the entries are fetched in parallel first,
    // then verified on `pool`. Results in input order.
    std::vector<EntryLookup> load_many(const std::vector<const LatentRequest*>& requests,
                                       ThreadPool& pool) const;
    // Writes latents [C, h, w] atomically (any device/dtype; stored in its dtype).
    void store(const LatentRequest& request, const at::Tensor& latents) const;
    const StorageBackend& storage() const { return *settings_.storage; }
    const StorageBackend& images() const { return *settings_.images; }

  private:
    EntryLookup verify(const LatentRequest& request, const std::optional<std::string>& bytes) const;
    std::map<std::string, std::string> expected_metadata(const LatentRequest& request) const;
    std::string key_text(const LatentRequest& request, const ObjectStat& stamp) const;
    ObjectStat stamp_of(const std::string& image_path) const;
    LatentCacheSettings settings_;
};

struct TextCacheSettings {
    std::string cache_dir;
    std::string model_family = "sdxl";
    std::string encoder_identity;  // part of the key: another text encoder invalidates every entry
    // The tensors an entry must hold (the model family's text-cache layout); an entry with other
    // names reads as corrupt and is rebuilt.
    std::vector<std::string> tensor_names{"pooled_prompt_embeds", "prompt_embeds"};
    CacheCompression compression = CacheCompression::kZstd;
    std::shared_ptr<StorageBackend> storage;  // where entries live; null: local folders
};

// One caption's embeddings: name → tensor without the batch dimension (SDXL: prompt_embeds [T, D]
// and pooled_prompt_embeds [P]; the names are TextCacheSettings::tensor_names).
using TextEmbedEntry = std::map<std::string, at::Tensor>;

class TextEmbedCache {
  public:
    explicit TextEmbedCache(TextCacheSettings settings);
    const TextCacheSettings& settings() const { return settings_; }

    std::filesystem::path entry_path(const std::string& caption) const;
    // `value` of the lookup is unused; `entry` receives the tensors when valid.
    EntryLookup load(const std::string& caption, TextEmbedEntry* entry) const;
    // Many captions; on a remote store fetched in parallel. `entries` gets one slot per caption.
    std::vector<EntryLookup> load_many(const std::vector<std::string>& captions,
                                       std::vector<TextEmbedEntry>* entries) const;
    void store(const std::string& caption, const TextEmbedEntry& entry) const;
    const StorageBackend& storage() const { return *settings_.storage; }

  private:
    EntryLookup verify(const std::string& caption, const std::optional<std::string>& bytes,
                       TextEmbedEntry* entry) const;
    std::map<std::string, std::string> expected_metadata(const std::string& caption) const;
    TextCacheSettings settings_;
};

// Lower level, exposed for tests and tools: a safetensors buffer in memory and back.
std::string serialize_entry(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                            std::map<std::string, std::string> metadata);
// Parses and checks the data CRC; DataError naming `file` on any fault.
std::vector<std::pair<std::string, at::Tensor>> parse_entry(const std::string& bytes, const std::string& file,
                                                            std::map<std::string, std::string>* metadata);

}  // namespace dtune::data
