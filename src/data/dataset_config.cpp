// multidatabackend.json parsing: typed reads with errors naming entry id and key, SimpleTuner's
// defaults and fallbacks, pixel_area conversion, and the cross-entry checks.
#include "data/dataset_config.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "core/config_json.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/resolution_range.h"

namespace dtune::data {

using nlohmann::json;

namespace {

// Keys SimpleTuner knows that dtune reads but does not act on yet; kept as passthrough with a
// warning so a config written for SimpleTuner loads.
const std::set<std::string> kPassthroughKeys = {"aws_bucket_name",
                                                "aws_region_name",
                                                "aws_endpoint_url",
                                                "aws_access_key_id",
                                                "aws_secret_access_key",
                                                "aws_session_token",
                                                "aws_data_prefix",
                                                "aws_max_pool_connections",
                                                "aws_prefetch_depth",  // dtune: objects read ahead
                                                "caption_shuffle",
                                                "conditioning_data",
                                                "conditioning_type",
                                                "source_dataset_id",
                                                "conditioning",
                                                "vae_cache_clear_each_epoch",
                                                "delete_unwanted_images",
                                                "delete_problematic_images",
                                                "delete_nsfw_images",
                                                "scan_for_errors",
                                                "vae_cache_scan_behaviour",
                                                "hash_filenames",
                                                "timestep_sampling_offset",
                                                "slider_strength",
                                                "memory_filesystem_path",
                                                "memory_filesystem_size",
                                                "memory_filesystem_sudo"};

// Passthrough keys that change what is trained (captions, conditioning inputs, the latents of each
// epoch, slider grouping). Ignoring them would train something other than what the config asks, so
// when switched on they are refused; at their "off" value they are accepted silently.
const std::set<std::string> kChangesTraining = {
    "caption_shuffle", "conditioning_data",          "conditioning_type", "source_dataset_id",
    "conditioning",    "vae_cache_clear_each_epoch", "slider_strength"};

// false, 0, "", "false", null, [], {}, or an object whose "enable" is off.
bool is_off(const json& v) {
    if (v.is_null()) return true;
    if (v.is_boolean()) return !v.get<bool>();
    if (v.is_number()) return v.get<double>() == 0;
    if (v.is_string()) {
        std::string t = v.get<std::string>();
        for (char& ch : t) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
        return t.empty() || t == "false" || t == "none" || t == "0";
    }
    if (v.is_object() && v.contains("enable")) return is_off(v.at("enable"));
    return v.empty();
}

// "true"/"false" in any case (Python writes True/False), else nothing.
std::optional<bool> bool_text(const json& v) {
    if (!v.is_string()) return std::nullopt;
    std::string t = v.get<std::string>();
    for (char& ch : t) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (t == "true" || t == "false") return t == "true";
    return std::nullopt;
}

// Reads one entry's keys with type checks; remembers which keys were read so the rest can be
// reported as unknown.
class EntryReader {
  public:
    EntryReader(const json& entry, std::string id, std::string source)
        : entry_(entry), id_(std::move(id)), source_(std::move(source)) {}

    [[noreturn]] void fail(const std::string& key, const std::string& what) const {
        throw UsageError(str(source_, ": dataset '", id_, "', key '", key, "': ", what));
    }
    bool has(const std::string& key) {
        seen_.insert(key);
        auto it = entry_.find(key);
        return it != entry_.end() && !it->is_null();
    }
    const json& at(const std::string& key) { return entry_.at(key); }

    std::string get_string(const std::string& key, std::string fallback) {
        if (!has(key)) return fallback;
        const json& v = at(key);
        if (!v.is_string()) fail(key, str("expected a string, got ", v.dump()));
        return v.get<std::string>();
    }
    bool get_bool(const std::string& key, bool fallback) {
        if (!has(key)) return fallback;
        const json& v = at(key);
        if (v.is_boolean()) return v.get<bool>();
        // SimpleTuner's configs are often hand-written with "true"/"false" (or Python's "True") strings.
        if (const auto b = bool_text(v)) return *b;
        fail(key, str("expected true or false, got ", v.dump()));
    }
    std::optional<double> get_number(const std::string& key) {
        if (!has(key)) return std::nullopt;
        const json& v = at(key);
        if (!v.is_number()) fail(key, str("expected a number, got ", v.dump()));
        return v.get<double>();
    }
    double get_number(const std::string& key, double fallback) { return get_number(key).value_or(fallback); }
    std::optional<int> get_int(const std::string& key) {
        auto v = get_number(key);
        if (!v) return std::nullopt;
        if (*v != std::floor(*v) || std::abs(*v) > 2e9)
            fail(key, str("expected an integer, got ", at(key).dump()));
        return static_cast<int>(*v);
    }
    int get_int(const std::string& key, int fallback) { return get_int(key).value_or(fallback); }
    int get_positive_int(const std::string& key, int fallback) {
        int v = get_int(key, fallback);
        if (v < 1) fail(key, str("must be at least 1, got ", v));
        return v;
    }
    template <typename E>
    E get_enum(const std::string& key, E fallback, const std::vector<std::pair<std::string, E>>& choices) {
        if (!has(key)) return fallback;
        const json& v = at(key);
        if (v.is_string()) {
            for (const auto& [name, value] : choices)
                if (v.get<std::string>() == name) return value;
        }
        std::string names;
        for (const auto& c : choices) names += (names.empty() ? "" : ", ") + c.first;
        fail(key, str("unsupported value ", v.dump(), "; choose one of: ", names));
    }
    std::vector<std::string> unknown_keys() const {
        std::vector<std::string> out;
        for (auto it = entry_.begin(); it != entry_.end(); ++it)
            if (!seen_.count(it.key())) out.push_back(it.key());
        return out;
    }
    const std::string& id() const { return id_; }

