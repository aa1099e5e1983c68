// `type: csv` datasets (SimpleTuner's CSV backend): a CSV file lists each image by URL (http:// or
// https://) or local path in csv_url_column, with its caption in csv_caption_column. Before
// discovery the images are fetched once into csv_cache_dir; from then on the dataset is that
// folder, bucketed and cached like a local one, with captions from the CSV (caption_strategy csv).
//
// Invariants:
// - a cached image is named by the SHA-256 of its URL or path (so two URLs ending in the same file
//   name never collide) plus the extension of its decoded format; it appears under that name only
//   after it was decoded completely, through an atomic rename, so a file there is always
//   trustworthy and a crashed or interrupted fetch resumes with the rows still missing;
// - only rows of the CSV are trained: other images in csv_cache_dir are left alone and ignored;
// - a URL listed twice is one sample, with the caption of its last row (as pandas' groupby-last
//   in SimpleTuner);
// - transport failures, 429 and 5xx answers are retried a bounded number of times; what still
//   fails (and any 4xx or undecodable answer) is a DataError naming the rows and URLs, raised after
//   every other row was fetched, so the next run only fetches what failed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/captions.h"
#include "data/dataset_config.h"

namespace dtune::data {

struct CsvRow {
    int64_t line = 0;     // where the row starts in the file (1-based; the header is line 1)
    std::string source;   // the URL or local path
    std::string caption;  // may be empty (the sample is then skipped with a warning, as for parquet)
};

// The rows of the dataset's csv_file, one per distinct source, in order of first appearance.
// UsageError for a missing column (listing the columns the file has); DataError for an unreadable
// file, a malformed line or a row without a source, naming the file and line.
std::vector<CsvRow> read_csv_rows(const DatasetConfig& config);

// "<sha256 of source>" — the file name (without extension) of a source's cached image.
std::string csv_cache_stem(const std::string& source);

struct CsvFetchOptions {
    int max_attempts = 4;    // per URL: 1 try + 3 retries on transport errors, 429 and 5xx
    double backoff_s = 0.5;  // sleep before retry k: backoff_s * 2^(k-1)
    double timeout_s = 120;  // one request, connection included
    std::size_t max_bytes = 256u << 20;
    int parallel = 8;  // requests in flight
};

struct CsvFetchReport {
    int64_t rows = 0;
    int64_t fetched = 0;  // new this time
    int64_t reused = 0;   // already in csv_cache_dir
};

// Fetches every row's image not yet in csv_cache_dir (see the file comment). Run by the process
// that writes the bucket index, before discovery.
CsvFetchReport fetch_csv_images(const DatasetConfig& config, const CsvFetchOptions& options = {});

// `files` (discovered in csv_cache_dir) reduced to the CSV's rows (by their hashed names).
std::vector<std::string> csv_rows_only(const DatasetConfig& config, const std::vector<std::string>& files);

// The captions, keyed by cached file stem, for resolve_captions (caption_strategy csv).
MetadataTable csv_caption_table(const DatasetConfig& config);

}  // namespace dtune::data
