// Text-embedding cache build and lookup, and the LatentSource implementations.
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <set>

#include "core/error.h"
#include "core/interrupted.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/thread_pool.h"
#include "data/batch_plan.h"
#include "data/cache_builder.h"
#include "io/image_tensor.h"

namespace dtune::data {
namespace {

// Runs the text encoder and checks the batch shapes: every tensor [B, ...], on the CPU.
TextEmbeds run_text_encoder(const TextEncodeFn& encode, const std::vector<std::string>& captions) {
    TextEmbeds out = encode(captions);
    const auto n = static_cast<int64_t>(captions.size());
    DTUNE_CHECK(!out.empty(), "the text encoder returned no tensors for ", n, " captions");
    for (auto& [name, t] : out) {
        DTUNE_CHECK(t.defined() && t.dim() >= 1 && t.size(0) == n, "the text encoder's ", name,
                    " must have one row per caption (", n, "), got ",
                    t.defined() ? c10::str(t.sizes()) : std::string("nothing"));
        t = t.detach().to(at::kCPU);
    }
    return out;
}

// Row k of every tensor of a batch (a cache entry).
TextEmbedEntry row_of(const TextEmbeds& embeds, int64_t k) {
    TextEmbedEntry entry;
    for (const auto& [name, t] : embeds) entry[name] = t[k].clone();
    return entry;
}

io::PrepareSpec spec_of(const LatentRequest& r) {
    return {r.plan.resize_size.width, r.plan.resize_size.height, r.plan.crop_top, r.plan.crop_left,
            r.plan.target.width,      r.plan.target.height,      r.flip};
}

class CachedLatentSource final : public LatentSource {
  public:
    CachedLatentSource(LatentMode mode, const LatentCache* cache, LatentEncodeFn encode, ThreadPool& pool,
                       std::shared_ptr<StorageBackend> images)
        : mode_(mode), cache_(cache), encode_(std::move(encode)), pool_(pool), images_(std::move(images)) {
        DTUNE_CHECK(mode_ == LatentMode::kEncodeOnly || cache_ != nullptr,
                    "a cached latent source needs a cache");
    }

    at::Tensor get(const std::vector<LatentRequest>& batch) override {
        DTUNE_CHECK(!batch.empty(), "latents asked for an empty batch");
        std::vector<at::Tensor> out(batch.size());  // each [C, h, w]
        std::vector<EntryLookup> found;
        if (mode_ == LatentMode::kCache) {
            std::vector<const LatentRequest*> requests;
            for (const auto& r : batch) requests.push_back(&r);
            found = cache_->load_many(requests, pool_);
            for (size_t i = 0; i < batch.size(); ++i)
                if (found[i].status == EntryStatus::kValid) out[i] = found[i].value;
        }
        std::vector<size_t> missing;
        for (size_t i = 0; i < batch.size(); ++i)
            if (!out[i].defined()) missing.push_back(i);
        if (missing.empty()) return at::stack(out);  // [B, C, h, w]
        try {
            encode_missing(batch, missing, out);
        } catch (const DataError& e) {
            if (found.empty()) throw;  // vae_cache_disable: the image's own error names it
            // Name the entries that sent this batch to the encoder, and why they were unusable.
            std::string entries;
            for (size_t i : missing)
                entries +=
                    str(entries.empty() ? "" : "; ", cache_->entry_path(batch[i]).string(), " (latents of ",
                        batch[i].path, ": ", found[i].reason.empty() ? "missing" : found[i].reason, ")");
            throw DataError(str("latent cache entry ", entries, ": ", e.what()));
        }
        return at::stack(out);  // [B, C, h, w]
    }

    int64_t encoded() const override { return encoded_; }

  private:
    // Decodes on the pool, encodes as one batch, stores on the pool (kCache only).
    void encode_missing(const std::vector<LatentRequest>& batch, const std::vector<size_t>& missing,
                        std::vector<at::Tensor>& out) {
        std::vector<at::Tensor> images(missing.size());  // each [3, H, W]
        std::vector<uint64_t> salts;
        for (size_t i : missing) salts.push_back(batch[i].noise_salt);
        if (images_ && images_->remote()) {
            std::vector<std::string> paths;
            for (size_t k : missing) paths.push_back(batch[k].path);
            const auto bytes = images_->read_many_if_exists(paths);
            pool_.parallel_for(missing.size(), [&](size_t k) {
                DTUNE_CHECK_AS(DataError, bytes[k].has_value(), paths[k], " is gone from ",
                               images_->location(),
                               "; restore it or let the next start-up refresh the bucket index");
                images[k] = io::prepare_image_tensor_bytes(*bytes[k], paths[k], spec_of(batch[missing[k]]));
            });
        } else {
            pool_.parallel_for(missing.size(), [&](size_t k) {
                images[k] = io::prepare_image_tensor(batch[missing[k]].path, spec_of(batch[missing[k]]));
            });
        }
        const at::Tensor latents = encode_(at::stack(images), salts).detach().to(at::kCPU);  // [M, C, h, w]
        DTUNE_CHECK(latents.dim() == 4 && latents.size(0) == static_cast<int64_t>(missing.size()),
                    "the VAE encoder returned ", latents.sizes(), " for ", missing.size(), " images");
        for (size_t k = 0; k < missing.size(); ++k) out[missing[k]] = latents[static_cast<int64_t>(k)];
        encoded_ += static_cast<int64_t>(missing.size());
        if (mode_ == LatentMode::kCache)
            pool_.parallel_for(missing.size(),
                               [&](size_t k) { cache_->store(batch[missing[k]], out[missing[k]]); });
    }

