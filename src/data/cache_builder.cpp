// The cache build pipelines (decode → encode → write), rank shares, and the LatentSource.
#include "data/cache_builder.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <deque>
#include <future>
#include <mutex>
#include <optional>
#include <sstream>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/thread_pool.h"
#include "data/batch_plan.h"
#include "data/prefetch.h"
#include "io/image_tensor.h"

namespace dtune::data {
namespace {

using Clock = std::chrono::steady_clock;

io::PrepareSpec prepare_spec(const LatentRequest& r) {
    io::PrepareSpec s;
    s.resize_width = r.plan.resize_size.width;
    s.resize_height = r.plan.resize_size.height;
    s.crop_top = r.plan.crop_top;
    s.crop_left = r.plan.crop_left;
    s.crop_width = r.plan.target.width;
    s.crop_height = r.plan.target.height;
    s.flip = r.flip;
    return s;
}

// A contiguous slice of `n` sorted items for `rank`, as rank_indices() cuts buckets.
std::vector<int64_t> rank_slice(int64_t n, int world_size, int rank) {
    BucketEpochPlan plan;
    plan.samples = n;
    return rank_indices(plan, world_size, rank, /*apply_padding=*/false);
}

// One image decoded for the encoder, or the reason it could not be.
struct Decoded {
    at::Tensor pixels;  // [3, H, W]
    std::string error;
};

// Decodes from the local file, or from the bytes the prefetcher fetched (index `fetched`).
Decoded decode(const LatentRequest& r, ObjectPrefetcher* ahead, size_t fetched) {
    try {
        if (!ahead) return {io::prepare_image_tensor(r.path, prepare_spec(r)), ""};
        return {io::prepare_image_tensor_bytes(ahead->take(fetched), r.path, prepare_spec(r)), ""};
    } catch (const std::exception& e) {
        return {{}, e.what()};
    }
}

struct PendingBatch {
    std::vector<const LatentRequest*> requests;
    std::vector<std::future<Decoded>> pixels;
};

// Encodes `batch` and checks the shape: [B, C, H/8, W/8] with B = images.size(0).
at::Tensor run_encoder(const LatentEncodeFn& encode, const at::Tensor& images) {
    at::Tensor latents = encode(images);  // [B, C, h, w]
    DTUNE_CHECK(latents.defined() && latents.dim() == 4 && latents.size(0) == images.size(0),
                "the VAE encoder returned ", latents.defined() ? str(latents.sizes()) : "nothing",
                " for images ", images.sizes(), "; it must return latents [B, C, H/8, W/8]");
    return latents.detach().to(at::kCPU);
}

void write_report(const std::string& path, const std::vector<std::pair<std::string, std::string>>& skipped) {
    if (path.empty()) return;
    nlohmann::json j = nlohmann::json::object();
    for (const auto& [file, why] : skipped) j[file] = why;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    fs::write_file_atomic(path, j.dump(2) + "\n");
}

// Checks every entry on the pool; returns the requests to encode, grouped by target shape.
// The report counter of an entry found in `status`.
int64_t& counter_of(CacheBuildReport& report, EntryStatus status) {
    switch (status) {
        case EntryStatus::kValid: return report.reused;
        case EntryStatus::kStale: return report.rebuilt_stale;
        case EntryStatus::kCorrupt: return report.rebuilt_corrupt;
        case EntryStatus::kMissing: break;
    }
    return report.built;
}

std::map<std::pair<int, int>, std::vector<const LatentRequest*>> check_entries(
    const LatentCache& cache, const std::vector<const LatentRequest*>& all, CacheBuildReport& report,
    std::map<const LatentRequest*, EntryStatus>& found, ThreadPool& pool, Progress& progress) {
    std::vector<EntryStatus> status(all.size());
    std::vector<std::string> reasons(all.size());
    // A gone image reads as kMissing: the decode step reports it.
    std::vector<EntryLookup> lookups = cache.load_many(all, pool);
    for (size_t i = 0; i < all.size(); ++i) {
        status[i] = lookups[i].status;
        reasons[i] = std::move(lookups[i].reason);
    }
    std::map<std::pair<int, int>, std::vector<const LatentRequest*>> todo;
    for (size_t i = 0; i < all.size(); ++i) {
        if (status[i] == EntryStatus::kCorrupt)
            log::warn() << "latent cache entry " << cache.entry_path(all[i]->path).string() << " (of "
                        << all[i]->path << ") is corrupt: " << reasons[i] << "; rebuilding it";
        ++counter_of(report, status[i]);
        found[all[i]] = status[i];
        if (status[i] == EntryStatus::kValid) {
            progress.update();
            continue;
        }
        todo[{all[i]->plan.target.width, all[i]->plan.target.height}].push_back(all[i]);
    }
    return todo;
}

}  // namespace

std::string CacheBuildReport::summary() const {
    std::ostringstream o;
    o << total << " entries: " << built << " built, " << reused << " reused, " << rebuilt_stale
      << " rebuilt (inputs changed), " << rebuilt_corrupt << " rebuilt (corrupt), " << skipped
      << " skipped (unreadable); " << encoder_calls << " encoder calls, " << format_duration(seconds) << " ("
      << seconds << " s)";
    const int64_t encoded = built + rebuilt_stale + rebuilt_corrupt;
    if (seconds > 0 && encoded > 0) o << ", " << format_rate(double(encoded) / seconds, "img");
    return o.str();
}

std::map<std::string, std::vector<LatentRequest>> shard_requests(
    const std::map<std::string, std::vector<LatentRequest>>& buckets, int world_size, int rank) {
    std::map<std::string, std::vector<LatentRequest>> out;
    for (const auto& [key, requests] : buckets) {
        std::vector<LatentRequest> sorted = requests;
        std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.path < b.path; });
        auto& mine = out[key];
        for (int64_t i : rank_slice(static_cast<int64_t>(sorted.size()), world_size, rank))
            mine.push_back(sorted[static_cast<size_t>(i)]);
    }
    return out;
}

