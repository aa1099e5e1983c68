// Header scan on the thread pool, bucket index refresh and its JSON persistence.
#include "data/bucket_index.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <future>
#include <set>

#include "core/error.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/thread_pool.h"
#include "data/captions.h"
#include "data/csv_dataset.h"
#include "data/prefetch.h"
#include "data/sample_variants.h"
#include "data/storage.h"
#include "io/image_info.h"

namespace dtune::data {

using nlohmann::json;

HeaderScan scan_image_headers(const std::vector<std::string>& paths, ThreadPool& pool, bool show_progress,
                              const std::string& label) {
    struct Slot {
        Size size;
        std::string error;
    };
    std::vector<Slot> slots(paths.size());
    // Chunks keep the per-task overhead small; the calling thread owns the progress bar.
    constexpr size_t kChunk = 256;
    std::vector<std::future<void>> chunks;
    for (size_t begin = 0; begin < paths.size(); begin += kChunk) {
        const size_t end = std::min(paths.size(), begin + kChunk);
        chunks.push_back(pool.submit([&, begin, end] {
            for (size_t i = begin; i < end; ++i) {
                try {
                    const io::ImageInfo info = io::read_image_info(paths[i]);
                    slots[i].size = {info.display_width(), info.display_height()};
                } catch (const std::exception& e) {
                    slots[i].error = e.what();
                }
            }
        }));
    }
    ProgressOptions options;
    options.label = label;
    options.unit = "img";
    options.quiet = !show_progress;
    Progress progress(static_cast<int64_t>(paths.size()), options);
    for (size_t c = 0; c < chunks.size(); ++c) {
        chunks[c].get();
        progress.update(static_cast<int64_t>(std::min(kChunk, paths.size() - c * kChunk)));
    }
    progress.finish();
    HeaderScan scan;
    for (size_t i = 0; i < paths.size(); ++i) {
        if (slots[i].error.empty())
            scan.images.emplace_back(paths[i], slots[i].size);
        else
            scan.failed.emplace_back(paths[i], slots[i].error);
    }
    return scan;
}

HeaderScan scan_image_headers(const std::vector<std::string>& paths, const StorageBackend& storage,
                              ThreadPool& pool, bool show_progress, const std::string& label) {
    if (!storage.remote()) return scan_image_headers(paths, pool, show_progress, label);
    constexpr size_t kHead = 64 * 1024;  // what read_image_info reads locally
    ObjectPrefetcher ahead(
        paths, [&](const std::string& p) { return storage.read_prefix(p, kHead); },
        storage.max_parallel_reads());
    ProgressOptions options;
    options.label = label;
    options.unit = "img";
    options.quiet = !show_progress;
    Progress progress(static_cast<int64_t>(paths.size()), options);
    HeaderScan scan;
    for (size_t i = 0; i < paths.size(); ++i) {
        try {
            std::string head = ahead.take(i);
            io::ImageInfo info;
            std::string error;
            auto parse = [&](const std::string& bytes, bool whole) {
                return io::parse_image_info(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                                            whole, info, error);
            };
            io::ParseStatus status = parse(head, head.size() < kHead);
            if (status == io::ParseStatus::kNeedMore) status = parse(storage.read(paths[i]), true);
            if (status != io::ParseStatus::kOk)
                throw DataError(str(paths[i], ": ", error, "; the file is skipped (re-export or delete it)"));
            scan.images.emplace_back(paths[i], Size{info.display_width(), info.display_height()});
        } catch (const std::exception& e) {
            scan.failed.emplace_back(paths[i], e.what());
        }
        progress.update();
    }
    progress.finish();
    return scan;
}

namespace {

const std::vector<std::string> kImageExtensions = {".jpg", ".jpeg", ".png", ".webp"};

// The settings that decide every plan; a change invalidates the stored metadata. config_version
// counts changes of the geometry itself: 3 is SimpleTuner bc8e6ab's (intermediaries keep the exact
// aspect), so metadata written by version 2 (stretched resizes) is rebuilt, not trusted. Latent
// cache entries need no bump: their key holds the plan's sizes, so they go stale with it.
json settings_snapshot(const DatasetConfig& c) {
    json buckets = json::array();
    for (const auto& b : c.crop_aspect_buckets)
        buckets.push_back(b.weight ? json{{"aspect", b.aspect}, {"weight", *b.weight}} : json(b.aspect));
    auto opt = [](const std::optional<double>& v) { return v ? json(*v) : json(); };
    return {{"crop", c.crop},
            {"crop_style", to_string(c.crop_style)},
            {"crop_aspect", to_string(c.crop_aspect)},
            {"crop_aspect_buckets", buckets},
            {"resolution", c.resolution},
            {"resolution_type", to_string(c.resolution_type)},
            {"minimum_image_size", opt(c.minimum_image_size)},
            {"maximum_image_size", opt(c.maximum_image_size)},
            {"target_downsample_size", opt(c.target_downsample_size)},
            {"minimum_aspect_ratio", opt(c.minimum_aspect_ratio)},
            {"maximum_aspect_ratio", opt(c.maximum_aspect_ratio)},
            {"max_upscale_threshold", opt(c.max_upscale_threshold)},
            {"config_version", 3}};
}

json size_json(Size s) {
    return json::array({s.width, s.height});
}
Size size_from(const json& j) {
    return {j.at(0).get<int>(), j.at(1).get<int>()};
}

SamplePlan plan_from(const json& m) {
    SamplePlan plan;
    plan.original = size_from(m.at("original_size"));
    plan.intermediary = size_from(m.at("intermediary_size"));
    plan.target = size_from(m.at("target_size"));
    plan.resize_size = m.contains("resize_size") ? size_from(m["resize_size"]) : plan.intermediary;
    plan.crop_top = m.at("crop_coordinates").at(0).get<int>();
    plan.crop_left = m.at("crop_coordinates").at(1).get<int>();
    plan.aspect = m.at("aspect_ratio").get<double>();
    return plan;
}

uint64_t path_seed(uint64_t seed, const std::string& path) {
    return seed ^ (std::hash<std::string>{}(path)*0x9E3779B97F4A7C15ull);
}

}  // namespace

std::string BucketIndex::indices_path(const DatasetConfig& c) {
    return (std::filesystem::path(c.instance_data_dir) /
            ("aspect_ratio_bucket_indices_" + c.cache_file_suffix + ".json"))
        .string();
}

std::string BucketIndex::metadata_path(const DatasetConfig& c) {
    return (std::filesystem::path(c.instance_data_dir) /
            ("aspect_ratio_bucket_metadata_" + c.cache_file_suffix + ".json"))
        .string();
}

void BucketIndex::add(const std::string& path, const SamplePlan& plan) {
    metadata[path] = plan;
    auto& list = buckets[bucket_key(plan.aspect)];
    list.insert(std::upper_bound(list.begin(), list.end(), path), path);
}

void BucketIndex::remove_missing(const std::vector<std::string>& present) {
    const std::set<std::string> keep(present.begin(), present.end());
    for (auto it = buckets.begin(); it != buckets.end();) {
        auto& list = it->second;
        const size_t before = list.size();
        list.erase(std::remove_if(list.begin(), list.end(), [&](const auto& p) { return !keep.count(p); }),
                   list.end());
        stats.not_found += static_cast<int64_t>(before - list.size());
        it = list.empty() ? buckets.erase(it) : std::next(it);
    }
    for (auto* plans : {&metadata, &out_of_range})
        for (auto it = plans->begin(); it != plans->end();)
            it = keep.count(it->first) ? std::next(it) : plans->erase(it);
}

namespace {

// Sizes of new files: with metadata_backend parquet, from the table's width/height columns
// without opening the images (SimpleTuner's parquet backend); files the table does not size are
// header-scanned like discovery. Sorted by path, so first-seen pinning stays stable.
HeaderScan sizes_of(const std::vector<std::string>& fresh, const StorageBackend& storage,
                    const DatasetConfig& config, ThreadPool& pool, bool show_progress) {
    std::vector<std::string> to_scan;
    std::vector<std::pair<std::string, Size>> from_table;
    if (config.metadata_backend == MetadataBackendKind::kParquet && config.parquet) {
        const MetadataTable table = MetadataTable::load(storage, *config.parquet, false);
        for (const auto& f : fresh) {
            const MetadataRow* row = table.find_for_path(f);
            if (row && row->width && row->height && *row->width > 0 && *row->height > 0)
                from_table.emplace_back(f, Size{*row->width, *row->height});
            else
                to_scan.push_back(f);
        }
    } else {
        to_scan = fresh;
    }
    HeaderScan scan = scan_image_headers(to_scan, storage, pool, show_progress, "discovery " + config.id);
    if (from_table.empty()) return scan;
    scan.images.insert(scan.images.end(), from_table.begin(), from_table.end());
    std::sort(scan.images.begin(), scan.images.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    return scan;
}

}  // namespace

int64_t BucketIndex::refresh(StorageBackend& storage, const DatasetConfig& config,
                             const BucketSettings& settings, ThreadPool& pool, AspectResolutionMap* map,
                             uint64_t seed, bool show_progress) {
    std::vector<std::string> files = storage.list_files(config.instance_data_dir, kImageExtensions);
    if (config.type == StorageType::kCsv) files = csv_rows_only(config, files);  // not stray files
    // SimpleTuner stops here too ("No images were discovered by the bucket manager"); without this
    // the run stopped later with advice about batch sizes that does not fit an empty folder.
    if (files.empty())
        throw DataError(str("dataset '", config.id, "': no images were discovered in instance_data_dir '",
                            config.instance_data_dir,
                            "' (looked for .jpg, .jpeg, .png and .webp files, subfolders included); "
                            "add images there or point instance_data_dir at the folder that holds them"));
    remove_missing(files);
    skipped.clear();
    std::vector<std::string> fresh;
    for (const auto& f : files)
        if (!metadata.count(f) && !out_of_range.count(f)) fresh.push_back(f);
    HeaderScan scan = sizes_of(fresh, storage, config, pool, show_progress);
    for (const auto& [path, reason] : scan.failed) {
        skipped.emplace_back(path, reason);
        ++stats.error;
    }
    for (const auto& [path, size] : scan.images) {  // in sorted path order: first-seen pinning is stable
        ++stats.total_processed;
        if (std::string reason = resolution_filter_reason(settings, size); !reason.empty()) {
            skipped.emplace_back(path, reason);
            ++stats.too_small;
            continue;
        }
        std::mt19937_64 rng(path_seed(seed, path));
        add(path, plan_sample(settings, size, rng, map));
    }
    for (auto it = buckets.begin(); it != buckets.end();) {
        if (bucket_in_aspect_range(settings, std::stod(it->first))) {
            ++it;
            continue;
        }
        for (const auto& p : it->second) {
            out_of_range[p] = metadata.at(p);
            metadata.erase(p);
            ++stats.aspect_filtered;
        }
        it = buckets.erase(it);
    }
    // crop_aspect random trains on a fresh draw every epoch, so for it this draw decides nothing.
    const std::string redrawn =
        rebuckets_per_epoch(config) ? " (crop_aspect random draws it again every epoch)" : "";
    for (const auto& [path, plan] : out_of_range)
        skipped.emplace_back(
            path, "bucket " + bucket_key(plan.aspect) + " is outside minimum/maximum_aspect_ratio" + redrawn);
    if (!skipped.empty())
        log::warn() << "dataset '" << config.id << "': " << skipped.size()
                    << " file(s) not bucketed (first: " << skipped.front().second << "); all listed in "
                    << skipped_path(config);
    return static_cast<int64_t>(fresh.size());
}

void BucketIndex::save(StorageBackend& storage, const DatasetConfig& config) const {
    json indices = json::object();
    for (const auto& [key, paths] : buckets) indices[key] = paths;
    json doc = {{"config", settings_snapshot(config)},
                {"aspect_ratio_bucket_indices", indices},
                {"filtering_statistics",
                 {{"total_processed", stats.total_processed},
                  {"skipped",
                   {{"too_small", stats.too_small},
                    {"not_found", stats.not_found},
                    {"error", stats.error},
                    {"aspect_ratio", stats.aspect_filtered}}}}}};
    json meta = json::object();
    for (const auto* plans : {&metadata, &out_of_range}) {
        for (const auto& [path, p] : *plans) {
            json m = {{"original_size", size_json(p.original)},
                      {"crop_coordinates", {p.crop_top, p.crop_left}},
                      {"target_size", size_json(p.target)},
                      {"intermediary_size", size_json(p.intermediary)},
                      {"aspect_ratio", p.aspect}};
            if (!(p.resize_size == p.intermediary))
                m["resize_size"] = size_json(p.resize_size);  // dtune extension
            meta[path] = std::move(m);
        }
    }
    // Metadata first: an index is never on disk without the metadata it refers to.
    storage.write(metadata_path(config), meta.dump());
    storage.write(indices_path(config), doc.dump());
    // Every file left out, with the reason, so nothing disappears silently.
    json report = json::object();
    for (const auto& [path, reason] : skipped) report[path] = reason;
    storage.write(skipped_path(config), report.dump(2));
}

std::string BucketIndex::skipped_path(const DatasetConfig& c) {
    return (std::filesystem::path(c.instance_data_dir) / ("skipped_files_" + c.cache_file_suffix + ".json"))
        .string();
}

bool BucketIndex::load(const StorageBackend& storage, const DatasetConfig& config) {
    buckets.clear();
    metadata.clear();
    out_of_range.clear();
    if (!storage.exists(indices_path(config)) || !storage.exists(metadata_path(config))) return false;
    try {
        const json doc = json::parse(storage.read(indices_path(config)));
        if (doc.value("config", json::object()) != settings_snapshot(config)) {
            log::warn() << "dataset '" << config.id << "': bucketing settings changed since "
                        << indices_path(config) << " was written; rebuilding the bucket metadata";
            return false;
        }
        const json meta = json::parse(storage.read(metadata_path(config)));
        for (const auto& [key, paths] : doc.at("aspect_ratio_bucket_indices").items())
            for (const auto& p : paths) {
                const std::string path = p.get<std::string>();
                add(path, plan_from(meta.at(path)));
            }
        // The remaining entries are the images the aspect filter left out; anything else (a
        // hand-edited file) is ignored and rescanned by the next refresh.
        BucketSettings range;
        range.minimum_aspect_ratio = config.minimum_aspect_ratio;
        range.maximum_aspect_ratio = config.maximum_aspect_ratio;
        for (const auto& [path, m] : meta.items()) {
            if (metadata.count(path)) continue;
            SamplePlan plan = plan_from(m);
            if (!bucket_in_aspect_range(range, std::stod(bucket_key(plan.aspect))))
                out_of_range.emplace(path, plan);
        }
    } catch (const json::exception& e) {
        log::warn() << "dataset '" << config.id << "': bucket files are unreadable (" << e.what()
                    << "); rebuilding them";
        buckets.clear();
        metadata.clear();
        out_of_range.clear();
        return false;
    }
    return true;
}

std::map<std::string, int64_t> BucketIndex::sizes() const {
    std::map<std::string, int64_t> out;
    for (const auto& [key, paths] : buckets) out[key] = static_cast<int64_t>(paths.size());
    return out;
}

int64_t BucketIndex::sample_count() const {
    return static_cast<int64_t>(metadata.size());
}

}  // namespace dtune::data
