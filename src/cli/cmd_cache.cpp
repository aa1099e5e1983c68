// `dtune cache --config <config.json>`: builds the VAE latent and text-embedding caches of every
// image dataset without training, with a progress bar and a final report.
//
// Reads config.json or config.toml exactly as `dtune train` does (train::TrainConfig: the same
// keys, defaults, errors and command-line overrides, and the same dataset fallbacks through
// train::data_args_from_config); pretrained_model_name_or_path and data_backend_config are
// required. Rank sharding: --world-size/--rank (or WORLD_SIZE/RANK); rank 0 writes the bucket
// index, run it first.
//
// Invariant: the latent entries are exactly those `dtune train` prebuilds with the same config
// (data::prebuild_requests) and hold the same values (the trainer's VAE callable, device and
// dtype), so a training run after `dtune cache` reuses them all and trains identically.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>

#include "cli/command.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/thread_pool.h"
#include "data/cache_builder.h"
#include "data/cache_placement.h"
#include "data/captions.h"
#include "data/dataset_buckets.h"
#include "data/sample_variants.h"
#include "data/storage.h"
#include "dist/env.h"
#include "family/data_encoders.h"
#include "family/model_family.h"
#include "train/config.h"
#include "train/data_parallel.h"
#include "train/dataset_source.h"
#include "train/trainer.h"

