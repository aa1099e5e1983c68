// The cache build pipelines (decode → encode → write), rank shares, and the LatentSource.
#include "data/cache_builder.h"

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <c10/core/Event.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <future>
#include <mutex>
#include <optional>
#include <sstream>

#include "core/error.h"
#include "core/fs.h"
#include "core/interrupted.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/thread_pool.h"
#include "data/batch_plan.h"
#include "data/prefetch.h"
#include "data/sample_variants.h"
#include "io/image_tensor.h"

namespace dtune::data {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}
int64_t nanoseconds_since(Clock::time_point t0) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

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

// Decodes one image into `row` ([3, H, W] of a batch tensor): from the local file, or from the
// bytes the prefetcher fetched (index `fetched`). "" or why it is unreadable.
std::string decode_into(const LatentRequest& r, at::Tensor row, ObjectPrefetcher* ahead, size_t fetched) {
    try {
        if (!ahead)
            row.copy_(io::prepare_image_tensor(r.path, prepare_spec(r)));  // [3, H, W]
        else
            row.copy_(io::prepare_image_tensor_bytes(ahead->take(fetched), r.path, prepare_spec(r)));
        return "";
    } catch (const std::exception& e) {
        return e.what();
    }
}

// One batch on its way to the encoder: decoded on the pool straight into the rows of `images`.
struct PendingBatch {
    std::vector<const LatentRequest*> requests;
    at::Tensor images;                              // [n, 3, H, W] float32
    std::vector<std::future<std::string>> decoded;  // per row: "" or the error
};

// A batch whose encoder work is queued; `latents` are valid once `ready` (if any) has completed.
struct EncodedBatch {
    std::vector<const LatentRequest*> requests;
    at::Tensor latents;               // [n, C, h, w] on the CPU
    std::optional<c10::Event> ready;  // set when they come from a device by an asynchronous copy
};

// Runs the encoder on `images` and starts the copy of its latents to host memory without waiting
// for the device, so the caller can queue the next batch behind this one.
EncodedBatch launch_encode(const LatentEncodeFn& encode, const at::Tensor& images,
                           std::vector<const LatentRequest*> requests) {
    std::vector<uint64_t> salts;  // LatentRequest::noise_salt, one per image
    for (const LatentRequest* r : requests) salts.push_back(r->noise_salt);
    at::Tensor latents = encode(images, salts);  // [B, C, h, w]
    DTUNE_CHECK(latents.defined() && latents.dim() == 4 && latents.size(0) == images.size(0),
                "the VAE encoder returned ", latents.defined() ? str(latents.sizes()) : "nothing",
                " for images ", images.sizes(), "; it must return latents [B, C, H/8, W/8]");
    EncodedBatch out{std::move(requests), latents.detach(), std::nullopt};
    if (out.latents.is_cpu()) return out;
    const c10::Device device = out.latents.device();
    out.latents = out.latents.to(at::kCPU, /*non_blocking=*/true);  // into pinned memory
    out.ready.emplace(device.type());
    out.ready->record(at::accelerator::getCurrentStream(device.index()));
    return out;
}

void write_report(const std::string& path, const std::vector<std::pair<std::string, std::string>>& skipped) {
    if (path.empty()) return;
    nlohmann::json j = nlohmann::json::object();
    for (const auto& [file, why] : skipped) j[file] = why;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    fs::write_file_atomic(path, j.dump(2) + "\n");
}

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

// Checks every entry on the pool; returns the requests to encode, grouped by target shape.
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
            log::warn() << "latent cache entry " << cache.entry_path(*all[i]).string() << " (of "
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
    if (seconds > 0 && encoded > 0) o << ", " << format_rate(double(encoded) / seconds, unit, units);
    return o.str();
}

std::map<std::string, std::vector<LatentRequest>> prebuild_requests(
    const DatasetConfig& config, const std::map<std::string, std::vector<std::string>>& buckets,
    const std::map<std::string, SamplePlan>& plans, uint64_t seed, const AspectResolutionMap& pins,
    const BucketMath& math) {
    std::map<std::string, std::vector<LatentRequest>> out;
    auto add = [&](const std::string& key, const std::string& path, const SamplePlan& plan) {
        out[key].push_back({path, plan, false});
        if (config.random_flip) out[key].push_back({path, plan, true});
    };
    if (!rebuckets_per_epoch(config)) {
        for (const auto& [key, paths] : buckets)
            for (const auto& p : paths) add(key, p, plans.at(p));
        return out;
    }
    std::map<std::string, SamplePlan> indexed;
    for (const auto& [key, paths] : buckets)
        for (const auto& p : paths) indexed.emplace(p, plans.at(p));
    const EpochBuckets first =
        rebucket_epoch(BucketSettings::from(config, math), indexed, seed, config.id, 0, pins);
    for (const auto& [key, paths] : first.buckets)
        for (const auto& p : paths) add(key, p, first.plans.at(p));
    return out;
}

