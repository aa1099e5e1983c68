// Thrift decoding of parquet.thrift structs. Every field handler either reads its value with the
// expected wire type or skips it; enum values are range-checked later where they are used.
#include "io/parquet_meta.h"

#include "core/error.h"
#include "io/thrift_compact.h"

namespace dtune::io::parquet {

using thrift::CompactReader;
using thrift::Type;

std::string to_string(PhysicalType t) {
    switch (t) {
        case PhysicalType::kBoolean: return "BOOLEAN";
        case PhysicalType::kInt32: return "INT32";
        case PhysicalType::kInt64: return "INT64";
        case PhysicalType::kInt96: return "INT96";
        case PhysicalType::kFloat: return "FLOAT";
        case PhysicalType::kDouble: return "DOUBLE";
        case PhysicalType::kByteArray: return "BYTE_ARRAY";
        case PhysicalType::kFixedLenByteArray: return "FIXED_LEN_BYTE_ARRAY";
    }
    return str("physical type ", static_cast<int>(t));
}

std::string to_string(Codec c) {
    switch (c) {
        case Codec::kUncompressed: return "UNCOMPRESSED";
        case Codec::kSnappy: return "SNAPPY";
        case Codec::kGzip: return "GZIP";
        case Codec::kLzo: return "LZO";
        case Codec::kBrotli: return "BROTLI";
        case Codec::kLz4: return "LZ4";
        case Codec::kZstd: return "ZSTD";
        case Codec::kLz4Raw: return "LZ4_RAW";
    }
    return str("codec ", static_cast<int>(c));
}

std::string to_string(Encoding e) {
    switch (e) {
        case Encoding::kPlain: return "PLAIN";
        case Encoding::kPlainDictionary: return "PLAIN_DICTIONARY";
        case Encoding::kRle: return "RLE";
        case Encoding::kBitPacked: return "BIT_PACKED";
        case Encoding::kDeltaBinaryPacked: return "DELTA_BINARY_PACKED";
        case Encoding::kDeltaLengthByteArray: return "DELTA_LENGTH_BYTE_ARRAY";
        case Encoding::kDeltaByteArray: return "DELTA_BYTE_ARRAY";
        case Encoding::kRleDictionary: return "RLE_DICTIONARY";
        case Encoding::kByteStreamSplit: return "BYTE_STREAM_SPLIT";
    }
    return str("encoding ", static_cast<int>(e));
}

namespace {

// LogicalType is a union: 1 STRING, 4 ENUM, 5 DECIMAL, 10 INTEGER (IntType: 2 isSigned), 12 JSON.
void read_logical_type(CompactReader& r, Type type, SchemaElement& e) {
    if (type != Type::kStruct) {
        r.skip(type);
        return;
    }
    r.read_struct([&](std::int16_t id, Type t) {
        if (t != Type::kStruct) {
            r.skip(t);
            return;
        }
        if (id == 1 || id == 4 || id == 12) e.logical_string = true;
        if (id == 5) e.logical_decimal = true;
        if (id != 10) {
            r.skip(t);
            return;
        }
        r.read_struct([&](std::int16_t int_id, Type int_t) {
            if (int_id == 2 && (int_t == Type::kTrue || int_t == Type::kFalse)) {
                e.logical_unsigned = !r.read_bool(int_t);
            } else {
                r.skip(int_t);
            }
        });
    });
}

SchemaElement read_schema_element(CompactReader& r) {
    // ConvertedType values from parquet.thrift.
    constexpr std::int32_t kUtf8 = 0, kEnum = 4, kDecimal = 5, kUint8 = 11, kUint64 = 14, kJson = 19;
    SchemaElement e;
    r.read_struct([&](std::int16_t id, Type t) {
        switch (id) {
            case 1: e.type = static_cast<PhysicalType>(r.read_i32(t)); break;
            case 2: e.type_length = r.read_i32(t); break;
            case 3: e.repetition = static_cast<Repetition>(r.read_i32(t)); break;
            case 4: e.name = r.read_string(t); break;
            case 5: e.num_children = r.read_i32(t); break;
            case 6: e.converted_type = r.read_i32(t); break;
            case 10: read_logical_type(r, t, e); break;
            default: r.skip(t);
        }
    });
    if (const auto c = e.converted_type) {
        if (*c == kUtf8 || *c == kEnum || *c == kJson) e.logical_string = true;
        if (*c == kDecimal) e.logical_decimal = true;
        if (*c >= kUint8 && *c <= kUint64) e.logical_unsigned = true;
    }
    return e;
}

ColumnMetaData read_column_meta(CompactReader& r) {
    ColumnMetaData m;
    r.read_struct([&](std::int16_t id, Type t) {
        switch (id) {
            case 1: m.type = static_cast<PhysicalType>(r.read_i32(t)); break;
            case 3: {
                const auto h = r.read_list_header(t);
                for (std::size_t i = 0; i < h.size; ++i)
                    m.path_in_schema.push_back(r.read_string(h.elem_type));
                break;
            }
            case 4: m.codec = static_cast<Codec>(r.read_i32(t)); break;
            case 5: m.num_values = r.read_i64(t); break;
            case 7: m.total_compressed_size = r.read_i64(t); break;
            case 9: m.data_page_offset = r.read_i64(t); break;
            case 11: m.dictionary_page_offset = r.read_i64(t); break;
            default: r.skip(t);
        }
    });
    return m;
}

ColumnChunk read_column_chunk(CompactReader& r) {
    ColumnChunk c;
    r.read_struct([&](std::int16_t id, Type t) {
        switch (id) {
            case 1: c.file_path = r.read_string(t); break;
            case 3:
                if (t != Type::kStruct) r.fail("ColumnChunk.meta_data is not a struct");
                c.meta = read_column_meta(r);
                c.has_meta_data = true;
                break;
            case 8:  // crypto_metadata
            case 9:  // encrypted_column_metadata
                c.encrypted = true;
                r.skip(t);
                break;
            default: r.skip(t);
        }
    });
    return c;
}

RowGroup read_row_group(CompactReader& r) {
    RowGroup g;
    r.read_struct([&](std::int16_t id, Type t) {
        switch (id) {
            case 1: {
                const auto h = r.read_list_header(t);
                if (h.elem_type != Type::kStruct) r.fail("RowGroup.columns is not a list of structs");
                g.columns.reserve(h.size);
                for (std::size_t i = 0; i < h.size; ++i) g.columns.push_back(read_column_chunk(r));
                break;
            }
            case 3: g.num_rows = r.read_i64(t); break;
            default: r.skip(t);
        }
    });
    return g;
}

std::pair<std::string, std::string> read_key_value(CompactReader& r) {
    std::pair<std::string, std::string> kv;
    r.read_struct([&](std::int16_t id, Type t) {
        if (id == 1) {
            kv.first = r.read_string(t);
        } else if (id == 2) {
            kv.second = r.read_string(t);
        } else {
            r.skip(t);
        }
    });
    return kv;
}

// Reads a list<struct> field with a per-element reader.
template <typename T, typename F>
void read_struct_list(CompactReader& r, Type t, const char* what, std::vector<T>& out, F read_one) {
    const auto h = r.read_list_header(t);
    if (h.elem_type != Type::kStruct) r.fail(str(what, " is not a list of structs"));
    out.reserve(h.size);
    for (std::size_t i = 0; i < h.size; ++i) out.push_back(read_one(r));
}

}  // namespace

FileMetaData parse_file_metadata(const std::uint8_t* data, std::size_t size, const std::string& context) {
    CompactReader r(data, size, context);
    FileMetaData f;
    r.read_struct([&](std::int16_t id, Type t) {
        switch (id) {
            case 1: f.version = r.read_i32(t); break;
            case 2: read_struct_list(r, t, "FileMetaData.schema", f.schema, read_schema_element); break;
            case 3: f.num_rows = r.read_i64(t); break;
            case 4: read_struct_list(r, t, "FileMetaData.row_groups", f.row_groups, read_row_group); break;
            case 5:
                read_struct_list(r, t, "FileMetaData.key_value_metadata", f.key_value_metadata,
                                 read_key_value);
                break;
            case 6: f.created_by = r.read_string(t); break;
            case 8:
                f.encrypted = true;
                r.skip(t);
                break;
            default: r.skip(t);
        }
    });
    return f;
}

namespace {

DataPageHeader read_data_page_header(CompactReader& r) {
    DataPageHeader h;
    r.read_struct([&](std::int16_t id, Type t) {
        switch (id) {
            case 1: h.num_values = r.read_i32(t); break;
            case 2: h.encoding = static_cast<Encoding>(r.read_i32(t)); break;
            case 3: h.definition_level_encoding = static_cast<Encoding>(r.read_i32(t)); break;
            case 4: h.repetition_level_encoding = static_cast<Encoding>(r.read_i32(t)); break;
            default: r.skip(t);
        }
    });
    return h;
}

DictionaryPageHeader read_dictionary_page_header(CompactReader& r) {
    DictionaryPageHeader h;
    r.read_struct([&](std::int16_t id, Type t) {
        switch (id) {
            case 1: h.num_values = r.read_i32(t); break;
            case 2: h.encoding = static_cast<Encoding>(r.read_i32(t)); break;
            default: r.skip(t);
        }
    });
    return h;
}

DataPageHeaderV2 read_data_page_header_v2(CompactReader& r) {
    DataPageHeaderV2 h;
    r.read_struct([&](std::int16_t id, Type t) {
        switch (id) {
            case 1: h.num_values = r.read_i32(t); break;
            case 2: h.num_nulls = r.read_i32(t); break;
            case 3: h.num_rows = r.read_i32(t); break;
            case 4: h.encoding = static_cast<Encoding>(r.read_i32(t)); break;
            case 5: h.definition_levels_byte_length = r.read_i32(t); break;
            case 6: h.repetition_levels_byte_length = r.read_i32(t); break;
            case 7: h.is_compressed = r.read_bool(t); break;
            default: r.skip(t);
        }
    });
    return h;
}

}  // namespace

PageHeader parse_page_header(const std::uint8_t* data, std::size_t size, const std::string& context,
                             std::size_t* consumed) {
    CompactReader r(data, size, context);
    PageHeader p;
    auto need_struct = [&](Type t, const char* what) {
        if (t != Type::kStruct) r.fail(str("PageHeader.", what, " is not a struct"));
    };
    r.read_struct([&](std::int16_t id, Type t) {
        switch (id) {
            case 1: p.type = static_cast<PageType>(r.read_i32(t)); break;
            case 2: p.uncompressed_page_size = r.read_i32(t); break;
            case 3: p.compressed_page_size = r.read_i32(t); break;
            case 5:
                need_struct(t, "data_page_header");
                p.data_page = read_data_page_header(r);
                break;
            case 7:
                need_struct(t, "dictionary_page_header");
                p.dictionary_page = read_dictionary_page_header(r);
                break;
            case 8:
                need_struct(t, "data_page_header_v2");
                p.data_page_v2 = read_data_page_header_v2(r);
                break;
            default: r.skip(t);
        }
    });
    *consumed = r.position();
    return p;
}

}  // namespace dtune::io::parquet