namespace dtune::cli {
namespace {

namespace stdfs = std::filesystem;

using train::TrainConfig;

// The trainer's own encoders, device and VAE dtype policy (bf16 on CUDA, fp32 on CPU, as
// Trainer picks them), so the latents written here are the ones `dtune train` would write.
train::DatasetEncoders load_encoders(const TrainConfig& c, const stdfs::path& model_root) {
    family::DataEncoderOptions o;
    o.model_dir = model_root;
    if (auto vae = stdfs::path(c.text("pretrained_vae_model_name_or_path"));
        !vae.empty() && stdfs::exists(vae / "config.json"))
        o.vae_override = vae;
    o.device = train::DataParallel::pick_device(c.text("device"), dist::read_dist_env(), cuda_device_count());
    o.vae_dtype = o.device.is_cuda() ? at::kBFloat16 : at::kFloat;
    o.text_encoder_precision = family::text_encoder_precision_from(c);
    o.max_sequence_length =
        c.opt_integer("tokenizer_max_length").value_or(0);  // Flux's T5 length, as train's
    return family::family_named(c.text("model_family")).load_data_encoders(o);
}

int arg_int(const std::vector<std::string>& args, const std::string& name, const char* env, int fallback) {
    const auto parse = [&](const std::string& text, const std::string& source) {
        size_t used = 0;
        int v = 0;
        try {
            v = std::stoi(text, &used);
        } catch (const std::exception&) {
            used = 0;
        }
        DTUNE_CHECK_AS(UsageError, used > 0 && used == text.size(), source, " expects an integer, got '",
                       text, "'");
        return v;
    };
    for (size_t i = 0; i + 1 < args.size(); ++i)
        if (args[i] == name) return parse(args[i + 1], name);
    if (const char* v = std::getenv(env)) return parse(v, env);
    return fallback;
}

nlohmann::json report_json(const data::CacheBuildReport& r) {
    return {{"total", r.total},
            {"built", r.built},
            {"reused", r.reused},
            {"rebuilt_stale", r.rebuilt_stale},
            {"rebuilt_corrupt", r.rebuilt_corrupt},
            {"skipped", r.skipped},
            {"encoder_calls", r.encoder_calls},
            {"seconds", r.seconds}};
}

struct Requests {
    std::map<std::string, std::vector<data::LatentRequest>> latents;  // bucket -> samples
    std::vector<std::string> captions;                                // every candidate caption
};

// Buckets one dataset (rank 0 writes the index) and lists its samples and captions.
Requests collect_requests(const data::DatasetConfig& d, const data::GlobalDataArgs& gargs, uint64_t seed,
                          int rank, ThreadPool& pool) {
    data::BucketBuildOptions bo;
    bo.output_dir = gargs.output_dir;
    bo.seed = seed;
    bo.allow_dataset_oversubscription = true;  // caching needs no batch-size check
    bo.write_index = rank == 0;
    bo.show_progress = rank == 0;
    // What training draws from (crop_aspect random: the images the aspect filter set aside too).
    const data::RedrawCandidates buckets =
        data::redraw_candidates(data::build_dataset_buckets(d, bo, pool).index, d);
    auto storage = data::make_storage(d);
    // As `dtune train`: rows without a caption skip their image (warned below) instead of failing
    // the whole table.
    const std::optional<data::MetadataTable> table = data::caption_table_for(d, *storage);
    Requests out;
    // The entries training prebuilds (flip variants, crop_aspect random's epoch-0 sizes).
    out.latents = data::prebuild_requests(d, buckets.buckets, buckets.plans, seed,
                                          data::load_aspect_pins(d, gargs.output_dir), {});
    for (const auto& [key, paths] : buckets.buckets)
        for (const auto& p : paths) {
            try {
                for (auto& c : data::resolve_captions(d, *storage, p, table ? &*table : nullptr))
                    out.captions.push_back(std::move(c));
            } catch (const DataError& e) {
                log::warn() << e.what();
            }
        }
    return out;
}

// Builds the text caches the way `dtune train` does (train/dataset_setup.cpp): one build per
// cache folder over the captions of every dataset using it, "" (caption dropout) added to the first
// dataset's folder, batches of the text_embeds entry's text_encoder_batch_size (1 without one).
// Equal batches matter: a batched encoder's results differ in the last bits with the batch.
// Returns each dataset's text report (its folder's).
std::vector<data::CacheBuildReport> cache_text(const std::vector<const data::DatasetConfig*>& images,
                                               const std::vector<Requests>& requests,
                                               const data::DataBackendConfig& datasets,
                                               const data::GlobalDataArgs& gargs,
                                               const train::DatasetEncoders& enc, int world, int rank,
                                               ThreadPool& pool) {
    struct Folder {
        data::TextCacheSettings settings;
        int batch_size = 1;
        std::vector<std::string> captions;
    };
    std::map<std::string, Folder> folders;
    std::vector<std::string> dir_of;
    for (size_t i = 0; i < images.size(); ++i) {
        const data::DatasetConfig& d = *images[i];
        const auto* entry = datasets.find(d.text_embeds);
        const std::string dir = entry && !entry->cache_dir.empty() ? entry->cache_dir : gargs.cache_dir_text;
        Folder& f = folders[dir];
        if (f.settings.cache_dir.empty()) {
            f.settings.cache_dir = dir;
            f.settings.model_family = gargs.model_family;
            f.settings.encoder_identity = enc.text_identity;
            f.settings.tensor_names = enc.text_tensor_names;
            f.settings.storage = data::text_cache_storage(entry);
            f.settings.compression = (entry ? entry->compress_cache : gargs.compress_disk_cache)
                                         ? data::CacheCompression::kZstd
                                         : data::CacheCompression::kNone;
            f.batch_size = entry ? std::max(1, entry->text_encoder_batch_size) : 1;
        }
        f.captions.insert(f.captions.end(), requests[i].captions.begin(), requests[i].captions.end());
        if (i == 0) f.captions.emplace_back("");
        dir_of.push_back(dir);
    }
    std::map<std::string, data::CacheBuildReport> reports;
    for (auto& [dir, f] : folders) {
        data::CacheBuildOptions opt;
        opt.world_size = world;
        opt.rank = rank;
        opt.show_progress = true;
        opt.batch_size = f.batch_size;
        opt.label = "text embeds";
        reports[dir] =
            data::build_text_cache(data::TextEmbedCache(f.settings), f.captions, enc.text, opt, pool);
        log::info() << "text embeddings in " << dir << ": " << reports[dir].summary();
    }
    std::vector<data::CacheBuildReport> out;
    for (const auto& dir : dir_of) out.push_back(reports.at(dir));
    return out;
}

// Builds the latent cache of one image dataset.
data::CacheBuildReport cache_latents(const data::DatasetConfig& d, const Requests& requests,
                                     const data::DataBackendConfig& datasets,
                                     const data::GlobalDataArgs& gargs, const train::DatasetEncoders& enc,
                                     int world, int rank, ThreadPool& pool) {
    data::CacheBuildOptions opt;
    opt.world_size = world;
    opt.rank = rank;
    opt.show_progress = true;
    opt.batch_size = d.vae_batch_size;
    opt.label = "latents " + d.id;
    data::LatentCacheSettings placement = data::latent_cache_placement(d, datasets, gargs, enc.vae_identity);
    placement.latent_channels = enc.latent_channels;
    const data::LatentCache cache(std::move(placement));
    const stdfs::path report_dir = cache.storage().remote()
                                       ? stdfs::path(gargs.output_dir) / "cache" / "skipped" / d.id
                                       : stdfs::path(d.cache_dir_vae);
    opt.report_path = (report_dir / str("skipped_images_rank", rank, ".json")).string();
    const auto latents = data::build_latent_cache(cache, requests.latents, enc.vae, opt, pool);
    log::info() << "latents of '" << d.id << "': " << latents.summary();
    return latents;
}

// A required path option, which `dtune train` checks later on; here it is needed up front.
std::string required(const TrainConfig& c, const char* key) {
    DTUNE_CHECK_AS(UsageError, !c.text(key).empty(), "dtune cache needs option ", key,
                   "; set it in config.json (as for dtune train)");
    return c.text(key);
}

int run_cache(const std::vector<std::string>& args) {
    // --config, --world-size and --rank are this command's own; every other word is an option
    // override read exactly as `dtune train` reads it, so both commands see the same settings.
    stdfs::path config_path;
    std::vector<std::string> overrides;
    for (size_t i = 0; i < args.size(); ++i) {
        if ((args[i] == "--config" || args[i] == "--world-size" || args[i] == "--rank") &&
            i + 1 < args.size()) {
            if (args[i] == "--config") config_path = args[i + 1];
            ++i;
        } else if (args[i].rfind("--config=", 0) == 0) {
            config_path = args[i].substr(9);
        } else {
            overrides.push_back(args[i]);
        }
    }
    DTUNE_CHECK_AS(UsageError, !config_path.empty(), "dtune cache needs --config <config.json>");
    const TrainConfig config = TrainConfig::load(config_path, overrides);
    const int world = arg_int(args, "--world-size", "WORLD_SIZE", 1),
              rank = arg_int(args, "--rank", "RANK", 0);
    DTUNE_CHECK_AS(UsageError, world >= 1 && rank >= 0 && rank < world, "--rank ", rank,
                   " with --world-size ", world,
                   " is invalid: use a world size of 1 or more and a rank from 0 to world size - 1");
    const auto start = std::chrono::steady_clock::now();
    const data::GlobalDataArgs gargs = train::data_args_from_config(config);
    fs::require_writable_dir(gargs.output_dir, "output_dir");
    stdfs::path backend = required(config, "data_backend_config");
    if (!stdfs::exists(backend) && stdfs::exists(config_path.parent_path() / backend))
        backend = config_path.parent_path() / backend;
    const auto datasets = data::load_data_backend_config(backend, gargs);
    for (const auto& w : datasets.warnings) log::warn() << backend.string() << ": " << w;
    const train::DatasetEncoders enc =
        load_encoders(config, required(config, "pretrained_model_name_or_path"));
    const auto seed = static_cast<uint64_t>(config.opt_integer("seed").value_or(0));

    ThreadPool pool(0);
    nlohmann::json summary = nlohmann::json::object();
    std::vector<const data::DatasetConfig*> images;
    std::vector<Requests> requests;
    for (const auto& d : datasets.datasets)
        if (d.is_image_like()) {
            images.push_back(&d);
            requests.push_back(collect_requests(d, gargs, seed, rank, pool));
        }
    const auto text = cache_text(images, requests, datasets, gargs, enc, world, rank, pool);
    for (size_t i = 0; i < images.size(); ++i)
        summary[images[i]->id] = {{"latents", report_json(cache_latents(*images[i], requests[i], datasets,
                                                                        gargs, enc, world, rank, pool))},
                                  {"text", report_json(text[i])}};
    summary["seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    fs::write_file_atomic(stdfs::path(gargs.output_dir) / str("cache_report_rank", rank, ".json"),
                          summary.dump(2) + "\n");
    std::printf("%s\n", summary.dump(2).c_str());
    return 0;
}

}  // namespace

DTUNE_REGISTER_COMMAND(cache, "cache", "build the VAE latent and text-embedding caches without training",
                       "usage: dtune cache --config <config.json> [--world-size N --rank R]\n"
                       "                   [--key value | --key=value | --set key=value ...]\n\n"
                       "Reads config.json (or config.toml) and its option overrides exactly as\n"
                       "`dtune train` does, so both see the same datasets and settings; it needs\n"
                       "pretrained_model_name_or_path and data_backend_config. It\n"
                       "buckets every image dataset, then encodes what is missing or invalid: text\n"
                       "embeddings into the text_embeds entry's cache_dir, latents into cache_dir_vae.\n"
                       "Valid entries are reused; changed or damaged ones are rebuilt; unreadable\n"
                       "images are skipped and listed in <cache_dir_vae>/skipped_images_rank<R>.json.\n"
                       "The report is printed and written to <output_dir>/cache_report_rank<R>.json.\n"
                       "With --world-size/--rank (or WORLD_SIZE/RANK) each rank builds its share;\n"
                       "rank 0 writes the bucket index, so start it first.\n",
                       run_cache);

}  // namespace dtune::cli
