// DatasetBatchSource construction (see dataset_source.h): datasets → buckets → captions → plans →
// text and latent caches → released encoders. Every rank runs this; rank 0 writes the bucket
// index, the cache work is sharded, and the barrier separates the phases so every rank then sees
// every file.
#include <algorithm>
#include <atomic>
#include <cctype>
#include <optional>
#include <set>
#include <thread>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "data/cache_placement.h"
#include "data/captions.h"
#include "data/dataset_buckets.h"
#include "data/storage.h"
#include "train/dataset_loader.h"

namespace dtune::train::detail {
namespace {

namespace stdfs = std::filesystem;

// SimpleTuner tops every rank's share of a bucket up to ceil(n / world) with the bucket's last
// image, so that its independent per-rank samplers yield equal batch counts. dtune serves one
// global sampler whose batches every rank slices, so ranks are in step by construction, and the
// short last batch of a bucket is filled with already-seen images as in one process (§3.5): the
// batches per epoch are the same, ceil(ceil(n / world) / b) = ceil(n / (world * b)). Padding here
// would only add the duplicate to the global list, which changes its length, hence the shuffled
// order, and so the samples of every step with world size (8 images on 3 ranks x batch 1 were
// served in another order than on 1 process x batch 3). Oversubscribed buckets keep their
// schedule (data/batch_plan.h), which does not depend on this flag.
constexpr bool kPadRankShares = false;

void barrier(const DatasetSourceOptions& o) {
    if (o.barrier) o.barrier();
}

// Every sample's candidate captions; samples without a usable caption are dropped with a warning
// (SimpleTuner would stop; dtune reports and continues). Returns how many were dropped.
size_t resolve_all_captions(LoadedDataset& d) {
    auto storage = data::make_storage(d.config);
    // parquet or csv: captionless rows are kept in the table, their samples skipped below.
    const std::optional<data::MetadataTable> table = data::caption_table_for(d.config, *storage);
    // Caption files in a bucket are one GET each: resolve max_parallel_reads() at a time.
    std::vector<const std::string*> all;
    for (const auto& [key, paths] : d.buckets)
        for (const auto& p : paths) all.push_back(&p);
    std::vector<std::vector<std::string>> found(all.size());
    std::vector<std::string> errors(all.size());
    std::atomic<size_t> next{0};
    auto work = [&] {
        for (size_t i = next++; i < all.size(); i = next++) {
            try {
                found[i] = data::resolve_captions(d.config, *storage, *all[i], table ? &*table : nullptr);
            } catch (const DataError& e) {
                errors[i] = e.what();
            }
        }
    };
    std::vector<std::thread> threads;
    const size_t n = storage->remote() ? size_t(std::max(1, storage->max_parallel_reads())) : 1;
    for (size_t t = 1; t < std::min(n, all.size()); ++t) threads.emplace_back(work);
    work();
    for (auto& t : threads) t.join();
    std::map<std::string, size_t> index;
    for (size_t i = 0; i < all.size(); ++i) index[*all[i]] = i;
    size_t dropped = 0;
    for (auto& [key, paths] : d.buckets) {
        std::vector<std::string> kept;
        for (const auto& p : paths) {
            const size_t i = index.at(p);
            if (!errors[i].empty()) {
                log::warn() << "dataset '" << d.config.id << "': skipping " << p << ": " << errors[i];
                ++dropped;
                continue;
            }
            d.captions[p] = std::move(found[i]);
            kept.push_back(p);
        }
        paths = std::move(kept);
    }
    return dropped;
}

// path → index plan of every sample in d.buckets (what crop_aspect random draws from each epoch).
std::map<std::string, data::SamplePlan> indexed_plans(const LoadedDataset& d) {
    std::map<std::string, data::SamplePlan> out;
    for (const auto& [key, paths] : d.buckets)
        for (const auto& p : paths) out.emplace(p, d.plans.at(p));
    return out;
}

// The effective-batch-size plan and every rank's share of every bucket, concatenated in rank order.
// For crop_aspect random the buckets are epoch 1's draw (what the planner serves first), so this
// start-up check and the per-epoch re-bucketing judge the same buckets by the same rules.
void plan_dataset(LoadedDataset& d, const DatasetSourceOptions& o) {
    for (auto it = d.buckets.begin(); it != d.buckets.end();)
        it = it->second.empty() ? d.buckets.erase(it) : std::next(it);
    data::EpochBuckets first;
    if (data::rebuckets_per_epoch(d.config))
        first = data::rebucket_epoch(data::BucketSettings::from(d.config, o.math), indexed_plans(d), o.seed,
                                     d.config.id, 0, d.pins);
    const auto& buckets = data::rebuckets_per_epoch(d.config) ? first.buckets : d.buckets;
    data::BatchCheckInput in;
    in.dataset_id = d.config.id;
    in.train_batch_size = d.batch_size;
    in.world_size = o.world_size;
    in.gradient_accumulation_steps = o.gradient_accumulation_steps;
    in.repeats = d.config.repeats;
    in.repeats_set_by_user = d.config.repeats_set;
    in.allow_oversubscription = o.allow_dataset_oversubscription;
    in.disable_bucket_pruning = o.disable_bucket_pruning;
    in.apply_padding = kPadRankShares;
    std::map<std::string, int64_t> sizes;
    for (const auto& [key, paths] : buckets) sizes[key] = static_cast<int64_t>(paths.size());
    d.plan = data::plan_epoch(in, sizes);
    d.plan.excluded_before_bucketing = d.excluded_before_bucketing;
    d.global.clear();
    for (int r = 0; r < o.world_size; ++r)
        for (auto& [key, list] :
             data::rank_bucket_lists(buckets, d.plan, d.config.id, o.seed, o.world_size, r, kPadRankShares))
            d.global[key].insert(d.global[key].end(), list.begin(), list.end());
    // SimpleTuner's later check (_handle_config_versioning): every bucket pruned or excluded.
    if (d.global.empty() && d.plan.total_samples == 0 && !d.excluded_before_bucketing.empty()) {
        // Nothing reached a bucket: the batch size is not the cause, the filters are.
        std::string filters;
        for (const auto& [reason, count] : d.excluded_before_bucketing)
            filters += str(filters.empty() ? "" : ", ", count, " ", reason);
        throw UsageError(
            str("(id=", d.config.id, ") Dataset produced no usable samples: every image was left ",
                "out before bucketing (", filters, "). Relax that setting in ",
                o.data_backend_config.string(), " or add images that pass it.\n", d.plan.report()));
    }
    if (d.global.empty())
        throw UsageError(
            str("(id=", d.config.id, ") Dataset produced no usable samples. This typically happens ",
                "when: batch_size * num_gpus * gradient_accumulation_steps is too large for the ",
                "buckets (each bucket needs at least train_batch_size images), or every image was ",
                "filtered out. Lower train_batch_size, add images, set repeats or enable ",
                "allow_dataset_oversubscription.\n", d.plan.report()));
    d.report.samples = 0;
    d.report.buckets.clear();
    for (const auto& [key, list] : d.global) {
        d.report.samples += static_cast<int64_t>(list.size());
        d.report.buckets.push_back(key);
    }
}

LoadedDataset bucket_dataset(const data::DatasetConfig& config, const DatasetSourceOptions& o,
                             bool write_index, ThreadPool& pool) {
    LoadedDataset d;
    d.config = config;
    d.batch_size = config.train_batch_size;
    data::BucketBuildOptions bo;
    bo.output_dir = o.global.output_dir;
    bo.seed = o.seed;
    bo.world_size = o.world_size;
    bo.rank = o.rank;
    bo.gradient_accumulation_steps = o.gradient_accumulation_steps;
    bo.allow_dataset_oversubscription = o.allow_dataset_oversubscription;
    bo.disable_bucket_pruning = o.disable_bucket_pruning;
    bo.apply_padding = kPadRankShares;
    bo.write_index = write_index;
    bo.show_progress = o.show_progress && o.rank == 0;
    bo.math = o.math;
    data::DatasetBuckets built = data::build_dataset_buckets(config, bo, pool);  // EBS check included
    d.excluded_before_bucketing = built.plan.excluded_before_bucketing;
    data::RedrawCandidates candidates = data::redraw_candidates(std::move(built.index), config);
    d.buckets = std::move(candidates.buckets);
    d.plans = std::move(candidates.plans);
    return d;
}

std::shared_ptr<data::TextEmbedCache> text_cache_for(const data::DatasetConfig& d,
                                                     const data::DataBackendConfig& all,
                                                     const DatasetSourceOptions& o,
                                                     const DatasetEncoders& enc) {
    const auto* entry = all.find(d.text_embeds);
    data::TextCacheSettings ts;
    ts.cache_dir = entry && !entry->cache_dir.empty() ? entry->cache_dir : o.global.cache_dir_text;
    // An `aws` text_embeds entry keeps the embeddings in its bucket (cache_dir is the key prefix).
    ts.storage = data::text_cache_storage(entry);
    ts.model_family = o.global.model_family;
    ts.encoder_identity = enc.text_identity;
    ts.tensor_names = enc.text_tensor_names;
    ts.compression = (entry ? entry->compress_cache : o.global.compress_disk_cache)
                         ? data::CacheCompression::kZstd
                         : data::CacheCompression::kNone;
    return std::make_shared<data::TextEmbedCache>(ts);
}

// The buckets training draws its latents from. A bucket plan_dataset pruned (fewer images than
// one batch) is never served, so its images are not encoded: a lone 20000x10 image cost 50 s
// of VAE time at 128000x64 for nothing. crop_aspect random draws its buckets again every epoch,
// so it keeps them all.
std::map<std::string, std::vector<std::string>> served_buckets(const LoadedDataset& d) {
    if (data::rebuckets_per_epoch(d.config)) return d.buckets;
    std::map<std::string, std::vector<std::string>> out;
    for (const auto& [key, paths] : d.buckets)
        if (d.global.count(key)) out.emplace(key, paths);
    return out;
}

bool latents_in_bucket(const LoadedDataset& d) {
    return d.latent_cache && d.latent_cache->storage().remote();
}

// Paths of every rank's skipped-image report of a dataset's latent cache (in the shared
// output_dir when the latents live in a bucket).
std::string skip_report_path(const LoadedDataset& d, const DatasetSourceOptions& o, int rank) {
    const stdfs::path dir = latents_in_bucket(d)
                                ? stdfs::path(o.global.output_dir) / "cache" / "skipped" / d.config.id
                                : stdfs::path(d.config.cache_dir_vae);
    return (dir / str("skipped_images_rank", rank, ".json")).string();
}

// True when every path exists in `storage`: stat() per file locally, one listing of `dir` remotely.
bool all_present(const data::StorageBackend& storage, const std::string& dir,
                 const std::vector<std::string>& paths) {
    if (!storage.remote()) {
        for (const auto& p : paths)
            if (!stdfs::exists(p)) return false;
        return true;
    }
    const auto listed = storage.list_files(dir, {});
    const std::set<std::string> have(listed.begin(), listed.end());
    for (const auto& p : paths)
        if (!have.count(storage.join("", p))) return false;
    return true;
}

// After the barrier: drops images any rank could not decode (listed in its report) and replans.
void drop_unreadable(LoadedDataset& d, const DatasetSourceOptions& o) {
    std::set<std::string> bad;
    for (int r = 0; r < o.world_size; ++r) {
        const std::string path = skip_report_path(d, o, r);
        if (!stdfs::exists(path)) continue;
        const auto report = nlohmann::json::parse(fs::read_file(path));  // {path: reason}
        for (auto it = report.begin(); it != report.end(); ++it) bad.insert(it.key());
    }
    if (bad.empty()) return;
    for (auto& [key, paths] : d.buckets)
        paths.erase(
            std::remove_if(paths.begin(), paths.end(), [&](const auto& p) { return bad.count(p) > 0; }),
            paths.end());
    log::warn() << "dataset '" << d.config.id << "': " << bad.size()
                << " unreadable image(s) left out (listed in " << skip_report_path(d, o, 0) << " …)";
    d.excluded_before_bucketing["unreadable when encoded (see skipped_images)"] += int64_t(bad.size());
    plan_dataset(d, o);
}

void build_text_caches(std::vector<LoadedDataset>& datasets, const DatasetSourceOptions& o,
                       const DatasetEncoders& enc, ThreadPool& pool) {
    // One build per cache folder; "" (caption dropout) goes into the first dataset's cache. `dtune
    // cache` batches the same captions the same way (batched encoders round differently per batch).
    std::map<std::string, std::pair<std::shared_ptr<data::TextEmbedCache>, std::vector<std::string>>> by_dir;
    std::map<std::string, int> batch_of;
    for (size_t i = 0; i < datasets.size(); ++i) {
        auto& d = datasets[i];
        auto& slot = by_dir[d.text_cache->settings().cache_dir];
        if (!slot.first) {
            slot.first = d.text_cache;
            batch_of[d.text_cache->settings().cache_dir] = d.text_batch_size;
        }
        d.text_cache = slot.first;
        for (const auto& [path, captions] : d.captions)
            slot.second.insert(slot.second.end(), captions.begin(), captions.end());
        if (i == 0) slot.second.emplace_back("");
    }
    for (auto& [dir, slot] : by_dir) {
        data::CacheBuildOptions opt;
        opt.world_size = o.world_size;
        opt.rank = o.rank;
        opt.batch_size = std::max(1, batch_of.at(dir));
        opt.show_progress = o.show_progress && o.rank == 0;
        opt.label = "text embeds";
        opt.should_stop = o.should_stop;
        const auto report = data::build_text_cache(*slot.first, slot.second, enc.text, opt, pool);
        log::info() << "text embeddings in " << dir << ": " << report.summary();
        for (auto& d : datasets)
            if (d.text_cache == slot.first) d.report.text = report;
    }
}

void build_latent_caches(std::vector<LoadedDataset>& datasets, const data::DataBackendConfig& all,
                         const DatasetSourceOptions& o, const DatasetEncoders& enc, ThreadPool& pool) {
    for (auto& d : datasets) {
        if (d.config.vae_cache_disable) continue;
        data::LatentCacheSettings placement =
            data::latent_cache_placement(d.config, all, o.global, enc.vae_identity);
        placement.latent_channels = enc.latent_channels;
        d.latent_cache = std::make_unique<data::LatentCache>(std::move(placement));
        if (d.config.vae_cache_ondemand) continue;
        const auto requests =
            data::prebuild_requests(d.config, served_buckets(d), d.plans, o.seed, d.pins, o.math);
        data::CacheBuildOptions opt;
        opt.world_size = o.world_size;
        opt.rank = o.rank;
        opt.batch_size = std::max(1, d.config.vae_batch_size);
        opt.show_progress = o.show_progress && o.rank == 0;
        opt.label = "latents " + d.config.id;
        opt.report_path = skip_report_path(d, o, o.rank);
        opt.should_stop = o.should_stop;
        d.report.latents = data::build_latent_cache(*d.latent_cache, requests, enc.vae, opt, pool);
        log::info() << "latents of '" << d.config.id << "': " << d.report.latents.summary();
    }
}

// True when every latent entry of every dataset is on disk (so the VAE is not needed again).
// crop_aspect random keeps the VAE: later epochs may pick aspects not cached yet.
bool latents_complete(const std::vector<LoadedDataset>& datasets, const DatasetSourceOptions& o) {
    for (const auto& d : datasets) {
        if (!d.latent_cache || d.config.vae_cache_ondemand || d.rebucket) return false;
        std::vector<std::string> entries;
        for (const auto& [key, requests] :
             data::prebuild_requests(d.config, served_buckets(d), d.plans, o.seed, d.pins, o.math))
            for (const auto& r : requests) entries.push_back(d.latent_cache->entry_path(r).string());
        if (!all_present(d.latent_cache->storage(), d.latent_cache->settings().cache_dir, entries))
            return false;
    }
    return true;
}

// crop_aspect random: what the planner needs to re-bucket the served samples every epoch.
void prepare_rebucketing(LoadedDataset& d, const DatasetSourceOptions& o) {
    if (!data::rebuckets_per_epoch(d.config)) return;
    auto in = std::make_shared<RebucketInputs>();
    in->settings = data::BucketSettings::from(d.config, o.math);
    in->indexed = indexed_plans(d);
    in->pins = d.pins;
    in->check.dataset_id = d.config.id;
    in->check.train_batch_size = d.batch_size;
    in->check.world_size = o.world_size;
    in->check.gradient_accumulation_steps = o.gradient_accumulation_steps;
    in->check.repeats = d.config.repeats;
    in->check.repeats_set_by_user = d.config.repeats_set;
    in->check.allow_oversubscription = o.allow_dataset_oversubscription;
    in->check.disable_bucket_pruning = o.disable_bucket_pruning;
    in->check.apply_padding = kPadRankShares;
    in->seed = o.seed;
    in->world_size = o.world_size;
    d.rebucket = std::move(in);
}

bool text_complete(const std::vector<LoadedDataset>& datasets) {
    for (const auto& d : datasets) {
        std::vector<std::string> entries = {d.text_cache->entry_path("").string()};
        for (const auto& [path, captions] : d.captions)
            for (const auto& c : captions) entries.push_back(d.text_cache->entry_path(c).string());
        if (!all_present(d.text_cache->storage(), d.text_cache->settings().cache_dir, entries)) return false;
    }
    return true;
}

}  // namespace

}  // namespace dtune::train::detail