  private:
    const json& entry_;
    std::string id_;
    std::string source_;
    std::set<std::string> seen_;
};

const std::vector<std::pair<std::string, ResolutionType>> kResolutionTypes = {
    {"pixel", ResolutionType::kPixel},
    {"area", ResolutionType::kArea},
    {"pixel_area", ResolutionType::kPixelArea}};
const std::vector<std::pair<std::string, CaptionStrategy>> kCaptionStrategies = {
    {"filename", CaptionStrategy::kFilename},
    {"textfile", CaptionStrategy::kTextfile},
    {"instanceprompt", CaptionStrategy::kInstancePrompt},
    {"parquet", CaptionStrategy::kParquet},
    {"csv", CaptionStrategy::kCsv}};

// Replaces {output_dir}, {model_family} and {id} in every string, recursively.
json substitute_variables(const json& value, const std::map<std::string, std::string>& vars) {
    if (value.is_string()) {
        std::string s = value.get<std::string>();
        for (const auto& [name, replacement] : vars) {
            const std::string token = "{" + name + "}";
            for (size_t pos = s.find(token); pos != std::string::npos;
                 pos = s.find(token, pos + replacement.size()))
                s.replace(pos, token.size(), replacement);
        }
        return s;
    }
    if (value.is_array()) {
        json out = json::array();
        for (const auto& v : value) out.push_back(substitute_variables(v, vars));
        return out;
    }
    if (value.is_object()) {
        json out = json::object();
        for (auto it = value.begin(); it != value.end(); ++it)
            out[it.key()] = substitute_variables(it.value(), vars);
        return out;
    }
    return value;
}

void parse_skip_discovery(const std::string& text, DatasetConfig& c, EntryReader& r) {
    std::string token;
    auto flush = [&] {
        if (token.empty()) return;
        if (token == "vae")
            c.skip_vae_discovery = true;
        else if (token == "aspect")
            c.skip_aspect_discovery = true;
        else if (token == "text")
            c.skip_text_discovery = true;
        else if (token == "metadata")
            c.skip_metadata_discovery = true;
        else
            r.fail("skip_file_discovery",
                   str("unknown part '", token, "'; use any of: vae, aspect, text, metadata"));
        token.clear();
    };
    for (char ch : text) {
        if (ch == ' ' || ch == ',')
            flush();
        else
            token += ch;
    }
    flush();
}

void parse_crop_aspect_buckets(EntryReader& r, DatasetConfig& c) {
    if (!r.has("crop_aspect_buckets")) return;
    const json& list = r.at("crop_aspect_buckets");
    if (!list.is_array())
        r.fail("crop_aspect_buckets", "expected a list of numbers or of {\"aspect\", \"weight\"}");
    for (const auto& item : list) {
        CropAspectBucket b;
        if (item.is_number()) {
            b.aspect = item.get<double>();
        } else if (item.is_object() && item.contains("aspect") && item["aspect"].is_number()) {
            b.aspect = item["aspect"].get<double>();
            if (item.contains("weight")) {
                if (!item["weight"].is_number()) r.fail("crop_aspect_buckets", "a weight is not a number");
                b.weight = item["weight"].get<double>();
            }
        } else {
            r.fail("crop_aspect_buckets",
                   str("entry ", item.dump(), " is neither a number nor {\"aspect\": 1.0, \"weight\": 0.5}"));
        }
        if (!(b.aspect > 0)) r.fail("crop_aspect_buckets", str("aspect ", b.aspect, " must be > 0"));
        c.crop_aspect_buckets.push_back(b);
    }
    const bool weighted = !c.crop_aspect_buckets.empty() && c.crop_aspect_buckets.front().weight.has_value();
    double total = 0;
    for (const auto& b : c.crop_aspect_buckets) {
        if (b.weight.has_value() != weighted)
            r.fail("crop_aspect_buckets",
                   "mixes weighted and unweighted entries; give every entry a weight or none");
        total += b.weight.value_or(0);
    }
    if (weighted && std::abs(total - 1.0) > 1e-6)
        r.fail("crop_aspect_buckets",
               str("The weights of aspect buckets must add up to 1 (they sum to ", total, ")"));
}

ParquetSettings parse_parquet(EntryReader& r, const GlobalDataArgs& args) {
    const json& block = r.at("parquet");
    if (!block.is_object()) r.fail("parquet", "expected an object with at least \"path\"");
    ParquetSettings p;
    p.filename_column = args.parquet_filename_column;
    p.caption_column = args.parquet_caption_column;
    EntryReader sub(block, r.id(), "parquet block");
    p.path = sub.get_string("path", "");
    p.filename_column = sub.get_string("filename_column", p.filename_column);
    p.caption_column = sub.get_string("caption_column", p.caption_column);
    p.fallback_caption_column = sub.get_string("fallback_caption_column", "");
    p.width_column = sub.get_string("width_column", "");
    p.height_column = sub.get_string("height_column", "");
    p.identifier_includes_extension = sub.get_bool("identifier_includes_extension", false);
    for (const char* k : {"aspect_ratio_column", "num_frames_column", "fps_column", "bbox_column"})
        sub.has(k);
    if (p.path.empty()) r.fail("parquet", "\"path\" is required (a .parquet or .jsonl file)");
    auto unknown = sub.unknown_keys();
    if (!unknown.empty()) r.fail("parquet", str("unknown key '", unknown.front(), "' in the parquet block"));
    return p;
}

// Size limits in pixel_area mode are edges; SimpleTuner's _handle_resolution_conversion converts
// every positive value to megapixels, a small minimum too (0.5 becomes 2.5e-7 MP, a filter that
// keeps everything; parse_entry warns about it).
std::optional<double> convert_limit(std::optional<double> v) {
    if (!v || !(*v > 0)) return v;
    return pixel_edge_to_megapixels(*v);
}

// resolution, resolution_type and the size limits, with the pixel_area conversion.
void parse_resolution_keys(EntryReader& r, DatasetConfig& c, const GlobalDataArgs& args) {
    c.resolution_as_written = r.get_number("resolution", args.resolution);
    c.resolution_type_as_written = r.get_enum("resolution_type", args.resolution_type, kResolutionTypes);
    if (const std::string problem =
            resolution_range_problem(c.resolution_as_written, to_string(c.resolution_type_as_written));
        !problem.empty())
        r.fail("resolution",
               str(r.has("resolution") ? r.at("resolution").dump() : str(c.resolution_as_written), " ",
                   problem));
    c.minimum_image_size =
        r.has("minimum_image_size") ? r.get_number("minimum_image_size") : args.minimum_image_size;
    c.maximum_image_size =
        r.has("maximum_image_size") ? r.get_number("maximum_image_size") : args.maximum_image_size;
    c.target_downsample_size = r.has("target_downsample_size") ? r.get_number("target_downsample_size")
                                                               : args.target_downsample_size;
    c.resolution = c.resolution_as_written;
    c.resolution_type = c.resolution_type_as_written;
    if (c.resolution_type == ResolutionType::kPixelArea) {
        c.resolution = pixel_edge_to_megapixels(c.resolution_as_written);
        c.resolution_type = ResolutionType::kArea;
        c.minimum_image_size = convert_limit(c.minimum_image_size);
        c.maximum_image_size = convert_limit(c.maximum_image_size);
        c.target_downsample_size = convert_limit(c.target_downsample_size);
    }
}

// SimpleTuner's CSV builder: csv_file, csv_cache_dir and csv_caption_column are required,
// csv_url_column defaults to "url", and the captions come from the file (caption_strategy csv,
// also when the entry leaves caption_strategy out). The cache folder is the dataset's image folder.
void parse_csv_keys(EntryReader& r, DatasetConfig& c) {
    const char* keys[] = {"csv_file", "csv_cache_dir", "csv_caption_column", "csv_url_column"};
    if (c.type != StorageType::kCsv) {
        for (const char* key : keys)
            if (r.has(key)) r.fail(key, "only \"type\": \"csv\" datasets read it; remove it or set the type");
        if (c.caption_strategy == CaptionStrategy::kCsv)
            r.fail("caption_strategy", "'csv' needs \"type\": \"csv\" (captions come from its csv_file)");
        return;
    }
    const bool strategy_written = r.has("caption_strategy");
    if (!strategy_written) c.caption_strategy = CaptionStrategy::kCsv;
    if (c.caption_strategy != CaptionStrategy::kCsv)
        r.fail("caption_strategy",
               str("must be 'csv' for a csv dataset (got '", to_string(c.caption_strategy),
                   "'); the captions come from csv_caption_column"));
    CsvSettings csv;
    csv.file = r.get_string("csv_file", "");
    csv.cache_dir = r.get_string("csv_cache_dir", "");
    csv.caption_column = r.get_string("csv_caption_column", "");
    csv.url_column = r.get_string("csv_url_column", "url");
    if (csv.url_column.empty()) csv.url_column = "url";
    for (const auto& [key, value] :
         {std::pair{"csv_file", &csv.file}, std::pair{"csv_cache_dir", &csv.cache_dir},
          std::pair{"csv_caption_column", &csv.caption_column}})
        if (value->empty())
            r.fail(key,
                   std::string("required for a csv dataset: ") +
                       (key == std::string("csv_file")        ? "the CSV listing the image URLs or paths"
                        : key == std::string("csv_cache_dir") ? "the folder the images are downloaded into"
                                                              : "the CSV column holding the captions"));
    if (r.has("instance_data_dir") && c.instance_data_dir != csv.cache_dir)
        r.fail("instance_data_dir",
               "a csv dataset's images live in csv_cache_dir; remove instance_data_dir or set it equal");
    c.instance_data_dir = csv.cache_dir;
    c.csv = std::move(csv);
}

void parse_image_keys(EntryReader& r, DatasetConfig& c, const GlobalDataArgs& args) {
    c.instance_data_dir = r.get_string("instance_data_dir", "");
    parse_resolution_keys(r, c, args);
    c.minimum_aspect_ratio = r.get_number("minimum_aspect_ratio");
    c.maximum_aspect_ratio = r.get_number("maximum_aspect_ratio");
    c.max_upscale_threshold = r.get_number("max_upscale_threshold");
    c.crop = r.get_bool("crop", false);
    if (r.has("crop_style") && r.at("crop_style") == "face")
        r.fail("crop_style",
               "'face' needs a face detector that dtune does not have; use random, center or corner");
    c.crop_style = r.get_enum("crop_style", CropStyle::kRandom,
                              {{"random", CropStyle::kRandom},
                               {"center", CropStyle::kCenter},
                               {"centre", CropStyle::kCenter},
                               {"corner", CropStyle::kCorner}});
    c.crop_aspect = r.get_enum("crop_aspect", CropAspect::kSquare,
                               {{"square", CropAspect::kSquare},
                                {"preserve", CropAspect::kPreserve},
                                {"closest", CropAspect::kClosest},
                                {"random", CropAspect::kRandom}});
    parse_crop_aspect_buckets(r, c);
    c.caption_strategy = r.get_enum("caption_strategy", args.caption_strategy, kCaptionStrategies);
    c.instance_prompt = r.get_string("instance_prompt", args.instance_prompt);
    c.prepend_instance_prompt = r.get_bool("prepend_instance_prompt", args.prepend_instance_prompt);
    c.only_instance_prompt = r.get_bool("only_instance_prompt", args.only_instance_prompt);
    c.disable_multiline_split = r.get_bool("disable_multiline_split", false);
    c.caption_dropout_probability =
        r.get_number("caption_dropout_probability", args.caption_dropout_probability);
    c.metadata_backend = r.get_enum("metadata_backend", MetadataBackendKind::kDiscovery,
                                    {{"discovery", MetadataBackendKind::kDiscovery},
                                     {"json", MetadataBackendKind::kDiscovery},
                                     {"filesystem", MetadataBackendKind::kDiscovery},
                                     {"parquet", MetadataBackendKind::kParquet}});
    if (r.has("parquet")) c.parquet = parse_parquet(r, args);
    parse_csv_keys(r, c);
    c.cache_dir_vae = r.get_string("cache_dir_vae", args.cache_dir_vae);
    if (c.cache_dir_vae.empty())
        c.cache_dir_vae =
            (std::filesystem::path(args.output_dir) / "cache" / "vae" / args.model_family / c.id).string();
    c.image_embeds = r.get_string("image_embeds", "");
    c.text_embeds = r.get_string("text_embeds", "");
    c.repeats_set = r.has("repeats");
    c.repeats = r.get_int("repeats", 0);
    c.probability = r.get_number("probability", 1.0);
    c.train_batch_size = r.get_positive_int("train_batch_size", args.train_batch_size);
    c.start_epoch = r.get_int("start_epoch", 1);
    c.start_step = r.get_int("start_step", 0);
    c.end_epoch = r.get_int("end_epoch");
    c.end_step = r.get_int("end_step");
    c.max_num_samples = r.get_int("max_num_samples");
    c.vae_cache_ondemand = r.get_bool("vae_cache_ondemand", args.vae_cache_ondemand);
    c.vae_cache_disable = r.get_bool("vae_cache_disable", args.vae_cache_disable);
    if (c.vae_cache_disable) c.vae_cache_ondemand = true;  // disable implies on-demand encoding
    c.random_flip = r.get_bool("random_flip", args.random_flip);
    c.read_batch_size = r.get_positive_int("read_batch_size", args.read_batch_size);
    c.vae_batch_size = r.get_positive_int("vae_batch_size", args.vae_batch_size);
    c.image_processing_batch_size =
        r.get_positive_int("image_processing_batch_size", args.image_processing_batch_size);
    c.max_workers = r.get_positive_int("max_workers", args.max_workers);
    c.metadata_update_interval =
        std::max(60, r.get_int("metadata_update_interval", args.metadata_update_interval));
    // Either spelling switches it on, as in SimpleTuner (each key falls back to the other).
    const bool british = r.get_bool("is_regularisation_data", false);
    c.is_regularisation_data = r.get_bool("is_regularization_data", false) || british;
    c.disable_validation = r.get_bool("disable_validation", false);
    c.cache_file_suffix = r.get_string("cache_file_suffix", c.id);
}

void parse_embed_keys(EntryReader& r, DatasetConfig& c, const GlobalDataArgs& args) {
    c.is_default = r.get_bool("default", false);
    const std::string fallback =
        c.dataset_type == DatasetType::kTextEmbeds ? args.cache_dir_text : args.cache_dir_vae;
    c.cache_dir = r.get_string("cache_dir", fallback);
    c.text_encoder_batch_size = r.get_positive_int("text_encoder_batch_size", 1);
    c.text_cache_ondemand = r.get_bool("text_cache_ondemand", false);
    c.text_cache_disable = r.get_bool("text_cache_disable", false);
    c.caption_filter_list = r.get_string("caption_filter_list", "");
    if (!c.caption_filter_list.empty())
        r.fail("caption_filter_list",
               "caption filters are not implemented by dtune yet, and the captions would be trained "
               "unfiltered; remove the key and apply the filters to the captions themselves");
}

}  // namespace

double pixel_edge_to_megapixels(double edge) {
    return edge * edge / 1e6;
}

const char* to_string(DatasetType v) {
    switch (v) {
        case DatasetType::kImage: return "image";
        case DatasetType::kConditioning: return "conditioning";
        case DatasetType::kEval: return "eval";
        case DatasetType::kTextEmbeds: return "text_embeds";
        case DatasetType::kImageEmbeds: return "image_embeds";
    }
    return "?";
}
const char* to_string(ResolutionType v) {
    switch (v) {
        case ResolutionType::kPixel: return "pixel";
        case ResolutionType::kArea: return "area";
        case ResolutionType::kPixelArea: return "pixel_area";
    }
    return "?";
}
const char* to_string(CropStyle v) {
    switch (v) {
        case CropStyle::kRandom: return "random";
        case CropStyle::kCenter: return "center";
        case CropStyle::kCorner: return "corner";
    }
    return "?";
}
const char* to_string(CropAspect v) {
    switch (v) {
        case CropAspect::kSquare: return "square";
        case CropAspect::kPreserve: return "preserve";
        case CropAspect::kClosest: return "closest";
        case CropAspect::kRandom: return "random";
    }
    return "?";
}
const char* to_string(CaptionStrategy v) {
    switch (v) {
        case CaptionStrategy::kFilename: return "filename";
        case CaptionStrategy::kTextfile: return "textfile";
        case CaptionStrategy::kInstancePrompt: return "instanceprompt";
        case CaptionStrategy::kParquet: return "parquet";
        case CaptionStrategy::kCsv: return "csv";
    }
    return "?";
}

namespace {
template <typename E>
E parse_named(const std::vector<std::pair<std::string, E>>& table, const std::string& name,
              const std::string& key) {
    std::string choices;
    for (const auto& [text, value] : table) {
        if (text == name) return value;
        choices += (choices.empty() ? "" : ", ") + text;
    }
    throw UsageError(str(key, " = '", name, "' is not one of ", choices));
}
}  // namespace

ResolutionType parse_resolution_type(const std::string& name, const std::string& key) {
    return parse_named(kResolutionTypes, name, key);
}
CaptionStrategy parse_caption_strategy(const std::string& name, const std::string& key) {
    return parse_named(kCaptionStrategies, name, key);
}

const DatasetConfig* DataBackendConfig::find(const std::string& id) const {
    for (const auto& d : datasets)
        if (d.id == id) return &d;
    return nullptr;
}

namespace {

// Checks within one entry that are contradictions rather than type errors.
void validate_entry(EntryReader& r, const DatasetConfig& c);
// Checks across entries: unique ids, references, the default text cache, distinct cache dirs.
void validate_references(DataBackendConfig& config, const std::string& source);

DatasetConfig parse_entry(const json& raw, size_t index, const GlobalDataArgs& args,
                          const std::string& source, std::vector<std::string>& warnings) {
    if (!raw.is_object()) throw UsageError(str(source, ": entry ", index, " is not a JSON object"));
    const std::string raw_id =
        raw.contains("id") && raw["id"].is_string() ? raw["id"].get<std::string>() : "";
    if (raw_id.empty())
        throw UsageError(
            str(source, ": entry ", index, " has no \"id\"; give every dataset a unique, stable id"));
    const json entry = substitute_variables(
        raw, {{"output_dir", args.output_dir}, {"model_family", args.model_family}, {"id", raw_id}});
    EntryReader r(entry, raw_id, source);
    DatasetConfig c;
    c.id = r.get_string("id", "");
    r.has("disabled");
    r.has("disable");
    c.type =
        r.get_enum("type", StorageType::kLocal,
                   {{"local", StorageType::kLocal}, {"aws", StorageType::kAws}, {"csv", StorageType::kCsv}});
    c.dataset_type = r.get_enum("dataset_type", DatasetType::kImage,
                                {{"image", DatasetType::kImage},
                                 {"conditioning", DatasetType::kConditioning},
                                 {"eval", DatasetType::kEval},
                                 {"text_embeds", DatasetType::kTextEmbeds},
                                 {"image_embeds", DatasetType::kImageEmbeds}});
    c.preserve_data_backend_cache = r.get_bool("preserve_data_backend_cache", false);
    parse_skip_discovery(r.get_string("skip_file_discovery", args.skip_file_discovery), c, r);
    c.compress_cache = r.get_bool("compress_cache", args.compress_disk_cache);
    c.write_batch_size = r.get_positive_int("write_batch_size", args.write_batch_size);
    if (r.has("disable_vae_cache"))
        r.fail("disable_vae_cache", "this key was removed from SimpleTuner; use \"vae_cache_disable\": true");
    if (r.has("ignore_epochs"))
        warnings.push_back(str("dataset '", c.id, "': 'ignore_epochs' is deprecated and does nothing"));
    if (c.is_image_like()) {
        parse_image_keys(r, c, args);
        if (c.resolution_type_as_written == ResolutionType::kPixelArea && c.minimum_image_size &&
            *c.minimum_image_size > 0 && *c.minimum_image_size <= pixel_edge_to_megapixels(10))
            warnings.push_back(str(
                "dataset '", c.id, "': minimum_image_size with resolution_type pixel_area is ",
                "an edge in pixels (SimpleTuner reads it so too); ", std::sqrt(*c.minimum_image_size * 1e6),
                " px lets every image through. Write the shortest edge to keep, e.g. 512"));
        // SimpleTuner accepts it alone too (it only refuses maximum_image_size alone); the
        // downsample needs both.
        if (c.target_downsample_size && !c.maximum_image_size)
            warnings.push_back(str("dataset '", c.id,
                                   "': target_downsample_size does nothing without maximum_image_size; set "
                                   "both to resize large images before the crop, or remove it"));
    } else {
        parse_embed_keys(r, c, args);
        // Only where and when the embeddings are stored differs, not what is trained: a warning.
        for (const auto& [key, on] : {std::pair{"text_cache_ondemand", c.text_cache_ondemand},
                                      std::pair{"text_cache_disable", c.text_cache_disable}})
            if (on)
                warnings.push_back(str("dataset '", c.id, "': '", key,
                                       "' is not implemented by dtune yet; every text embedding is built at "
                                       "start and kept in cache_dir"));
    }
    for (const auto& key : kPassthroughKeys) {
        if (kChangesTraining.count(key) && entry.contains(key) && !is_off(entry.at(key)))
            r.fail(key,
                   str("= ", entry.at(key).dump(),
                       " changes what is trained, and dtune does not implement it yet; it is refused "
                       "rather than ignored. Remove the key (or set it to false/null) to train without it"));
        if (r.has(key)) {
            c.passthrough.emplace_back(key, entry.at(key).dump());
            if (key.rfind("aws_", 0) != 0 && !kChangesTraining.count(key))  // those are off here
                warnings.push_back(
                    str("dataset '", c.id, "': key '", key, "' is not supported by dtune yet; ignored"));
        }
    }
    // SimpleTuner: an aws entry without instance_data_dir is rooted at aws_data_prefix (its bucket
    // metadata files are written there too).
    if (c.type == StorageType::kAws && c.instance_data_dir.empty() && entry.contains("aws_data_prefix") &&
        entry.at("aws_data_prefix").is_string())
        c.instance_data_dir = entry.at("aws_data_prefix").get<std::string>();
    validate_entry(r, c);
    auto unknown = r.unknown_keys();
    if (!unknown.empty()) {
        std::string names;
        for (const auto& k : unknown) names += (names.empty() ? "'" : ", '") + k + "'";
        warnings.push_back(
            str("dataset '", c.id, "': unknown key(s) ", names, " ignored; check the spelling"));
    }
    return c;
}

// "disabled" / "disable", read like every other boolean (true, false, "true", "false"), so a
// hand-written "true" string switches the entry off instead of being trained on.
bool entry_disabled(const json& raw, size_t index, const std::string& source) {
    bool disabled = false;
    for (const char* key : {"disabled", "disable"}) {
        auto it = raw.find(key);
        if (it == raw.end() || it->is_null()) continue;
        if (it->is_boolean())
            disabled |= it->get<bool>();
        else if (const auto b = bool_text(*it))
            disabled |= *b;
        else
            throw UsageError(
                str(source, ": entry ", index,
                    raw.contains("id") ? str(" (dataset ", raw["id"].dump(), ")") : std::string(), ", key '",
                    key, "': expected true or false, got ", it->dump()));
    }
    return disabled;
}

}  // namespace

DataBackendConfig parse_data_backend_config(const json& root, const GlobalDataArgs& args,
                                            const std::string& source) {
    if (!root.is_array())
        throw UsageError(str(source, ": expected a JSON list of dataset entries, got ", root.type_name()));
    DataBackendConfig config;
    for (size_t i = 0; i < root.size(); ++i) {
        const json& raw = root[i];
        if (raw.is_object() && entry_disabled(raw, i, source)) continue;
        config.datasets.push_back(parse_entry(raw, i, args, source, config.warnings));
    }
    validate_references(config, source);
    return config;
}

DataBackendConfig load_data_backend_config(const std::filesystem::path& path, const GlobalDataArgs& args) {
    const json root = parse_config_json(fs::read_file(path), path.string());
    return parse_data_backend_config(root, args, path.string());
}

namespace {

void validate_entry(EntryReader& r, const DatasetConfig& c) {
    if (c.type == StorageType::kAws && !r.has("aws_bucket_name"))
        r.fail("aws_bucket_name", "required when \"type\" is \"aws\"");
    if (c.type == StorageType::kCsv && !c.is_image_like())
        r.fail("type", str("'csv' lists images to train on; a ", to_string(c.dataset_type),
                           " entry stores a cache and takes \"local\" or \"aws\""));
    if (!c.is_image_like()) return;
    const bool area = c.resolution_type == ResolutionType::kArea;
    if (c.instance_data_dir.empty() && c.type == StorageType::kLocal)
        r.fail("instance_data_dir",
               "required for a local image dataset; set it to the folder holding the images");
    if (c.maximum_image_size && !c.target_downsample_size)
        r.fail("maximum_image_size", "is set without target_downsample_size; set both or neither");
    for (const auto& [key, value] : {std::pair{"maximum_image_size", c.maximum_image_size},
                                     std::pair{"target_downsample_size", c.target_downsample_size}}) {
        if (!value) continue;
        if (area && *value >= 20)
            r.fail(key, str(*value, " is too large for resolution_type=area (must be < 20 megapixels)"));
        if (!area && *value < 512)
            r.fail(key, str(*value, " is too small for resolution_type=pixel (must be >= 512)"));
    }
    if (c.minimum_image_size && area && *c.minimum_image_size >= 5)
        r.fail("minimum_image_size",
               str(*c.minimum_image_size, " must be < 5 (megapixels) when resolution_type is area"));
    if (c.minimum_aspect_ratio && c.maximum_aspect_ratio && *c.minimum_aspect_ratio > *c.maximum_aspect_ratio)
        r.fail("minimum_aspect_ratio", "is larger than maximum_aspect_ratio; no bucket could pass");
    const bool aspect_list =
        c.crop && (c.crop_aspect == CropAspect::kClosest || c.crop_aspect == CropAspect::kRandom);
    if (aspect_list && c.crop_aspect_buckets.empty())
        r.fail("crop_aspect_buckets", str("required when crop_aspect is '", to_string(c.crop_aspect),
                                          "'; give a list such as [0.75, 1.0, 1.33]"));
    if (aspect_list && (c.minimum_aspect_ratio || c.maximum_aspect_ratio)) {
        // Every image lands in a bucket near a listed aspect; when all of them are outside the range,
        // every bucket is dropped and nothing is ever trained.
        const double lo = c.minimum_aspect_ratio.value_or(0);
        const double hi = c.maximum_aspect_ratio.value_or(std::numeric_limits<double>::infinity());
        std::string listed;
        bool any_inside = false;
        for (const auto& b : c.crop_aspect_buckets) {
            any_inside |= b.aspect >= lo && b.aspect <= hi;
            listed += str(listed.empty() ? "" : ", ", b.aspect);
        }
        if (!any_inside)
            r.fail("crop_aspect_buckets",
                   str("every aspect [", listed, "] lies outside minimum_aspect_ratio ",
                       c.minimum_aspect_ratio ? str(*c.minimum_aspect_ratio) : std::string("(unset)"),
                       " .. maximum_aspect_ratio ",
                       c.maximum_aspect_ratio ? str(*c.maximum_aspect_ratio) : std::string("(unset)"),
                       ", so every bucket would be dropped and no image trained; add an aspect within that "
                       "range to crop_aspect_buckets or widen minimum_aspect_ratio/maximum_aspect_ratio"));
    }
    if (c.caption_strategy == CaptionStrategy::kParquet &&
        c.metadata_backend != MetadataBackendKind::kParquet)
        r.fail("caption_strategy", "'parquet' needs \"metadata_backend\": \"parquet\" and a parquet block");
    if (c.caption_strategy == CaptionStrategy::kInstancePrompt && c.instance_prompt.empty())
        r.fail("instance_prompt", "required when caption_strategy is 'instanceprompt'");
    if (c.metadata_backend == MetadataBackendKind::kParquet) {
        if (!c.parquet) r.fail("parquet", "metadata_backend 'parquet' needs a \"parquet\" block with a path");
        if (c.parquet->width_column.empty() || c.parquet->height_column.empty())
            r.fail("parquet", "width_column and height_column are required by the parquet metadata backend");
    }
    if (c.repeats < 0)
        r.fail("repeats", str("must be >= 0 (0 means each sample once per epoch), got ", c.repeats));
    if (!(c.probability >= 0)) r.fail("probability", "must be >= 0");
    if (c.caption_dropout_probability < 0 || c.caption_dropout_probability > 1)
        r.fail("caption_dropout_probability",
               str("must be within [0, 1], got ", c.caption_dropout_probability));
    if (c.max_upscale_threshold && (*c.max_upscale_threshold < 0 || *c.max_upscale_threshold > 1))
        r.fail("max_upscale_threshold", "must be within [0, 1]");
    if (c.max_num_samples && *c.max_num_samples < 1) r.fail("max_num_samples", "must be >= 1");
    if (c.end_epoch && *c.end_epoch < c.start_epoch) r.fail("end_epoch", "is before start_epoch");
    if (c.end_step && *c.end_step < c.start_step) r.fail("end_step", "is before start_step");
}

void validate_references(DataBackendConfig& config, const std::string& source) {
    std::set<std::string> ids;
    const DatasetConfig* default_text = nullptr;
    for (const auto& d : config.datasets) {
        if (!ids.insert(d.id).second)
            throw UsageError(str(source, ": dataset id '", d.id, "' is used twice; ids must be unique"));
        if (d.dataset_type == DatasetType::kTextEmbeds && d.is_default) {
            if (default_text)
                throw UsageError(
                    str(source, ": datasets '", default_text->id, "' and '", d.id,
                        "' both have \"default\": true; only one text_embeds entry may be the default"));
            default_text = &d;
        }
    }
    bool any_text = false, any_image = false;
    for (const auto& d : config.datasets) {
        any_text |= d.dataset_type == DatasetType::kTextEmbeds;
        any_image |= d.is_image_like();
    }
    if (any_text && !default_text)
        throw UsageError(
            str(source, ": no text_embeds dataset has \"default\": true; mark exactly one as default"));
    if (any_image && !any_text)
        throw UsageError(str(source,
                             ": no text_embeds dataset is configured; add an entry with \"dataset_type\": "
                             "\"text_embeds\", \"default\": true and a cache_dir"));
    std::map<std::string, std::string> vae_dirs;
    for (auto& d : config.datasets) {
        if (!d.is_image_like()) continue;
        auto check_ref = [&](const std::string& key, const std::string& ref, DatasetType want) {
            const DatasetConfig* target = config.find(ref);
            if (!target || target->dataset_type != want)
                throw UsageError(str(source, ": dataset '", d.id, "', key '", key, "': no ", to_string(want),
                                     " dataset has id '", ref, "'"));
        };
        if (!d.image_embeds.empty()) check_ref("image_embeds", d.image_embeds, DatasetType::kImageEmbeds);
        if (!d.text_embeds.empty())
            check_ref("text_embeds", d.text_embeds, DatasetType::kTextEmbeds);
        else if (default_text)
            d.text_embeds = default_text->id;
        auto [it, fresh] = vae_dirs.emplace(d.cache_dir_vae, d.id);
        if (!fresh)
            throw UsageError(str(source, ": dataset '", d.id, "', key 'cache_dir_vae': '", d.cache_dir_vae,
                                 "' is also used by dataset '", it->second, "'; each dataset needs its own"));
        const DatasetConfig* text = config.find(d.text_embeds);
        if (text && std::filesystem::path(text->cache_dir).lexically_normal() ==
                        std::filesystem::path(d.cache_dir_vae).lexically_normal())
            throw UsageError(str(source, ": dataset '", d.id,
                                 "', key 'cache_dir_vae': equals the text cache_dir of '", text->id,
                                 "'; the VAE and text caches must live in different folders"));
    }
}

}  // namespace
}  // namespace dtune::data
