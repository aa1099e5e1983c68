// ParquetFile: footer parsing, flat-schema validation and per-column reads over a memory map.
// File layout: "PAR1" | column chunks | FileMetaData (Thrift compact) | u32 metadata length | "PAR1".
#include "io/parquet.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "io/parquet_column.h"

namespace dtune::io {

using namespace parquet;

// The file's bytes: a read-only memory map, or an owned buffer.
struct ParquetFile::Bytes {
    std::vector<std::uint8_t> owned;
    void* map = nullptr;
    std::size_t map_size = 0;
    const std::uint8_t* data = nullptr;
    std::size_t size = 0;

    Bytes() = default;
    Bytes(const Bytes&) = delete;
    Bytes& operator=(const Bytes&) = delete;
    ~Bytes() {
        if (map != nullptr) ::munmap(map, map_size);
    }
};

namespace {

constexpr std::size_t kMagicSize = 4;
constexpr std::size_t kFooterTail = 8;  // u32 metadata length + magic

std::string file_label(const std::string& name) {
    return str("parquet file '", name, "'");
}

std::shared_ptr<ParquetFile::Bytes> map_file(const std::filesystem::path& path);

}  // namespace

std::string ParquetColumnInfo::type_name() const {
    if (type == PhysicalType::kByteArray && is_string) return "STRING";
    if (is_decimal) return "DECIMAL(" + to_string(type) + ")";
    if (is_unsigned && type == PhysicalType::kInt32) return "UINT32";
    if (is_unsigned && type == PhysicalType::kInt64) return "UINT64";
    return to_string(type);
}

ParquetFile::ParquetFile(std::shared_ptr<const Bytes> bytes, std::string name, ParquetLimits limits)
    : bytes_(std::move(bytes)), name_(std::move(name)), limits_(limits) {
    parse_footer();
    build_columns();
    check_row_groups();
}

ParquetFile ParquetFile::open(const std::filesystem::path& path, ParquetLimits limits) {
    return ParquetFile(map_file(path), path.string(), limits);
}

ParquetFile ParquetFile::from_buffer(std::vector<std::uint8_t> bytes, std::string name,
                                     ParquetLimits limits) {
    auto b = std::make_shared<Bytes>();
    b->owned = std::move(bytes);
    b->data = b->owned.data();
    b->size = b->owned.size();
    return ParquetFile(std::move(b), std::move(name), limits);
}

void ParquetFile::parse_footer() {
    const std::uint8_t* data = bytes_->data;
    const std::size_t size = bytes_->size;
    const std::string who = file_label(name_);
    DTUNE_CHECK_AS(
        DataError, size >= kMagicSize + kFooterTail, who, " is only ", size,
        " bytes, too short for a Parquet file (needs at least 12); it is truncated or not Parquet");
    DTUNE_CHECK_AS(DataError, std::memcmp(data, "PAR1", 4) == 0, who,
                   " does not start with the Parquet magic 'PAR1'; it is not a Parquet file");
    const std::uint8_t* tail = data + size - kMagicSize;
    DTUNE_CHECK_AS(
        DataError, std::memcmp(tail, "PARE", 4) != 0, who,
        " has an encrypted footer; encrypted Parquet is not supported, write it without encryption");
    DTUNE_CHECK_AS(
        DataError, std::memcmp(tail, "PAR1", 4) == 0, who,
        " does not end with the Parquet magic 'PAR1'; the file is truncated or still being written");
    std::uint32_t meta_len = 0;
    std::memcpy(&meta_len, data + size - kFooterTail, 4);
    const std::size_t room = size - kMagicSize - kFooterTail;
    DTUNE_CHECK_AS(DataError, meta_len <= room, who, " states a footer of ", meta_len, " bytes but only ",
                   room, " bytes precede it; the file is truncated or corrupt");
    data_end_ = size - kFooterTail - meta_len;
    meta_ = parse_file_metadata(data + data_end_, meta_len, str(who, " footer"));
    DTUNE_CHECK_AS(DataError, !meta_.encrypted, who,
                   " uses Parquet modular encryption, which is not supported; write it without encryption");
    DTUNE_CHECK_AS(DataError, meta_.num_rows >= 0, who, " footer states a negative row count ",
                   meta_.num_rows);
}

void ParquetFile::build_columns() {
    const std::string who = file_label(name_);
    DTUNE_CHECK_AS(DataError, !meta_.schema.empty(), who, " footer has an empty schema; the file is corrupt");
    const auto& schema = meta_.schema;
    for (std::size_t i = 1; i < schema.size(); ++i) {
        const SchemaElement& e = schema[i];
        DTUNE_CHECK_AS(DataError, e.num_children == 0 && e.type.has_value(), who, " column '", e.name,
                       "' is a nested group (struct, list or map), which is not supported; flatten the table "
                       "to scalar columns before writing it");
        const Repetition rep = e.repetition.value_or(Repetition::kRequired);
        DTUNE_CHECK_AS(DataError, rep != Repetition::kRepeated, who, " column '", e.name,
                       "' is repeated (a list), which is not supported; flatten it to scalar columns");
        DTUNE_CHECK_AS(DataError, rep == Repetition::kRequired || rep == Repetition::kOptional, who,
                       " column '", e.name, "' has an invalid repetition ", static_cast<int>(rep),
                       "; the file is corrupt");
        ParquetColumnInfo c;
        c.name = e.name;
        c.type = *e.type;
        c.nullable = rep == Repetition::kOptional;
        c.is_string = e.logical_string;
        c.is_unsigned = e.logical_unsigned;
        c.is_decimal = e.logical_decimal;
        c.supported =
            !c.is_decimal && (c.type == PhysicalType::kBoolean || c.type == PhysicalType::kInt32 ||
                              c.type == PhysicalType::kInt64 || c.type == PhysicalType::kFloat ||
                              c.type == PhysicalType::kDouble || c.type == PhysicalType::kByteArray);
        DTUNE_CHECK_AS(DataError, column_index(c.name) < 0, who, " has two columns named '", c.name,
                       "'; the file is corrupt");
        columns_.push_back(std::move(c));
    }
    const std::int32_t children = schema[0].num_children;
    DTUNE_CHECK_AS(
        DataError, children >= 0 && static_cast<std::size_t>(children) == columns_.size(), who,
        " schema root has ", children, " children but ", columns_.size(),
        " leaf columns follow; nested schemas are not supported and otherwise the file is corrupt");
}

void ParquetFile::check_row_groups() {
    const std::string who = file_label(name_);
    std::int64_t total = 0;
    for (std::size_t g = 0; g < meta_.row_groups.size(); ++g) {
        const RowGroup& rg = meta_.row_groups[g];
        DTUNE_CHECK_AS(DataError, rg.num_rows >= 0 && rg.num_rows <= meta_.num_rows - total, who,
                       " row group ", g, " states ", rg.num_rows, " rows, inconsistent with the file's ",
                       meta_.num_rows, "; the file is corrupt");
        total += rg.num_rows;
        DTUNE_CHECK_AS(DataError, rg.columns.size() == columns_.size(), who, " row group ", g, " has ",
                       rg.columns.size(), " column chunks for ", columns_.size(),
                       " columns; the file is corrupt");
    }
    DTUNE_CHECK_AS(DataError, total == meta_.num_rows, who, " row groups hold ", total,
                   " rows but the footer states ", meta_.num_rows, "; the file is corrupt");
}

int ParquetFile::column_index(std::string_view name) const {
    for (std::size_t i = 0; i < columns_.size(); ++i) {
        if (columns_[i].name == name) return static_cast<int>(i);
    }
    return -1;
}

std::vector<Cell> ParquetFile::read_column(std::string_view name) const {
    const int index = column_index(name);
    if (index < 0) {
        std::string present;
        for (const auto& c : columns_) present += (present.empty() ? "" : ", ") + c.name;
        throw DataError(str(file_label(name_), " has no column '", name, "' (columns: ", present,
                            "); check the column name in the dataset config"));
    }
    return read_column(static_cast<std::size_t>(index));
}

std::vector<Cell> ParquetFile::read_column(std::size_t index) const {
    DTUNE_CHECK_AS(UsageError, index < columns_.size(), "column index ", index, " out of range for ",
                   file_label(name_), " with ", columns_.size(), " columns");
    const ParquetColumnInfo& col = columns_[index];
    const std::string who = str(file_label(name_), " column '", col.name, "'");
    DTUNE_CHECK_AS(DataError, !col.is_decimal, who,
                   " is a DECIMAL column, which is not supported; cast it to float64 before writing");
    DTUNE_CHECK_AS(DataError, col.supported, who, " has physical type ", to_string(col.type),
                   ", which is not supported (supported: BOOLEAN, INT32, INT64, FLOAT, DOUBLE, BYTE_ARRAY); "
                   "cast it (e.g. timestamps to int64, decimals to double) before writing");
    std::vector<Cell> cells;
    cells.reserve(static_cast<std::size_t>(std::min<std::int64_t>(meta_.num_rows, 1 << 20)));
    for (std::size_t g = 0; g < meta_.row_groups.size(); ++g) {
        const RowGroup& rg = meta_.row_groups[g];
        const ColumnChunk& chunk = rg.columns[index];
        const std::string where = str(who, " row group ", g);
        DTUNE_CHECK_AS(DataError, !chunk.file_path, where, " stores its data in another file ('",
                       *chunk.file_path,
                       "'); external column chunks are not supported, write a single self-contained file");
        DTUNE_CHECK_AS(DataError, !chunk.encrypted, where, " is encrypted, which is not supported");
        DTUNE_CHECK_AS(DataError, chunk.has_meta_data, where, " has no column metadata; the file is corrupt");
        const ColumnMetaData& m = chunk.meta;
        DTUNE_CHECK_AS(DataError, m.type == col.type, where, " chunk type ", to_string(m.type),
                       " differs from the schema type ", to_string(col.type), "; the file is corrupt");
        DTUNE_CHECK_AS(DataError, m.num_values == rg.num_rows, where, " holds ", m.num_values, " values for ",
                       rg.num_rows,
                       " rows; repeated columns are not supported, otherwise the file is corrupt");
        std::int64_t start = m.data_page_offset;
        if (m.dictionary_page_offset && *m.dictionary_page_offset > 0 && *m.dictionary_page_offset < start) {
            start = *m.dictionary_page_offset;
        }
        const auto end_limit = static_cast<std::int64_t>(data_end_);
        DTUNE_CHECK_AS(DataError,
                       start >= static_cast<std::int64_t>(kMagicSize) && start <= end_limit &&
                           m.total_compressed_size >= 0 && m.total_compressed_size <= end_limit - start,
                       where, " spans bytes [", start, ", ", start, " + ", m.total_compressed_size,
                       ") outside the data area [4, ", data_end_, "); the file is truncated or corrupt");
        ChunkSpec spec;
        spec.type = col.type;
        spec.codec = m.codec;
        spec.optional = col.nullable;
        spec.is_unsigned = col.is_unsigned;
        spec.num_values = static_cast<std::size_t>(rg.num_rows);
        spec.max_page_bytes = limits_.max_page_bytes;
        spec.context = where;
        read_chunk(bytes_->data + start, static_cast<std::size_t>(m.total_compressed_size), spec, cells);
    }
    return cells;
}

Table ParquetFile::read_table(const std::vector<std::string>& names) const {
    Table table;
    if (names.empty()) {
        for (std::size_t i = 0; i < columns_.size(); ++i) table.add_column(columns_[i].name, read_column(i));
    } else {
        for (const auto& n : names) table.add_column(n, read_column(n));
    }
    return table;
}

Table read_parquet(const std::filesystem::path& path, const std::vector<std::string>& names) {
    return ParquetFile::open(path).read_table(names);
}

namespace {

std::shared_ptr<ParquetFile::Bytes> map_file(const std::filesystem::path& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    DTUNE_CHECK_AS(DataError, fd >= 0, "cannot open parquet file '", path.string(),
                   "': ", std::strerror(errno), "; check the path in the dataset config");
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd);
        throw DataError(str("parquet file '", path.string(),
                            "' is not a regular file; point the config at a .parquet file"));
    }
    auto b = std::make_shared<ParquetFile::Bytes>();
    b->size = static_cast<std::size_t>(st.st_size);
    if (b->size > 0) {
        void* p = ::mmap(nullptr, b->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            const int err = errno;
            ::close(fd);
            throw DataError(str("cannot map parquet file '", path.string(), "': ", std::strerror(err)));
        }
        b->map = p;
        b->map_size = b->size;
        b->data = static_cast<const std::uint8_t*>(p);
    }
    ::close(fd);
    return b;
}

}  // namespace

}  // namespace dtune::io