CacheBuildReport build_latent_cache(const LatentCache& cache,
                                    const std::map<std::string, std::vector<LatentRequest>>& buckets,
                                    const LatentEncodeFn& encode, const CacheBuildOptions& options,
                                    ThreadPool& pool) {
    DTUNE_CHECK_AS(UsageError, options.batch_size >= 1, "vae_batch_size must be >= 1, got ",
                   options.batch_size);
    const auto start = Clock::now();
    const auto shard = shard_requests(buckets, options.world_size, options.rank);
    std::vector<const LatentRequest*> all;
    for (const auto& [key, requests] : shard)
        for (const auto& r : requests) all.push_back(&r);
    CacheBuildReport report;
    report.total = static_cast<int64_t>(all.size());
    Progress progress(report.total, {.label = options.label, .unit = "img", .quiet = !options.show_progress});
    std::map<const LatentRequest*, EntryStatus> found;
    const auto todo = check_entries(cache, all, report, found, pool, progress);

    // Full batches per target shape, then a bounded decode-ahead queue feeding the encoder.
    std::vector<std::vector<const LatentRequest*>> batches;
    for (const auto& [shape, requests] : todo)
        for (size_t i = 0; i < requests.size(); i += size_t(options.batch_size))
            batches.emplace_back(
                requests.begin() + long(i),
                requests.begin() + long(std::min(requests.size(), i + size_t(options.batch_size))));
    // Images in a remote store (S3) are fetched in batch order, max_parallel_reads() at a time,
    // ahead of the decode tasks that take them.
    std::unique_ptr<ObjectPrefetcher> ahead;
    if (cache.images().remote()) {
        std::vector<std::string> order;
        for (const auto& b : batches)
            for (const LatentRequest* r : b) order.push_back(r->path);
        const StorageBackend& images = cache.images();
        ahead = std::make_unique<ObjectPrefetcher>(
            std::move(order), [&images](const std::string& p) { return images.read(p); },
            images.max_parallel_reads());
    }
    std::deque<PendingBatch> queue;
    size_t next = 0, fetched = 0;
    auto enqueue = [&] {
        PendingBatch pending;
        for (const LatentRequest* r : batches[next]) {
            pending.requests.push_back(r);
            pending.pixels.push_back(
                pool.submit([r, a = ahead.get(), i = fetched++] { return decode(*r, a, i); }));
        }
        queue.push_back(std::move(pending));
        ++next;
    };
    std::vector<std::future<void>> writes;
    const size_t depth = size_t(std::max(1, options.prefetch_batches));
    try {
        while (next < batches.size() || !queue.empty()) {
            while (next < batches.size() && queue.size() < depth + 1) enqueue();
            PendingBatch batch = std::move(queue.front());
            queue.pop_front();
            std::vector<at::Tensor> images;
            std::vector<const LatentRequest*> kept;
            for (size_t i = 0; i < batch.pixels.size(); ++i) {
                Decoded d = batch.pixels[i].get();
                if (!d.error.empty()) {
                    report.skipped_files.emplace_back(batch.requests[i]->path, d.error);
                    --counter_of(report, found[batch.requests[i]]);  // counted as skipped instead
                    progress.update();
                    continue;
                }
                images.push_back(std::move(d.pixels));
                kept.push_back(batch.requests[i]);
            }
            if (images.empty()) continue;
            const at::Tensor latents = run_encoder(encode, at::stack(images));  // [B, C, h, w]
            ++report.encoder_calls;
            for (size_t i = 0; i < kept.size(); ++i) {
                at::Tensor one = latents[long(i)].clone();  // [C, h, w], owns its memory
                writes.push_back(pool.submit([&cache, r = kept[i], one] { cache.store(*r, one); }));
            }
            progress.update(static_cast<int64_t>(kept.size()));
            // Bound the write backlog so latents do not pile up in memory.
            while (writes.size() > depth * size_t(options.batch_size) * 2) {
                writes.front().get();
                writes.erase(writes.begin());
            }
        }
    } catch (...) {
        // Decode tasks still queued take from `ahead`: let them finish before it goes away.
        for (auto& pending : queue)
            for (auto& f : pending.pixels)
                if (f.valid()) f.wait();
        for (auto& w : writes)
            if (w.valid()) w.wait();
        throw;
    }
    for (auto& w : writes) w.get();
    progress.finish();
    report.skipped = static_cast<int64_t>(report.skipped_files.size());
    for (const auto& [file, why] : report.skipped_files) log::warn() << "skipped " << file << ": " << why;
    write_report(options.report_path, report.skipped_files);
    report.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    return report;
}

}  // namespace dtune::data