std::map<std::string, std::vector<LatentRequest>> shard_requests(
    const std::map<std::string, std::vector<LatentRequest>>& buckets, int world_size, int rank) {
    std::map<std::string, std::vector<LatentRequest>> out;
    for (const auto& [key, requests] : buckets) {
        std::vector<LatentRequest> sorted = requests;
        std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
            return a.path != b.path ? a.path < b.path : a.flip < b.flip;
        });
        auto& mine = out[key];
        for (int64_t i : rank_slice(static_cast<int64_t>(sorted.size()), world_size, rank))
            mine.push_back(sorted[static_cast<size_t>(i)]);
    }
    return out;
}

namespace {

// The decode → encode → write pipeline over `batches` (each: requests of one target shape).
class LatentPipeline {
  public:
    LatentPipeline(const LatentCache& cache, const LatentEncodeFn& encode, const CacheBuildOptions& options,
                   ThreadPool& pool, CacheBuildReport& report,
                   std::map<const LatentRequest*, EntryStatus>& found, Progress& progress,
                   ObjectPrefetcher* ahead)
        : cache_(cache),
          encode_(encode),
          options_(options),
          pool_(pool),
          report_(report),
          found_(found),
          progress_(progress),
          ahead_(ahead),
          pin_(options.pin_memory.value_or(at::hasCUDA())) {
        // Keep every pool thread decoding: about two images per thread in flight (at most 64
        // images of host memory), and never fewer than prefetch_batches batches.
        const size_t batch = size_t(options.batch_size);
        const size_t images = std::min<size_t>(64, 2 * std::max<size_t>(1, pool.size()));
        depth_ = std::max(size_t(std::max(1, options.prefetch_batches)), (images + batch - 1) / batch);
    }

    ~LatentPipeline() {  // an error unwinds through here: no task may outlive the requests or cache
        for (auto& b : queue_)
            for (auto& d : b.decoded)
                if (d.valid()) d.wait();
        for (auto& w : writes_)
            if (w.valid()) w.wait();
        report_.stages.decode = 1e-9 * double(decode_ns_.load());
        report_.stages.write = 1e-9 * double(write_ns_.load());
    }

    // False when options.should_stop ended it early (the batches encoded by then are written).
    bool run(const std::vector<std::vector<const LatentRequest*>>& batches) {
        size_t next = 0;
        std::optional<EncodedBatch> in_flight;
        bool stopped = false;
        while (next < batches.size() || !queue_.empty()) {
            if (options_.should_stop && options_.should_stop()) {
                stopped = true;
                break;
            }
            while (next < batches.size() && queue_.size() < depth_ + 1)
                queue_.push_back(start_decode(batches[next++]));
            PendingBatch batch = std::move(queue_.front());
            queue_.pop_front();
            auto [images, kept] = collect(batch);
            if (kept.empty()) continue;
            const auto t0 = Clock::now();
            EncodedBatch encoded = launch_encode(encode_, images, std::move(kept));
            report_.stages.encode_call += seconds_since(t0);
            ++report_.encoder_calls;
            // The previous batch's copy was queued before this batch's work: it is done or nearly.
            if (in_flight) finish(*in_flight);
            in_flight = std::move(encoded);
        }
        if (in_flight) finish(*in_flight);
        for (auto& w : writes_) w.get();
        writes_.clear();
        return !stopped;
    }

  private:
    PendingBatch start_decode(const std::vector<const LatentRequest*>& requests) {
        const Size target = requests.front()->plan.target;
        PendingBatch pending;
        pending.requests = requests;
        pending.images = at::empty({int64_t(requests.size()), 3, target.height, target.width},
                                   at::TensorOptions().dtype(at::kFloat).pinned_memory(pin_));
        for (size_t i = 0; i < requests.size(); ++i)
            pending.decoded.push_back(
                pool_.submit([this, r = requests[i], row = pending.images[long(i)], fetched = fetched_++] {
                    const auto t0 = Clock::now();
                    std::string error = decode_into(*r, row, ahead_, fetched);
                    decode_ns_ += nanoseconds_since(t0);
                    return error;
                }));
        return pending;
    }

