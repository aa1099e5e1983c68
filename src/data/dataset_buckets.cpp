// Glue from a dataset entry to this rank's bucket lists.
#include "data/dataset_buckets.h"

#include <algorithm>
#include <random>

#include "core/error.h"
#include "core/log.h"
#include "data/csv_dataset.h"
#include "data/listing_cache.h"
#include "data/sample_variants.h"
#include "data/sampler.h"
#include "data/storage.h"

namespace dtune::data {

void limit_samples(BucketIndex& index, const DatasetConfig& config) {
    if (!config.max_num_samples) return;
    // crop_aspect random trains from the images the aspect filter set aside too (redraw_candidates).
    const bool redraw = rebuckets_per_epoch(config);
    std::vector<std::string> all;
    for (const auto& [path, plan] : index.metadata) all.push_back(path);  // std::map: sorted
    if (redraw) {
        for (const auto& [path, plan] : index.out_of_range) all.push_back(path);
        std::sort(all.begin(), all.end());
    }
    if (static_cast<int64_t>(all.size()) <= *config.max_num_samples) return;
    std::mt19937_64 rng(mix64(hash64(config.id)));
    for (size_t i = all.size(); i > 1; --i) std::swap(all[i - 1], all[rng() % i]);
    for (size_t i = static_cast<size_t>(*config.max_num_samples); i < all.size(); ++i) {
        const std::string& path = all[i];
        if (index.out_of_range.erase(path) == 0) {
            auto& list = index.buckets[bucket_key(index.metadata.at(path).aspect)];
            list.erase(std::remove(list.begin(), list.end(), path), list.end());
            index.metadata.erase(path);
        } else {  // its aspect-filter entry in `skipped` gives way to this reason
            index.skipped.erase(std::remove_if(index.skipped.begin(), index.skipped.end(),
                                               [&](const auto& s) { return s.first == path; }),
                                index.skipped.end());
        }
        index.skipped.emplace_back(path, "beyond max_num_samples " + std::to_string(*config.max_num_samples));
    }
    for (auto it = index.buckets.begin(); it != index.buckets.end();)
        it = it->second.empty() ? index.buckets.erase(it) : std::next(it);
}

RedrawCandidates redraw_candidates(BucketIndex index, const DatasetConfig& config) {
    RedrawCandidates out{std::move(index.buckets), std::move(index.metadata)};
    if (!rebuckets_per_epoch(config)) return out;
    // Out-of-range keys are never keys of `buckets`, and the map is sorted, so lists stay sorted.
    for (auto& [path, plan] : index.out_of_range) {
        out.buckets[bucket_key(plan.aspect)].push_back(path);
        out.plans.emplace(path, plan);
    }
    return out;
}

std::string skip_kind(const DatasetConfig& config, const std::string& reason) {
    // Named after the setting that removed them, so the fix is findable in the config.
    if (reason.rfind("too small", 0) == 0)
        return str("removed by minimum_image_size ", config.minimum_image_size.value_or(0));
    if (reason.rfind("beyond max_num_samples", 0) == 0)
        return str("removed by max_num_samples ", config.max_num_samples.value_or(0));
    if (reason.find("aspect_ratio") != std::string::npos) return "removed by minimum/maximum_aspect_ratio";
    return "unreadable (see skipped_files)";
}

DatasetBuckets build_dataset_buckets(const DatasetConfig& config, const BucketBuildOptions& options,
                                     ThreadPool& pool) {
    DTUNE_CHECK_AS(UsageError, config.is_image_like(), "dataset '", config.id, "' is a ",
                   to_string(config.dataset_type), " entry; only image datasets have buckets");
    // A csv dataset's images are fetched into csv_cache_dir by the process that scans them.
    if (config.type == StorageType::kCsv && options.write_index) {
        const CsvFetchReport r = fetch_csv_images(config);
        log::info() << "dataset '" << config.id << "': " << r.rows << " image(s) listed in "
                    << config.csv->file << ": " << r.fetched << " fetched, " << r.reused << " already in "
                    << config.csv->cache_dir;
    }
    std::shared_ptr<StorageBackend> storage = make_storage(config);
    // Every listing is recorded in output_dir; preserve_data_backend_cache reuses it.
    if (!options.output_dir.empty())
        storage = std::make_shared<ListingCacheStorage>(
            storage, listing_cache_path(options.output_dir, config.id), config.preserve_data_backend_cache);
    const BucketSettings settings = BucketSettings::from(config, options.math);
    DatasetBuckets out;
    // Bucket shapes are pinned per resolution in area mode only (the pixel calculator has no map).
    const bool pin = config.resolution_type == ResolutionType::kArea && !options.output_dir.empty();
    AspectResolutionMap map(config.resolution);
    if (pin) map.load(options.output_dir);
    const bool loaded = out.index.load(*storage, config);
    if (options.write_index && (!loaded || !config.skip_aspect_discovery)) {
        out.newly_scanned = out.index.refresh(*storage, config, settings, pool, pin ? &map : nullptr,
                                              options.seed, options.show_progress);
        out.index.save(*storage, config);
        if (pin) map.save(options.output_dir);
    } else if (!loaded) {
        throw DataError(
            str("dataset '", config.id, "': ", BucketIndex::indices_path(config),
                " is missing or stale and this rank does not write it; run discovery on the node's "
                "first rank before the others read it"));
    }
    limit_samples(out.index, config);
    // What epoch 1 trains on: the index's buckets, or for crop_aspect random epoch 1's own draw.
    std::map<std::string, std::vector<std::string>> served;
    const bool redraw = rebuckets_per_epoch(config);
    if (redraw) {
        const RedrawCandidates c = redraw_candidates(out.index, config);
        std::map<std::string, SamplePlan> indexed;
        for (const auto& [key, paths] : c.buckets)
            for (const auto& p : paths) indexed.emplace(p, c.plans.at(p));
        served = rebucket_epoch(settings, indexed, options.seed, config.id, 0, map).buckets;
    }
    const auto& buckets = redraw ? served : out.index.buckets;
    std::map<std::string, int64_t> sizes;
    for (const auto& [key, paths] : buckets) sizes[key] = static_cast<int64_t>(paths.size());
    BatchCheckInput in;
    in.dataset_id = config.id;
    in.train_batch_size = config.train_batch_size;
    in.world_size = options.world_size;
    in.gradient_accumulation_steps = options.gradient_accumulation_steps;
    in.repeats = config.repeats;
    in.repeats_set_by_user = config.repeats_set;
    in.allow_oversubscription = options.allow_dataset_oversubscription;
    in.disable_bucket_pruning = options.disable_bucket_pruning;
    in.apply_padding = options.apply_padding;
    in.is_eval = config.dataset_type == DatasetType::kEval;
    out.plan = plan_epoch(in, sizes);
    for (const auto& [path, reason] : out.index.skipped) {
        if (redraw && out.index.out_of_range.count(path)) continue;  // drawn again every epoch
        ++out.plan.excluded_before_bucketing[skip_kind(config, reason)];
    }
    out.local =
        rank_bucket_lists(buckets, out.plan, config.id, options.seed, in.is_eval ? 1 : options.world_size,
                          in.is_eval ? 0 : options.rank, in.apply_padding);
    log::info() << out.plan.report();
    return out;
}

}  // namespace dtune::data