namespace dtune::train {

data::GlobalDataArgs data_args_from_config(const TrainConfig& c) {
    data::GlobalDataArgs a;
    a.output_dir = c.text("output_dir");
    a.model_family = c.text("model_family");
    a.resolution = c.real("resolution");
    a.resolution_type = data::parse_resolution_type(c.text("resolution_type"), "resolution_type");
    a.minimum_image_size = c.opt_real("minimum_image_size");
    a.maximum_image_size = c.opt_real("maximum_image_size");
    a.target_downsample_size = c.opt_real("target_downsample_size");
    a.instance_prompt = c.text("instance_prompt");
    a.caption_strategy = data::parse_caption_strategy(c.text("caption_strategy"), "caption_strategy");
    a.prepend_instance_prompt = c.flag("prepend_instance_prompt");
    a.only_instance_prompt = c.flag("only_instance_prompt");
    a.skip_file_discovery = c.text("skip_file_discovery");
    a.parquet_filename_column = c.text("parquet_filename_column");
    a.parquet_caption_column = c.text("parquet_caption_column");
    a.train_batch_size = static_cast<int>(c.integer("train_batch_size"));
    a.cache_dir_vae = c.text("cache_dir_vae");
    a.cache_dir_text = c.text("cache_dir_text").empty()
                           ? (std::filesystem::path(a.output_dir) / "cache" / "text").string()
                           : c.text("cache_dir_text");
    a.vae_cache_disable = c.flag("vae_cache_disable");
    a.vae_cache_ondemand = c.flag("vae_cache_ondemand");
    a.random_flip = c.flag("random_flip");
    a.compress_disk_cache = c.flag("compress_disk_cache");
    a.vae_batch_size = static_cast<int>(c.integer("vae_batch_size"));
    a.caption_dropout_probability = c.real("caption_dropout_probability");
    return a;
}

}  // namespace dtune::train