    // Waits for the batch's decodes; unreadable images are reported and dropped from the batch.
    std::pair<at::Tensor, std::vector<const LatentRequest*>> collect(PendingBatch& batch) {
        std::vector<const LatentRequest*> kept;
        std::vector<int64_t> rows;
        for (size_t i = 0; i < batch.decoded.size(); ++i) {
            const auto t0 = Clock::now();
            std::string error = batch.decoded[i].get();
            report_.stages.wait_decode += seconds_since(t0);
            if (!error.empty()) {
                report_.skipped_files.emplace_back(batch.requests[i]->path, std::move(error));
                --counter_of(report_, found_[batch.requests[i]]);  // counted as skipped instead
                progress_.update();
                continue;
            }
            kept.push_back(batch.requests[i]);
            rows.push_back(int64_t(i));
        }
        if (kept.size() == batch.requests.size() || kept.empty()) return {batch.images, std::move(kept)};
        at::Tensor images = batch.images.index_select(0, at::tensor(rows));  // [kept, 3, H, W]
        return {pin_ ? images.pin_memory() : images, std::move(kept)};
    }

    // Splits an encoded batch into entries and writes them on the pool.
    void finish(EncodedBatch& batch) {
        const auto t0 = Clock::now();
        if (batch.ready) batch.ready->synchronize();
        report_.stages.wait_device += seconds_since(t0);
        for (size_t i = 0; i < batch.requests.size(); ++i) {
            at::Tensor one = batch.latents[long(i)].clone();  // [C, h, w], owns its memory
            writes_.push_back(pool_.submit([this, r = batch.requests[i], one] {
                const auto t1 = Clock::now();
                cache_.store(*r, one);
                write_ns_ += nanoseconds_since(t1);
            }));
        }
        progress_.update(static_cast<int64_t>(batch.requests.size()));
        // Bound the write backlog so latents do not pile up in memory.
        while (writes_.size() > depth_ * size_t(options_.batch_size) * 2) {
            writes_.front().get();
            writes_.pop_front();
        }
    }

    const LatentCache& cache_;
    const LatentEncodeFn& encode_;
    const CacheBuildOptions& options_;
    ThreadPool& pool_;
    CacheBuildReport& report_;
    std::map<const LatentRequest*, EntryStatus>& found_;
    Progress& progress_;
    ObjectPrefetcher* ahead_;  // remote images, fetched in batch order; null: local files
    size_t fetched_ = 0;       // the prefetcher's index of the next image to decode
    bool pin_;
    size_t depth_ = 1;
    std::deque<PendingBatch> queue_;
    std::deque<std::future<void>> writes_;
    std::atomic<int64_t> decode_ns_{0}, write_ns_{0};  // summed over pool threads
};

}  // namespace

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

    // Full batches per target shape (only each shape's last batch may be short).
    std::vector<std::vector<const LatentRequest*>> batches;
    for (const auto& [shape, requests] : todo)
        for (size_t i = 0; i < requests.size(); i += size_t(options.batch_size))
            batches.emplace_back(
                requests.begin() + long(i),
                requests.begin() + long(std::min(requests.size(), i + size_t(options.batch_size))));
    // Images in a remote store (S3) are fetched in batch order, max_parallel_reads() at a time,
    // ahead of the decode tasks that take them. Declared before the pipeline, which waits for its
    // decode tasks when it goes away, so no task outlives it.
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
    const bool done =
        LatentPipeline(cache, encode, options, pool, report, found, progress, ahead.get()).run(batches);
    progress.finish();
    if (!done)
        throw Interrupted(str("stopped by a signal while building the cache (", options.label,
                              "): ", progress.count(), " of ", report.total, " entries are done and kept in ",
                              cache.settings().cache_dir, "; run the same command again to continue"));
    report.skipped = static_cast<int64_t>(report.skipped_files.size());
    for (const auto& [file, why] : report.skipped_files) log::warn() << "skipped " << file << ": " << why;
    write_report(options.report_path, report.skipped_files);
    report.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    return report;
}

}  // namespace dtune::data