    LatentMode mode_;
    const LatentCache* cache_;
    LatentEncodeFn encode_;
    ThreadPool& pool_;
    std::shared_ptr<StorageBackend> images_;
    int64_t encoded_ = 0;
};

}  // namespace

LatentMode latent_mode_for(const DatasetConfig& config) {
    return config.vae_cache_disable ? LatentMode::kEncodeOnly : LatentMode::kCache;
}

std::unique_ptr<LatentSource> make_latent_source(LatentMode mode, const LatentCache* cache,
                                                 LatentEncodeFn encode, ThreadPool& pool,
                                                 std::shared_ptr<StorageBackend> images) {
    if (!images && cache) images = cache->settings().images;
    return std::make_unique<CachedLatentSource>(mode, cache, std::move(encode), pool, std::move(images));
}

CacheBuildReport build_text_cache(const TextEmbedCache& cache, const std::vector<std::string>& captions,
                                  const TextEncodeFn& encode, const CacheBuildOptions& options,
                                  ThreadPool& pool) {
    DTUNE_CHECK_AS(UsageError, options.batch_size >= 1, "text_encoder_batch_size must be >= 1, got ",
                   options.batch_size);
    const auto start = std::chrono::steady_clock::now();
    const std::set<std::string> distinct(captions.begin(), captions.end());
    const std::vector<std::string> sorted(distinct.begin(), distinct.end());
    BucketEpochPlan plan;
    plan.samples = static_cast<int64_t>(sorted.size());
    std::vector<std::string> mine;
    for (int64_t i : rank_indices(plan, options.world_size, options.rank, false))
        mine.push_back(sorted[static_cast<size_t>(i)]);

    CacheBuildReport report;
    report.unit = "prompt";
    report.units = "prompts";
    report.total = static_cast<int64_t>(mine.size());
    std::vector<EntryStatus> status(mine.size());
    std::vector<std::string> reasons(mine.size());
    if (cache.storage().remote()) {
        std::vector<EntryLookup> found = cache.load_many(mine, nullptr);  // parallel GETs
        for (size_t i = 0; i < mine.size(); ++i) {
            status[i] = found[i].status;
            reasons[i] = std::move(found[i].reason);
        }
    } else {
        pool.parallel_for(mine.size(), [&](size_t i) {
            EntryLookup found = cache.load(mine[i], nullptr);
            status[i] = found.status;
            reasons[i] = std::move(found.reason);
        });
    }
    std::vector<std::string> todo;
    for (size_t i = 0; i < mine.size(); ++i) {
        if (status[i] == EntryStatus::kCorrupt)
            log::warn() << "text cache entry " << cache.entry_path(mine[i]).string()
                        << " is corrupt: " << reasons[i] << "; rebuilding it";
        switch (status[i]) {
            case EntryStatus::kValid: ++report.reused; continue;
            case EntryStatus::kStale: ++report.rebuilt_stale; break;
            case EntryStatus::kCorrupt: ++report.rebuilt_corrupt; break;
            case EntryStatus::kMissing: ++report.built; break;
        }
        todo.push_back(mine[i]);
    }
    Progress progress(
        static_cast<int64_t>(todo.size()),
        {.label = options.label, .unit = "prompt", .units = "prompts", .quiet = !options.show_progress});
    std::vector<std::future<void>> writes;
    for (size_t i = 0; i < todo.size(); i += size_t(options.batch_size)) {
        if (options.should_stop && options.should_stop()) {
            for (auto& w : writes) w.get();  // the embeddings encoded so far stay valid entries
            progress.finish();
            throw Interrupted(str("stopped by a signal while building the cache (", options.label, "): ", i,
                                  " of ", todo.size(), " captions encoded and kept in ",
                                  cache.settings().cache_dir, "; run the same command again to continue"));
        }
        const std::vector<std::string> chunk(
            todo.begin() + long(i),
            todo.begin() + long(std::min(todo.size(), i + size_t(options.batch_size))));
        const TextEmbeds embeds = run_text_encoder(encode, chunk);
        ++report.encoder_calls;
        for (size_t k = 0; k < chunk.size(); ++k) {
            TextEmbedEntry entry = row_of(embeds, long(k));
            writes.push_back(
                pool.submit([&cache, caption = chunk[k], entry] { cache.store(caption, entry); }));
        }
        progress.update(static_cast<int64_t>(chunk.size()));
    }
    for (auto& w : writes) w.get();
    progress.finish();
    report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return report;
}

TextEmbeds text_embeds_for(const TextEmbedCache& cache, const std::vector<std::string>& captions,
                           const TextEncodeFn& encode, bool store) {
    std::vector<TextEmbedEntry> entries;
    const std::vector<EntryLookup> found = cache.load_many(captions, &entries);
    std::vector<std::string> missing;
    std::vector<size_t> where;
    for (size_t i = 0; i < captions.size(); ++i)
        if (found[i].status != EntryStatus::kValid) {
            missing.push_back(captions[i]);
            where.push_back(i);
        }
    if (!missing.empty()) {
        const TextEmbeds fresh = run_text_encoder(encode, missing);
        for (size_t k = 0; k < missing.size(); ++k) {
            entries[where[k]] = row_of(fresh, long(k));
            if (store) cache.store(missing[k], entries[where[k]]);
        }
    }
    TextEmbeds out;
    if (entries.empty()) return out;
    for (const auto& [name, first] : entries.front()) {
        std::vector<at::Tensor> rows;
        for (const auto& e : entries) rows.push_back(e.at(name));
        out[name] = at::stack(rows);  // [B, ...]
    }
    return out;
}

}  // namespace dtune::data
