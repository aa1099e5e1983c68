// Torch-free reader for Parquet files as pyarrow and pandas write them by default: flat schemas
// of BOOLEAN / INT32 / INT64 / FLOAT / DOUBLE / BYTE_ARRAY columns, required or optional, PLAIN or
// dictionary encoded, data pages v1 and v2, uncompressed / snappy / gzip / zstd.
// Invariants: the file bytes are validated before use (magic, footer length, every offset and
// length against the buffer), so any input yields either correct cells or a DataError naming the
// file and the unsupported feature or the corrupt structure. Nested and repeated columns,
// encryption, INT96 / FIXED_LEN_BYTE_ARRAY and other codecs/encodings are reported, not guessed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "io/parquet_meta.h"
#include "io/table.h"

namespace dtune::io {

struct ParquetColumnInfo {
    std::string name;
    parquet::PhysicalType type = parquet::PhysicalType::kBoolean;
    bool nullable = false;          // OPTIONAL repetition
    bool is_string = false;         // BYTE_ARRAY annotated as UTF-8 (STRING / UTF8)
    bool is_unsigned = false;       // INT32/INT64 annotated unsigned: read zero-extended
    bool is_decimal = false;        // DECIMAL annotation: scaled integers, not supported
    bool supported = false;         // read_column can decode it
    std::string type_name() const;  // "INT64", "STRING", "BYTE_ARRAY", ...
};

struct ParquetLimits {
    // Largest decompressed page we accept; a header claiming more is treated as corrupt, so a
    // hostile file cannot make us allocate gigabytes. Real writers use ~1 MiB pages.
    std::size_t max_page_bytes = std::size_t{1} << 30;
};

class ParquetFile {
  public:
    // Opens a file (memory-mapped) and parses its footer. Throws DataError.
    static ParquetFile open(const std::filesystem::path& path, ParquetLimits limits = {});
    // Parses bytes already in memory (copied); `name` stands for the file in messages.
    static ParquetFile from_buffer(std::vector<std::uint8_t> bytes, std::string name,
                                   ParquetLimits limits = {});

    const std::string& name() const { return name_; }
    std::int64_t num_rows() const { return meta_.num_rows; }
    std::size_t num_row_groups() const { return meta_.row_groups.size(); }
    const std::vector<ParquetColumnInfo>& columns() const { return columns_; }
    // Footer key/value metadata (pandas stores its schema under "pandas", arrow under "ARROW:schema").
    const std::vector<std::pair<std::string, std::string>>& key_value_metadata() const {
        return meta_.key_value_metadata;
    }
    const std::string& created_by() const { return meta_.created_by; }

    // Index of a column by name, or -1.
    int column_index(std::string_view name) const;
    // Reads every row of one column. Throws DataError for a missing column (naming those present),
    // an unsupported type or encoding, or corrupt data.
    std::vector<Cell> read_column(std::size_t index) const;
    std::vector<Cell> read_column(std::string_view name) const;
    // Reads the named columns (all columns when names is empty) into a Table.
    Table read_table(const std::vector<std::string>& names = {}) const;

    struct Bytes;  // implementation detail: the mapped or owned file bytes

  private:
    ParquetFile(std::shared_ptr<const Bytes> bytes, std::string name, ParquetLimits limits);
    void parse_footer();
    void build_columns();
    void check_row_groups();

    std::shared_ptr<const Bytes> bytes_;
    std::string name_;
    ParquetLimits limits_;
    parquet::FileMetaData meta_;
    std::vector<ParquetColumnInfo> columns_;
    std::size_t data_end_ = 0;  // first byte of the footer metadata: column data lies before it
};

// Convenience: open a file and read the named columns (all when empty).
Table read_parquet(const std::filesystem::path& path, const std::vector<std::string>& names = {});

}  // namespace dtune::io
