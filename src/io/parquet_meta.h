// Parquet file metadata (the subset of parquet.thrift we use) and its decoding from the Thrift
// compact bytes of the footer and of page headers. Field numbers follow parquet-format's
// parquet.thrift; unknown fields are skipped so newer writers still parse. Values are taken as
// written: semantic checks (offsets inside the file, flat schema) happen in parquet.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtune::io::parquet {

enum class PhysicalType : std::int32_t {
    kBoolean = 0,
    kInt32 = 1,
    kInt64 = 2,
    kInt96 = 3,
    kFloat = 4,
    kDouble = 5,
    kByteArray = 6,
    kFixedLenByteArray = 7,
};
enum class Repetition : std::int32_t { kRequired = 0, kOptional = 1, kRepeated = 2 };
enum class Codec : std::int32_t {
    kUncompressed = 0,
    kSnappy = 1,
    kGzip = 2,
    kLzo = 3,
    kBrotli = 4,
    kLz4 = 5,
    kZstd = 6,
    kLz4Raw = 7,
};
enum class Encoding : std::int32_t {
    kPlain = 0,
    kPlainDictionary = 2,
    kRle = 3,
    kBitPacked = 4,
    kDeltaBinaryPacked = 5,
    kDeltaLengthByteArray = 6,
    kDeltaByteArray = 7,
    kRleDictionary = 8,
    kByteStreamSplit = 9,
};
enum class PageType : std::int32_t { kDataPage = 0, kIndexPage = 1, kDictionaryPage = 2, kDataPageV2 = 3 };

std::string to_string(PhysicalType t);
std::string to_string(Codec c);
std::string to_string(Encoding e);

struct SchemaElement {
    std::optional<PhysicalType> type;  // absent on group nodes (the root, structs, lists)
    std::int32_t type_length = 0;
    std::optional<Repetition> repetition;
    std::string name;
    std::int32_t num_children = 0;
    std::optional<std::int32_t> converted_type;
    bool logical_string = false;    // LogicalType STRING/ENUM/JSON or ConvertedType UTF8/ENUM/JSON
    bool logical_unsigned = false;  // LogicalType INTEGER(signed=false) or ConvertedType UINT_*
    bool logical_decimal = false;   // LogicalType DECIMAL or ConvertedType DECIMAL: scaled integers
};

struct ColumnMetaData {
    PhysicalType type = PhysicalType::kBoolean;
    std::vector<std::string> path_in_schema;
    Codec codec = Codec::kUncompressed;
    std::int64_t num_values = 0;
    std::int64_t total_compressed_size = 0;
    std::int64_t data_page_offset = 0;
    std::optional<std::int64_t> dictionary_page_offset;
};

struct ColumnChunk {
    std::optional<std::string> file_path;  // set when the data lives in another file
    bool has_meta_data = false;
    bool encrypted = false;
    ColumnMetaData meta;
};

struct RowGroup {
    std::vector<ColumnChunk> columns;
    std::int64_t num_rows = 0;
};

struct FileMetaData {
    std::int32_t version = 0;
    std::vector<SchemaElement> schema;
    std::int64_t num_rows = 0;
    std::vector<RowGroup> row_groups;
    std::vector<std::pair<std::string, std::string>> key_value_metadata;
    std::string created_by;
    bool encrypted = false;  // encryption_algorithm present
};

struct DataPageHeader {
    std::int32_t num_values = 0;
    Encoding encoding = Encoding::kPlain;
    Encoding definition_level_encoding = Encoding::kRle;
    Encoding repetition_level_encoding = Encoding::kRle;
};

struct DictionaryPageHeader {
    std::int32_t num_values = 0;
    Encoding encoding = Encoding::kPlain;
};

struct DataPageHeaderV2 {
    std::int32_t num_values = 0;
    std::int32_t num_nulls = 0;
    std::int32_t num_rows = 0;
    Encoding encoding = Encoding::kPlain;
    std::int32_t definition_levels_byte_length = 0;
    std::int32_t repetition_levels_byte_length = 0;
    bool is_compressed = true;
};

struct PageHeader {
    PageType type = PageType::kDataPage;
    std::int32_t uncompressed_page_size = 0;
    std::int32_t compressed_page_size = 0;
    std::optional<DataPageHeader> data_page;
    std::optional<DictionaryPageHeader> dictionary_page;
    std::optional<DataPageHeaderV2> data_page_v2;
};

// Decodes FileMetaData from the footer bytes; context names the file in error messages.
FileMetaData parse_file_metadata(const std::uint8_t* data, std::size_t size, const std::string& context);

// Decodes one page header starting at data; *consumed receives its length in bytes.
PageHeader parse_page_header(const std::uint8_t* data, std::size_t size, const std::string& context,
                             std::size_t* consumed);

}  // namespace dtune::io::parquet
