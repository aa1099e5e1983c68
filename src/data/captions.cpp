// Caption strategies and the metadata table.
#include "data/captions.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <sstream>
#include <string_view>
#include <variant>

#include "core/error.h"
#include "core/utf8.h"
#include "data/csv_dataset.h"
#include "data/storage.h"
#include "io/parquet.h"

namespace dtune::data {

using nlohmann::json;

namespace {

std::string trim(const std::string& s) {
    const auto b = s.find_first_not_of(" \t\r\n");
    if (b == std::string::npos) return {};
    return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

// Where a table strategy's captions come from, for messages.
std::string table_name(const DatasetConfig& c) {
    if (c.caption_strategy == CaptionStrategy::kCsv && c.csv)
        return c.csv->file + " (column '" + c.csv->caption_column + "')";
    return c.parquet ? c.parquet->path : std::string("the table");
}

// A caption cell: a string, or a list of strings (multi-caption); anything else yields nothing.
std::vector<std::string> caption_cell(const json& row, const std::string& column) {
    std::vector<std::string> out;
    auto it = row.find(column);
    if (it == row.end()) return out;
    if (it->is_string() && !trim(it->get<std::string>()).empty()) out.push_back(trim(it->get<std::string>()));
    if (it->is_array())
        for (const auto& v : *it)
            if (v.is_string() && !trim(v.get<std::string>()).empty())
                out.push_back(trim(v.get<std::string>()));
    return out;
}

std::optional<int> int_cell(const json& row, const std::string& column) {
    if (column.empty()) return std::nullopt;
    auto it = row.find(column);
    if (it == row.end() || !it->is_number()) return std::nullopt;
    return static_cast<int>(it->get<double>());
}

// io::Table rows as JSON objects (nulls left out), the shape from_rows() reads.
std::vector<json> table_rows(const io::Table& table) {
    std::vector<json> rows(table.num_rows(), json::object());
    for (size_t c = 0; c < table.num_columns(); ++c) {
        const auto& cells = table.column(c);
        for (size_t r = 0; r < cells.size(); ++r) {
            if (!cells[r]) continue;
            std::visit([&](const auto& v) { rows[r][table.names()[c]] = v; }, *cells[r]);
        }
    }
    return rows;
}

}  // namespace

std::vector<json> MetadataTable::parse_jsonl(const std::string& bytes, const std::string& source) {
    std::vector<json> rows;
    std::istringstream in(bytes);
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
        if (trim(line).empty()) continue;
        try {
            rows.push_back(json::parse(line));
        } catch (const json::parse_error& e) {
            throw DataError(str(source, ": line ", n, " is not valid JSON (", e.what(), ")"));
        }
    }
    return rows;
}

MetadataTable MetadataTable::from_rows(const std::vector<json>& rows, const ParquetSettings& s,
                                       const std::string& source, bool require_caption) {
    MetadataTable table;
    table.includes_extension_ = s.identifier_includes_extension;
    for (size_t i = 0; i < rows.size(); ++i) {
        const json& row = rows[i];
        auto id = row.find(s.filename_column);
        std::string identifier;
        if (id != row.end() && id->is_string())
            identifier = trim(id->get<std::string>());
        else if (id != row.end() && id->is_number_integer())
            identifier = std::to_string(id->get<int64_t>());
        if (identifier.empty())
            throw UsageError(str(source, ": row ", i, " has no value in filename_column '", s.filename_column,
                                 "'; fix the table or set parquet.filename_column"));
        MetadataRow r;
        r.identifier = identifier;
        r.captions = caption_cell(row, s.caption_column);
        if (r.captions.empty() && !s.fallback_caption_column.empty())
            r.captions = caption_cell(row, s.fallback_caption_column);
        if (r.captions.empty() && require_caption)
            throw UsageError(str(source, ": row ", i, " ('", identifier,
                                 "') has an empty caption in column '", s.caption_column, "'",
                                 s.fallback_caption_column.empty() ? "" : " and its fallback",
                                 "; fill it or set parquet.fallback_caption_column"));
        r.width = int_cell(row, s.width_column);
        r.height = int_cell(row, s.height_column);
        table.rows_[identifier] = std::move(r);
    }
    return table;
}

MetadataTable MetadataTable::load(const StorageBackend& storage, const ParquetSettings& s,
                                  bool require_caption) {
    std::string ext = std::filesystem::path(s.path).extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
    if (ext == ".jsonl" || ext == ".json" || ext == ".ndjson")
        return from_rows(parse_jsonl(storage.read(s.path), s.path), s, s.path, require_caption);
    DTUNE_CHECK_AS(
        UsageError, ext == ".parquet", s.path,
        ": the metadata table must be .parquet or JSON-lines (.jsonl); convert it or fix parquet.path");
    // Through the storage (local or S3) into the Parquet reader; only the configured columns.
    const std::string bytes = storage.read(s.path);
    const auto file = io::ParquetFile::from_buffer(std::vector<uint8_t>(bytes.begin(), bytes.end()), s.path);
    std::vector<std::string> wanted;
    for (const auto& c :
         {s.filename_column, s.caption_column, s.fallback_caption_column, s.width_column, s.height_column})
        if (!c.empty() && file.column_index(c) >= 0 &&
            std::find(wanted.begin(), wanted.end(), c) == wanted.end())
            wanted.push_back(c);
    return from_rows(table_rows(file.read_table(wanted)), s, s.path, require_caption);
}

const MetadataRow* MetadataTable::find_for_path(const std::string& image_path) const {
    const std::filesystem::path p(image_path);
    auto it = rows_.find(includes_extension_ ? p.filename().string() : p.stem().string());
    return it == rows_.end() ? nullptr : &it->second;
}

std::vector<std::string> resolve_captions(const DatasetConfig& c, const StorageBackend& storage,
                                          const std::string& image_path, const MetadataTable* table) {
    std::vector<std::string> captions;
    const std::filesystem::path p(image_path);
    switch (c.caption_strategy) {
        case CaptionStrategy::kFilename: {
            std::string stem = p.stem().string();
            for (char& ch : stem)
                if (ch == '_') ch = ' ';
            captions.push_back(trim(stem));
            break;
        }
        case CaptionStrategy::kTextfile: {
            const std::string txt = (p.parent_path() / (p.stem().string() + ".txt")).string();
            const std::optional<std::string> found = storage.read_if_exists(txt);  // one request on S3
            if (!found)
                throw DataError(str(image_path, ": caption file ", txt,
                                    " is missing; add it or change caption_strategy"));
            const std::string& text = *found;
            if (c.disable_multiline_split) {
                captions.push_back(trim(text));
            } else {
                std::istringstream in(text);
                for (std::string line; std::getline(in, line);)
                    if (!trim(line).empty()) captions.push_back(trim(line));
            }
            break;
        }
        case CaptionStrategy::kInstancePrompt: captions.push_back(c.instance_prompt); break;
        case CaptionStrategy::kParquet:
        case CaptionStrategy::kCsv: {
            DTUNE_CHECK_AS(UsageError, table != nullptr, "dataset '", c.id, "': caption_strategy ",
                           to_string(c.caption_strategy), " needs the caption table");
            const MetadataRow* row = table->find_for_path(image_path);
            if (!row) throw DataError(str(image_path, ": no row in ", table_name(c)));
            captions = row->captions;
            break;
        }
    }
    if (c.only_instance_prompt)
        captions = {c.instance_prompt};
    else if (c.prepend_instance_prompt && !c.instance_prompt.empty())
        for (auto& cap : captions) cap = cap.empty() ? c.instance_prompt : c.instance_prompt + " " + cap;
    captions.erase(std::remove_if(captions.begin(), captions.end(), [](const auto& s) { return s.empty(); }),
                   captions.end());
    // Checked here, so that the sample is left out with a warning naming its caption's source
    // instead of the text encoder stopping the whole run later without naming it.
    for (const auto& cap : captions)
        if (const auto at = first_invalid_utf8(cap)) {
            const std::string source =
                c.caption_strategy == CaptionStrategy::kTextfile
                    ? "caption file " + (p.parent_path() / (p.stem().string() + ".txt")).string()
                : c.caption_strategy == CaptionStrategy::kFilename ? "file name"
                : c.caption_strategy == CaptionStrategy::kParquet ||
                        c.caption_strategy == CaptionStrategy::kCsv
                    ? "caption in " + table_name(c)
                    : "instance_prompt";
            throw DataError(str(image_path, ": the ", source, " is not valid UTF-8 (byte ", *at,
                                " of the caption); re-save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)"));
        }
    if (captions.empty())
        throw DataError(str(image_path, ": the caption is empty (strategy ", to_string(c.caption_strategy),
                            "); give it a caption or set instance_prompt"));
    return captions;
}

std::optional<MetadataTable> caption_table_for(const DatasetConfig& c, const StorageBackend& storage) {
    if (c.caption_strategy == CaptionStrategy::kCsv) return csv_caption_table(c);
    if (c.caption_strategy != CaptionStrategy::kParquet) return std::nullopt;
    DTUNE_CHECK_AS(UsageError, c.parquet.has_value(), "dataset '", c.id,
                   "': caption_strategy parquet needs a \"parquet\" block with the table's path");
    return MetadataTable::load(storage, *c.parquet, false);
}

const std::string& pick_caption(const std::vector<std::string>& captions, std::mt19937_64& rng) {
    DTUNE_CHECK(!captions.empty(), "pick_caption on an empty list");
    if (captions.size() == 1) return captions.front();
    return captions[std::uniform_int_distribution<size_t>(0, captions.size() - 1)(rng)];
}

std::string apply_caption_dropout(const std::string& caption, double probability, std::mt19937_64& rng) {
    if (probability <= 0) return caption;
    return std::uniform_real_distribution<double>(0, 1)(rng) < probability ? std::string() : caption;
}

}  // namespace dtune::data
