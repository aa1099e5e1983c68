// The dataset list of SimpleTuner's `multidatabackend.json`, parsed into typed entries.
//
// Invariants after parse_data_backend_config():
// - disabled entries are gone, ids are unique and non-empty;
// - every string value has had `{output_dir}`, `{model_family}` and `{id}` substituted;
// - `resolution_type` is never kPixelArea any more: like SimpleTuner's
//   `_handle_resolution_conversion`, pixel_area becomes area in megapixels (edge²/1e6), and the
//   size limits are converted the same way; the value the user wrote is kept in
//   `resolution_as_written`;
// - references (`text_embeds`, `image_embeds`) name existing entries of the right dataset_type, and
//   exactly one text_embeds entry is the default when any exists;
// - per-entry values fall back to GlobalDataArgs (SimpleTuner's `--arg` fallbacks) with
//   SimpleTuner's defaults.
// Unknown keys produce warnings (returned; the caller logs them once), never silence; wrong types and
// contradictory settings throw UsageError naming the entry id and the key.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace dtune::data {

enum class StorageType { kLocal, kAws, kCsv };
enum class DatasetType { kImage, kConditioning, kEval, kTextEmbeds, kImageEmbeds };
enum class ResolutionType { kPixel, kArea, kPixelArea };
enum class CropStyle { kRandom, kCenter, kCorner };
enum class CropAspect { kSquare, kPreserve, kClosest, kRandom };
enum class CaptionStrategy { kFilename, kTextfile, kInstancePrompt, kParquet, kCsv };
enum class MetadataBackendKind { kDiscovery, kParquet };

const char* to_string(DatasetType value);
const char* to_string(ResolutionType value);
const char* to_string(CropStyle value);
const char* to_string(CropAspect value);
const char* to_string(CaptionStrategy value);
// The enum named by SimpleTuner's spelling (as to_string writes it); a UsageError naming `key` and
// the choices otherwise.
ResolutionType parse_resolution_type(const std::string& name, const std::string& key);
CaptionStrategy parse_caption_strategy(const std::string& name, const std::string& key);

// One candidate crop aspect; weight is set only when the list was given as {aspect, weight}.
struct CropAspectBucket {
    double aspect = 1.0;
    std::optional<double> weight;
};

// The `parquet` block (also used for JSON-lines tables).
struct ParquetSettings {
    std::string path;
    std::string filename_column = "id";
    std::string caption_column = "description";
    std::string fallback_caption_column;
    std::string width_column;
    std::string height_column;
    bool identifier_includes_extension = false;
};

// The CLI/config.json values that dataset entries fall back to (SimpleTuner's defaults).
struct GlobalDataArgs {
    std::string output_dir = "simpletuner-results";
    std::string model_family = "sdxl";
    double resolution = 1024;
    ResolutionType resolution_type = ResolutionType::kPixelArea;
    std::optional<double> minimum_image_size;
    std::optional<double> maximum_image_size;
    std::optional<double> target_downsample_size;
    CaptionStrategy caption_strategy = CaptionStrategy::kFilename;
    std::string instance_prompt;
    bool prepend_instance_prompt = false;
    bool only_instance_prompt = false;
    int train_batch_size = 4;
    std::string cache_dir_text = "cache";
    std::string cache_dir_vae;  // empty: <output_dir>/cache/vae/<model_family>/<id>
    bool vae_cache_ondemand = false;
    bool vae_cache_disable = false;
    bool random_flip = false;  // dtune/diffusers key (SimpleTuner has no flip option)
    bool compress_disk_cache = true;
    int write_batch_size = 128;
    int read_batch_size = 25;
    int vae_batch_size = 4;
    int image_processing_batch_size = 32;
    int max_workers = 32;
    std::string skip_file_discovery;
    double caption_dropout_probability = 0.1;
    std::string parquet_filename_column = "id";
    std::string parquet_caption_column = "description";
    int metadata_update_interval = 3600;
};

// `type: csv` (SimpleTuner's CSV backend): images listed by URL or local path in a CSV file,
// fetched once into csv_cache_dir (data/csv_dataset.h), captions from a column of the same file.
struct CsvSettings {
    std::string file;                // csv_file
    std::string cache_dir;           // csv_cache_dir (also the dataset's instance_data_dir)
    std::string caption_column;      // csv_caption_column
    std::string url_column = "url";  // csv_url_column
};

