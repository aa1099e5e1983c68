// Captions per SimpleTuner's strategies (filename, textfile, instanceprompt, parquet) and caption
// dropout. Table-backed captions go through MetadataTable, which any row source fills: JSON-lines
// here, the Parquet reader (src/io/parquet) later — it only has to hand over rows as JSON objects.
//
// Invariants: resolve_captions() never returns an empty list; a sample with no usable caption is
// a DataError naming the file, so the caller can skip and report it.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "data/dataset_config.h"

namespace dtune::data {

class StorageBackend;

struct MetadataRow {
    std::string identifier;             // the filename column value
    std::vector<std::string> captions;  // a list column gives several
    std::optional<int> width;
    std::optional<int> height;
};

// Rows keyed by identifier, read with the dataset's `parquet` column settings.
class MetadataTable {
  public:
    // `rows` are JSON objects (one per table row); `source` names the file in errors. Empty or
    // missing filename values, and rows without any caption when `require_caption`, are
    // UsageErrors naming the row (SimpleTuner validates both columns at load time).
    static MetadataTable from_rows(const std::vector<nlohmann::json>& rows, const ParquetSettings& settings,
                                   const std::string& source, bool require_caption);
    // JSON-lines bytes → rows; DataError naming the line on bad JSON.
    static std::vector<nlohmann::json> parse_jsonl(const std::string& bytes, const std::string& source);
    // Reads `settings.path` through the storage: .parquet (io/parquet.h) or JSON-lines.
    static MetadataTable load(const StorageBackend& storage, const ParquetSettings& settings,
                              bool require_caption);

    // The row for an image path: by file name when identifiers include the extension, else by stem.
    const MetadataRow* find_for_path(const std::string& image_path) const;
    size_t size() const { return rows_.size(); }

  private:
    bool includes_extension_ = false;
    std::map<std::string, MetadataRow> rows_;
};

// The table a dataset's caption strategy reads: the `parquet` block's file for parquet, the
// csv_file for csv (data/csv_dataset.h); nullopt for the other strategies. Rows without a caption
// are kept, so that only their samples are skipped (with a warning naming them).
std::optional<MetadataTable> caption_table_for(const DatasetConfig& config, const StorageBackend& storage);

// All candidate captions of one sample, prefixed/replaced by the instance prompt as configured.
// `table` is required for the parquet strategy and ignored otherwise.
std::vector<std::string> resolve_captions(const DatasetConfig& config, const StorageBackend& storage,
                                          const std::string& image_path,
                                          const MetadataTable* table = nullptr);

// One caption out of several (uniform), as SimpleTuner picks per yield.
const std::string& pick_caption(const std::vector<std::string>& captions, std::mt19937_64& rng);
// "" with probability p (the SDXL collate also zeroes the time ids for such samples).
std::string apply_caption_dropout(const std::string& caption, double probability, std::mt19937_64& rng);

}  // namespace dtune::data
