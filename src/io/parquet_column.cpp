// Page walking for one column chunk. Layout reminders (parquet-format):
// - v1 data page body (all compressed): [def levels: u32 length + RLE hybrid] [values]
// - v2 data page: [def levels, uncompressed, def_len bytes] [values, compressed if is_compressed]
// - dictionary page: PLAIN values; data pages then hold a bit-width byte + RLE hybrid indices.
#include "io/parquet_column.h"

#include <algorithm>
#include <optional>

#include "core/error.h"
#include "io/parquet_codec.h"
#include "io/parquet_decode.h"

namespace dtune::io::parquet {

namespace {

[[noreturn]] void corrupt(const ChunkSpec& spec, const std::string& what) {
    throw DataError(str(spec.context, ": ", what, "; the file is damaged or truncated, re-export it"));
}

[[noreturn]] void unsupported(const ChunkSpec& spec, const std::string& what) {
    throw DataError(str(spec.context, ": ", what,
                        " is not supported; rewrite the file with pyarrow defaults "
                        "(pyarrow.parquet.write_table(table, path)) or convert it to JSON lines"));
}

// Unsigned integer columns: the bits were read as signed; reinterpret them.
void apply_unsigned(const ChunkSpec& spec, std::vector<Value>& values) {
    if (!spec.is_unsigned) return;
    for (Value& v : values) {
        auto* i = std::get_if<std::int64_t>(&v);
        if (i == nullptr) continue;
        if (spec.type == PhysicalType::kInt32) {
            *i = static_cast<std::uint32_t>(static_cast<std::int32_t>(*i));
        } else if (*i < 0) {
            throw DataError(str(spec.context, ": unsigned value ", static_cast<std::uint64_t>(*i),
                                " does not fit a signed 64-bit integer; store it as int64 or float64"));
        }
    }
}

std::vector<std::uint8_t> inflate_page(const ChunkSpec& spec, const std::uint8_t* src, std::size_t src_size,
                                       std::int64_t uncompressed, bool compressed) {
    if (uncompressed < 0 || static_cast<std::uint64_t>(uncompressed) > spec.max_page_bytes) {
        corrupt(spec,
                str("page claims ", uncompressed, " uncompressed bytes (limit ", spec.max_page_bytes, ")"));
    }
    return decompress(compressed ? spec.codec : Codec::kUncompressed, src, src_size,
                      static_cast<std::size_t>(uncompressed), spec.context);
}

// Decodes the non-null values of a data page into `values`.
void decode_values(const ChunkSpec& spec, Encoding encoding, ByteView in, std::size_t n,
                   const std::optional<std::vector<Value>>& dictionary, std::vector<Value>& values) {
    values.clear();
    switch (encoding) {
        case Encoding::kPlain:
            values.reserve(n);  // n <= page values, already bounded by the levels or the bytes
            decode_plain(in, spec.type, n, values, spec.context);
            apply_unsigned(spec, values);
            return;
        case Encoding::kPlainDictionary:
        case Encoding::kRleDictionary: {
            if (!dictionary) corrupt(spec, "dictionary-encoded page without a dictionary page");
            if (n == 0) return;
            if (in.size < 1) corrupt(spec, "dictionary index page is empty");
            const int bit_width = in.data[0];
            std::vector<std::uint32_t> indices;
            decode_rle_hybrid({in.data + 1, in.size - 1}, bit_width, n, indices, spec.context);
            values.reserve(n);
            for (const std::uint32_t i : indices) {
                if (i >= dictionary->size()) {
                    corrupt(spec,
                            str("dictionary index ", i, " out of range (", dictionary->size(), " entries)"));
                }
                values.push_back((*dictionary)[i]);
            }
            return;
        }
        case Encoding::kRle: {
            if (spec.type != PhysicalType::kBoolean)
                unsupported(spec, str("RLE encoding of ", to_string(spec.type)));
            const ByteView run = take_length_prefixed(in, spec.context, "RLE booleans");
            std::vector<std::uint32_t> bits;
            decode_rle_hybrid(run, 1, n, bits, spec.context);
            values.reserve(n);
            for (const std::uint32_t b : bits) values.emplace_back(b != 0);
            return;
        }
        default: unsupported(spec, str("value encoding ", to_string(encoding)));
    }
}

// Turns levels + non-null values into cells appended to out.
void emit_cells(const ChunkSpec& spec, const std::vector<std::uint32_t>& levels, std::size_t num_values,
                std::vector<Value>& values, std::vector<Cell>& out) {
    if (!spec.optional) {
        for (auto& v : values) out.emplace_back(std::move(v));
        return;
    }
    std::size_t next = 0;
    for (std::size_t i = 0; i < num_values; ++i) {
        if (levels[i] == 1) {
            out.emplace_back(std::move(values[next++]));
        } else {
            out.emplace_back(std::nullopt);
        }
    }
}

// Definition levels: counts the non-null values and checks every level is 0 or 1.
std::size_t count_present(const ChunkSpec& spec, const std::vector<std::uint32_t>& levels) {
    std::size_t present = 0;
    for (const std::uint32_t level : levels) {
        if (level > 1)
            corrupt(spec, str("definition level ", level, " above the maximum 1 of a flat column"));
        present += level;
    }
    return present;
}

struct PageState {
    std::optional<std::vector<Value>> dictionary;
    std::vector<std::uint32_t> levels;
    std::vector<Value> values;
};

void read_dictionary_page(const ChunkSpec& spec, const PageHeader& h, const std::uint8_t* body,
                          PageState& st) {
    if (!h.dictionary_page) corrupt(spec, "dictionary page without its header");
    if (st.dictionary) unsupported(spec, "a second dictionary page in one column chunk");
    const auto& d = *h.dictionary_page;
    if (d.encoding != Encoding::kPlain && d.encoding != Encoding::kPlainDictionary) {
        unsupported(spec, str("dictionary page encoding ", to_string(d.encoding)));
    }
    const auto bytes = inflate_page(spec, body, static_cast<std::size_t>(h.compressed_page_size),
                                    h.uncompressed_page_size, true);
    if (d.num_values < 0 ||
        static_cast<std::size_t>(d.num_values) > bytes.size() * 8 / min_plain_bits(spec.type)) {
        corrupt(spec, str("dictionary page claims ", d.num_values, " values in ", bytes.size(), " bytes"));
    }
    ByteView in{bytes.data(), bytes.size()};
    st.dictionary.emplace();
    st.dictionary->reserve(static_cast<std::size_t>(d.num_values));
    decode_plain(in, spec.type, static_cast<std::size_t>(d.num_values), *st.dictionary, spec.context);
    apply_unsigned(spec, *st.dictionary);
}

// Reads one data page (v1 or v2) and appends its cells; returns the number of cells.
std::size_t read_data_page(const ChunkSpec& spec, const PageHeader& h, const std::uint8_t* body,
                           std::size_t remaining, PageState& st, std::vector<Cell>& out) {
    const bool v2 = h.type == PageType::kDataPageV2;
    if (v2 ? !h.data_page_v2 : !h.data_page) corrupt(spec, "data page without its header");
    const std::int32_t claimed = v2 ? h.data_page_v2->num_values : h.data_page->num_values;
    if (claimed < 0 || static_cast<std::size_t>(claimed) > remaining) {
        corrupt(spec,
                str("data page claims ", claimed, " values but only ", remaining, " remain in the chunk"));
    }
    const auto n = static_cast<std::size_t>(claimed);
    const auto compressed = static_cast<std::size_t>(h.compressed_page_size);
    std::vector<std::uint8_t> bytes;
    ByteView levels_in;
    ByteView values_in;
    Encoding encoding;
    if (!v2) {
        const auto& d = *h.data_page;
        encoding = d.encoding;
        bytes = inflate_page(spec, body, compressed, h.uncompressed_page_size, true);
        values_in = {bytes.data(), bytes.size()};
        if (spec.optional) {
            if (d.definition_level_encoding != Encoding::kRle) {
                unsupported(spec, str("definition level encoding ", to_string(d.definition_level_encoding)));
            }
            levels_in = take_length_prefixed(values_in, spec.context, "definition levels");
        }
    } else {
        const auto& d = *h.data_page_v2;
        encoding = d.encoding;
        if (d.repetition_levels_byte_length != 0) unsupported(spec, "repetition levels (a repeated column)");
        if (d.definition_levels_byte_length < 0 ||
            static_cast<std::size_t>(d.definition_levels_byte_length) > compressed ||
            d.definition_levels_byte_length > h.uncompressed_page_size) {
            corrupt(spec, str("definition levels of ", d.definition_levels_byte_length,
                              " bytes in a page of ", compressed, " bytes"));
        }
        const auto def_len = static_cast<std::size_t>(d.definition_levels_byte_length);
        if (!spec.optional && def_len != 0) corrupt(spec, "definition levels in a required column");
        levels_in = {body, def_len};
        bytes = inflate_page(spec, body + def_len, compressed - def_len,
                             h.uncompressed_page_size - d.definition_levels_byte_length, d.is_compressed);
        values_in = {bytes.data(), bytes.size()};
    }
    std::size_t present = n;
    if (spec.optional) {
        decode_rle_hybrid(levels_in, 1, n, st.levels, spec.context);
        present = count_present(spec, st.levels);
    }
    decode_values(spec, encoding, values_in, present, st.dictionary, st.values);
    emit_cells(spec, st.levels, n, st.values, out);
    return n;
}

}  // namespace

void read_chunk(const std::uint8_t* data, std::size_t size, const ChunkSpec& spec, std::vector<Cell>& out) {
    PageState st;
    std::size_t pos = 0;
    std::size_t done = 0;
    while (done < spec.num_values) {
        if (pos >= size) {
            corrupt(spec, str("column chunk ends after ", done, " of its ", spec.num_values, " values"));
        }
        std::size_t header_size = 0;
        const PageHeader h = parse_page_header(
            data + pos, size - pos, str(spec.context, " page header at chunk byte ", pos), &header_size);
        pos += header_size;
        if (h.compressed_page_size < 0 || static_cast<std::size_t>(h.compressed_page_size) > size - pos) {
            corrupt(spec, str("page of ", h.compressed_page_size,
                              " bytes runs past the end of the column chunk (", size - pos, " bytes left)"));
        }
        const std::uint8_t* body = data + pos;
        pos += static_cast<std::size_t>(h.compressed_page_size);
        switch (h.type) {
            case PageType::kDictionaryPage: read_dictionary_page(spec, h, body, st); break;
            case PageType::kDataPage:
            case PageType::kDataPageV2:
                done += read_data_page(spec, h, body, spec.num_values - done, st, out);
                break;
            case PageType::kIndexPage: break;  // not needed to read values
            default: corrupt(spec, str("unknown page type ", static_cast<int>(h.type)));
        }
    }
}

}  // namespace dtune::io::parquet