namespace dtune::train::detail {

SetupResult setup_datasets(const DatasetSourceOptions& o, DatasetEncoders enc, ThreadPool& pool) {
    const auto all = data::load_data_backend_config(o.data_backend_config, o.global);
    if (o.rank == 0)
        for (const auto& w : all.warnings) log::warn() << o.data_backend_config.string() << ": " << w;
    std::vector<data::DatasetConfig> configs;
    for (const auto& d : all.datasets) {
        if (d.dataset_type == data::DatasetType::kImage)
            configs.push_back(d);  // `type: aws` images stream from the bucket (no local copy)
        else if (d.is_image_like())
            log::info() << "dataset '" << d.id << "' (" << data::to_string(d.dataset_type)
                        << ") is not trained on; dtune trains on image datasets only";
    }
    DTUNE_CHECK_AS(UsageError, !configs.empty(), o.data_backend_config.string(),
                   " has no enabled image dataset; add an entry with \"dataset_type\": \"image\" and "
                   "instance_data_dir");
    SetupResult out;
    // Rank 0 scans and writes the bucket index; the others read what it wrote.
    if (o.rank == 0)
        for (const auto& c : configs) out.datasets.push_back(bucket_dataset(c, o, true, pool));
    barrier(o);
    if (o.rank != 0)
        for (const auto& c : configs) out.datasets.push_back(bucket_dataset(c, o, false, pool));
    for (auto& d : out.datasets) {
        d.pins = data::load_aspect_pins(d.config, o.global.output_dir);
        const size_t captionless = resolve_all_captions(d);
        if (captionless > 0) d.excluded_before_bucketing["without a usable caption"] += int64_t(captionless);
        plan_dataset(d, o);
        // The plan logged while bucketing still counted them; this is the one training uses.
        if (captionless > 0 && o.rank == 0)
            log::info() << captionless << " sample(s) without a usable caption left out; " << d.plan.report();
        d.report.dataset = d.config.id;
        d.text_cache = text_cache_for(d.config, all, o, enc);
        const auto* text_entry = all.find(d.config.text_embeds);
        d.text_batch_size = text_entry ? text_entry->text_encoder_batch_size : o.text_encoder_batch_size;
    }
    build_text_caches(out.datasets, o, enc, pool);
    build_latent_caches(out.datasets, all, o, enc, pool);
    barrier(o);  // every rank's share of both caches is on disk from here on
    for (auto& d : out.datasets) {
        drop_unreadable(d, o);
        prepare_rebucketing(d, o);
    }

    const data::TextEmbeds empty = data::text_embeds_for(*out.datasets.front().text_cache, {""}, enc.text);
    for (const auto& [name, t] : empty) out.empty_prompt[name] = t[0];  // one caption: no batch dimension
    out.text_released = text_complete(out.datasets);
    out.vae_released = latents_complete(out.datasets, o);
    if (out.text_released) enc.text = nullptr;  // the closures own the models: this frees them
    if (out.vae_released) enc.vae = nullptr;
    out.text = enc.text;
    out.sample_conditioning = enc.sample_conditioning;
    data::LatentEncodeFn vae = enc.vae;
    if (!vae)
        vae = [](const at::Tensor&, const std::vector<uint64_t>&) -> at::Tensor {
            throw DataError(
                "a latent cache entry became unreadable during training and the VAE was released after "
                "caching; restart the run (the entry is rebuilt at start-up)");
        };
    for (auto& d : out.datasets) {
        const auto mode = data::latent_mode_for(d.config);
        d.latents =
            data::make_latent_source(mode, d.latent_cache.get(), vae, pool, data::make_storage(d.config));
    }
    log::info() << "data: " << out.datasets.size() << " dataset(s); text encoders "
                << (out.text_released ? "released after caching" : "kept") << ", VAE "
                << (out.vae_released ? "released after caching" : "kept");
    return out;
}

}  // namespace dtune::train::detail
