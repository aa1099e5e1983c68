// CSV datasets: the file's rows (RFC 4180 quoting), the fetch into csv_cache_dir and the caption
// table. See csv_dataset.h for the invariants.
#include "data/csv_dataset.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "io/image.h"
#include "io/image_info.h"
#include "io/sigv4.h"
#include "notify/http.h"

namespace dtune::data {
namespace {

namespace stdfs = std::filesystem;

const CsvSettings& settings_of(const DatasetConfig& c) {
    DTUNE_CHECK_AS(UsageError, c.csv.has_value(), "dataset '", c.id, "' is not a csv dataset");
    return *c.csv;
}

// One record: its fields and the line it starts on. Quoted fields may hold commas, doubled quotes
// and line breaks; CRLF and LF both end a record.
struct Record {
    int64_t line = 0;
    std::vector<std::string> fields;
};

std::vector<Record> parse_records(const std::string& text, const std::string& source) {
    std::vector<Record> out;
    size_t i = text.rfind("\xEF\xBB\xBF", 0) == 0 ? 3 : 0;  // a UTF-8 byte-order mark
    int64_t line = 1;
    while (i < text.size()) {
        Record r;
        r.line = line;
        std::string field;
        bool quoted = false, was_quoted = false, done = false;
        while (!done) {
            if (i >= text.size()) {
                if (quoted)
                    throw DataError(str(source, ": line ", r.line, ": a quoted field is never closed"));
                done = true;
                break;
            }
            const char ch = text[i++];
            if (quoted) {
                if (ch == '"' && i < text.size() && text[i] == '"') {
                    field += '"';
                    ++i;
                } else if (ch == '"') {
                    quoted = false;
                } else {
                    if (ch == '\n') ++line;
                    field += ch;
                }
            } else if (ch == '"' && field.empty() && !was_quoted) {
                quoted = was_quoted = true;
            } else if (ch == ',') {
                r.fields.push_back(std::move(field));
                field.clear();
                was_quoted = false;
            } else if (ch == '\n' || ch == '\r') {
                if (ch == '\r' && i < text.size() && text[i] == '\n') ++i;
                ++line;
                done = true;
            } else {
                field += ch;
            }
        }
        r.fields.push_back(std::move(field));
        const bool blank = r.fields.size() == 1 && r.fields[0].empty() && !was_quoted;
        if (!blank) out.push_back(std::move(r));  // pandas skips blank lines
    }
    return out;
}

size_t column_index(const Record& header, const std::string& name, const std::string& key,
                    const std::string& source, const std::string& id) {
    for (size_t i = 0; i < header.fields.size(); ++i)
        if (header.fields[i] == name) return i;
    std::string names;
    for (const auto& f : header.fields) names += (names.empty() ? "'" : ", '") + f + "'";
    throw UsageError(str("dataset '", id, "', key '", key, "': ", source, " has no column '", name,
                         "' (its header has ", names, "); set ", key, " to one of them or fix the header"));
}

bool is_url(const std::string& source) {
    return source.rfind("http://", 0) == 0 || source.rfind("https://", 0) == 0;
}

const char* extension_of(io::ImageFormat f) {
    switch (f) {
        case io::ImageFormat::kJpeg: return ".jpg";
        case io::ImageFormat::kPng: return ".png";
        case io::ImageFormat::kWebp: return ".webp";
        case io::ImageFormat::kUnknown: break;
    }
    return nullptr;
}

// The cached file of a row, if a complete one is there.
std::optional<stdfs::path> cached_file(const stdfs::path& dir, const std::string& stem) {
    for (const char* ext : {".jpg", ".png", ".webp"}) {
        std::error_code ec;
        const stdfs::path p = dir / (stem + ext);
        if (stdfs::is_regular_file(p, ec)) return p;
    }
    return std::nullopt;
}

// The bytes of one source: a GET with bounded retries, or a local file. Throws DataError with the
// reason (without the row: the caller adds it).
std::string fetch_bytes(const std::string& source, const CsvFetchOptions& o) {
    if (!is_url(source)) {
        std::error_code ec;
        if (!stdfs::is_regular_file(source, ec))
            throw DataError(
                str("the local file does not exist (relative paths are read from the current "
                    "directory, ",
                    stdfs::current_path().string(), ")"));
        return fs::read_file(source);
    }
    notify::HttpOptions http;
    http.timeout_s = o.timeout_s;
    std::string body;
    notify::HttpResult r;
    const int attempts = std::max(1, o.max_attempts);
    for (int attempt = 1; attempt <= attempts; ++attempt) {
        r = notify::http_get(source, body, http, o.max_bytes);
        if (r.ok()) return body;
        if (!r.retryable() || attempt == attempts) break;
        std::this_thread::sleep_for(std::chrono::duration<double>(o.backoff_s * std::pow(2.0, attempt - 1)));
    }
    const std::string what = r.error.empty() ? str("HTTP status ", r.status) : r.error;
    throw DataError(str(what, r.retryable() ? str(" (after ", attempts, " attempts)") : std::string()));
}

// Decodes the bytes completely (the proof they are an image) and stores them under their format's
// extension through a temporary file and an atomic rename.
void store_verified(const stdfs::path& dir, const std::string& stem, const std::string& bytes,
                    const std::string& source) {
    io::ImageInfo info;
    std::string why;
    const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
    if (io::parse_image_info(data, bytes.size(), true, info, why) != io::ParseStatus::kOk ||
        !extension_of(info.format))
        throw DataError(str("the content (", bytes.size(), " bytes) is not a JPEG, PNG or WebP image",
                            why.empty() ? std::string() : " (" + why + ")"));
    io::decode_image(bytes, source);  // throws DataError for truncated or corrupt data
    fs::write_file_atomic(dir / (stem + extension_of(info.format)), bytes);
}

}  // namespace

std::string csv_cache_stem(const std::string& source) {
    return io::sigv4::sha256_hex(source);
}

std::vector<CsvRow> read_csv_rows(const DatasetConfig& config) {
    const CsvSettings& s = settings_of(config);
    std::error_code ec;
    DTUNE_CHECK_AS(DataError, stdfs::is_regular_file(s.file, ec), "dataset '", config.id,
                   "', key 'csv_file': ", s.file,
                   " does not exist or is not a file; point csv_file at the CSV listing the images");
    const std::vector<Record> records = parse_records(fs::read_file(s.file), s.file);
    DTUNE_CHECK_AS(DataError, !records.empty(), "dataset '", config.id, "': ", s.file,
                   " is empty; it needs a header line naming its columns and one line per image");
    const Record& header = records.front();
    const size_t url = column_index(header, s.url_column, "csv_url_column", s.file, config.id);
    const size_t caption = column_index(header, s.caption_column, "csv_caption_column", s.file, config.id);
    std::vector<CsvRow> rows;
    std::map<std::string, size_t> seen;  // source -> index in rows
    for (size_t i = 1; i < records.size(); ++i) {
        const Record& r = records[i];
        if (r.fields.size() > header.fields.size())
            throw DataError(str(s.file, ": line ", r.line, " has ", r.fields.size(),
                                " fields but the header has ", header.fields.size(),
                                "; quote fields that contain commas"));
        auto cell = [&](size_t c) { return c < r.fields.size() ? r.fields[c] : std::string(); };
        CsvRow row{r.line, cell(url), cell(caption)};
        const auto b = row.source.find_first_not_of(" \t");
        row.source = b == std::string::npos
                         ? std::string()
                         : row.source.substr(b, row.source.find_last_not_of(" \t") - b + 1);
        if (row.source.empty())
            throw DataError(str(s.file, ": line ", r.line, " has no value in column '", s.url_column,
                                "'; give every row an image URL or path, or delete the row"));
        auto [it, fresh] = seen.emplace(row.source, rows.size());
        if (fresh)
            rows.push_back(std::move(row));
        else
            rows[it->second] = std::move(row);  // the last row of a URL wins
    }
    return rows;
}

CsvFetchReport fetch_csv_images(const DatasetConfig& config, const CsvFetchOptions& options) {
    const CsvSettings& s = settings_of(config);
    const std::vector<CsvRow> rows = read_csv_rows(config);
    const stdfs::path dir = s.cache_dir;
    fs::require_writable_dir(dir, "csv_cache_dir");
    CsvFetchReport report;
    report.rows = static_cast<int64_t>(rows.size());
    std::vector<const CsvRow*> missing;
    for (const auto& r : rows)
        if (!cached_file(dir, csv_cache_stem(r.source))) missing.push_back(&r);
    report.reused = report.rows - static_cast<int64_t>(missing.size());
    if (!missing.empty())
        log::info() << "dataset '" << config.id << "': fetching " << missing.size() << " of " << rows.size()
                    << " image(s) listed in " << s.file << " into " << s.cache_dir;
    std::vector<std::string> errors(missing.size());
    std::atomic<size_t> next{0};
    std::atomic<int64_t> fetched{0};
    auto work = [&] {
        for (size_t i = next++; i < missing.size(); i = next++) {
            const CsvRow& r = *missing[i];
            try {
                store_verified(dir, csv_cache_stem(r.source), fetch_bytes(r.source, options), r.source);
                ++fetched;
            } catch (const std::exception& e) {  // a decoder's or the file system's error too
                errors[i] = str("line ", r.line, ": ", r.source, ": ", e.what());
            }
        }
    };
    std::vector<std::thread> threads;
    const size_t n = std::min(missing.size(), static_cast<size_t>(std::max(1, options.parallel)));
    for (size_t t = 1; t < n; ++t) threads.emplace_back(work);
    work();
    for (auto& t : threads) t.join();
    report.fetched = fetched;
    std::vector<std::string> failed;
    for (auto& e : errors)
        if (!e.empty()) failed.push_back(std::move(e));
    if (failed.empty()) return report;
    std::string listed;
    for (size_t i = 0; i < failed.size() && i < 10; ++i) listed += "\n  " + failed[i];
    if (failed.size() > 10) listed += str("\n  ... and ", failed.size() - 10, " more");
    throw DataError(str("dataset '", config.id, "': ", failed.size(), " of ", rows.size(),
                        " image(s) listed in ", s.file, " could not be fetched:", listed,
                        "\nfix or delete those rows and run again; the ", report.reused + report.fetched,
                        " image(s) already in ", s.cache_dir, " are kept and not fetched again"));
}

std::vector<std::string> csv_rows_only(const DatasetConfig& config, const std::vector<std::string>& files) {
    std::set<std::string> stems;
    for (const auto& r : read_csv_rows(config)) stems.insert(csv_cache_stem(r.source));
    std::vector<std::string> out;
    for (const auto& f : files)
        if (stems.count(stdfs::path(f).stem().string())) out.push_back(f);
    return out;
}

MetadataTable csv_caption_table(const DatasetConfig& config) {
    std::vector<nlohmann::json> rows;
    for (const auto& r : read_csv_rows(config))
        rows.push_back({{"stem", csv_cache_stem(r.source)}, {"caption", r.caption}});
    ParquetSettings by_stem;
    by_stem.filename_column = "stem";
    by_stem.caption_column = "caption";
    return MetadataTable::from_rows(rows, by_stem, settings_of(config).file, false);
}

}  // namespace dtune::data