struct DatasetConfig {
    // Common keys.
    std::string id;
    StorageType type = StorageType::kLocal;
    DatasetType dataset_type = DatasetType::kImage;
    bool preserve_data_backend_cache = false;
    // Parsed from the space/comma separated string.
    bool skip_vae_discovery = false, skip_aspect_discovery = false, skip_text_discovery = false,
         skip_metadata_discovery = false;
    bool compress_cache = true;
    int write_batch_size = 128;

    // Image datasets.
    std::string instance_data_dir;
    double resolution = 1.048576;
    double resolution_as_written = 1024;
    ResolutionType resolution_type = ResolutionType::kArea;
    ResolutionType resolution_type_as_written = ResolutionType::kPixelArea;
    std::optional<double> minimum_image_size;
    std::optional<double> maximum_image_size;
    std::optional<double> target_downsample_size;
    std::optional<double> minimum_aspect_ratio;
    std::optional<double> maximum_aspect_ratio;
    std::optional<double> max_upscale_threshold;
    bool crop = false;
    CropStyle crop_style = CropStyle::kRandom;
    CropAspect crop_aspect = CropAspect::kSquare;
    std::vector<CropAspectBucket> crop_aspect_buckets;
    CaptionStrategy caption_strategy = CaptionStrategy::kFilename;
    std::string instance_prompt;
    bool prepend_instance_prompt = false;
    bool only_instance_prompt = false;
    bool disable_multiline_split = false;
    double caption_dropout_probability = 0.1;
    MetadataBackendKind metadata_backend = MetadataBackendKind::kDiscovery;
    std::optional<ParquetSettings> parquet;
    std::optional<CsvSettings> csv;  // type csv only
    std::string cache_dir_vae;
    std::string image_embeds;  // id of an image_embeds entry; empty: this dataset's storage
    std::string text_embeds;   // id of a text_embeds entry; filled with the default one
    int repeats = 0;
    bool repeats_set = false;  // written in the entry: oversubscription then leaves repeats alone
    double probability = 1.0;
    int train_batch_size = 4;
    int start_epoch = 1;
    int start_step = 0;
    std::optional<int> end_epoch;
    std::optional<int> end_step;
    std::optional<int> max_num_samples;
    bool vae_cache_ondemand = false;
    bool vae_cache_disable = false;
    // Mirror training images left-right with probability 1/2, decided per draw (see
    // data/sample_variants.h); not a SimpleTuner key (diffusers' --random_flip).
    bool random_flip = false;
    int read_batch_size = 25;
    int vae_batch_size = 4;
    int image_processing_batch_size = 32;
    int max_workers = 32;
    int metadata_update_interval = 3600;
    // is_regularisation_data / is_regularization_data: a LoRA run trains this dataset's batches
    // toward the base model's prediction (train/step.h); a full fine-tune as ordinary data.
    bool is_regularisation_data = false;
    bool disable_validation = false;
    std::string cache_file_suffix;  // defaults to id

    // text_embeds / image_embeds entries.
    bool is_default = false;
    std::string cache_dir;
    int text_encoder_batch_size = 1;
    bool text_cache_ondemand = false;
    bool text_cache_disable = false;
    std::string caption_filter_list;

    // Keys we recognise from SimpleTuner but do not act on yet (aws_*, caption_shuffle, ...):
    // kept verbatim so later layers (the S3 backend) can read them.
    std::vector<std::pair<std::string, std::string>> passthrough;  // key -> JSON text

    bool is_image_like() const {
        return dataset_type == DatasetType::kImage || dataset_type == DatasetType::kConditioning ||
               dataset_type == DatasetType::kEval;
    }
};

struct DataBackendConfig {
    std::vector<DatasetConfig> datasets;  // in file order, disabled entries removed
    std::vector<std::string> warnings;    // unknown keys, deprecated keys, ignored values

    const DatasetConfig* find(const std::string& id) const;
};

// Parses the JSON list. `source` names the file in error messages.
DataBackendConfig parse_data_backend_config(const nlohmann::json& root, const GlobalDataArgs& args,
                                            const std::string& source = "multidatabackend.json");
// Reads and parses a file; DataError when unreadable or not JSON, UsageError for bad content.
DataBackendConfig load_data_backend_config(const std::filesystem::path& path, const GlobalDataArgs& args);

// pixel_area → megapixels as SimpleTuner converts it: edge²/1e6 (1024 → 1.048576).
double pixel_edge_to_megapixels(double edge);

}  // namespace dtune::data
