// RLE/bit-packed hybrid and PLAIN decoding. Hybrid stream: a varint header; if its low bit is 1
// then (header >> 1) groups of 8 bit-packed values follow (LSB first), else a run of
// (header >> 1) copies of one value stored in ceil(bit_width / 8) little-endian bytes.
#include "io/parquet_decode.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace dtune::io::parquet {

namespace {

[[noreturn]] void corrupt(const std::string& context, const std::string& what) {
    throw DataError(
        str(context, ": corrupt page data (", what, "); the file is damaged or truncated, re-export it"));
}

std::uint64_t read_varint(ByteView& in, const std::string& context) {
    std::uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (in.size == 0) corrupt(context, "RLE header runs past the end of the levels");
        const std::uint8_t b = *in.data;
        ++in.data;
        --in.size;
        v |= static_cast<std::uint64_t>(b & 0x7f) << shift;
        if ((b & 0x80) == 0) return v;
    }
    corrupt(context, "RLE header varint longer than 10 bytes");
}

// Unpacks `count` values of bit_width bits starting at bit 0 of data (which holds enough bytes).
void unpack_bits(const std::uint8_t* data, std::size_t data_size, int bit_width, std::size_t count,
                 std::vector<std::uint32_t>& out) {
    const std::uint64_t mask = bit_width == 32 ? 0xffffffffull : ((1ull << bit_width) - 1);
    for (std::size_t i = 0; i < count; ++i) {
        const std::size_t bit = i * static_cast<std::size_t>(bit_width);
        const std::size_t first = bit / 8;
        // Gather up to 5 bytes (32 bits + 7 bits of offset), never past data_size.
        std::uint64_t window = 0;
        const std::size_t avail = std::min<std::size_t>(5, data_size - first);
        for (std::size_t b = 0; b < avail; ++b)
            window |= static_cast<std::uint64_t>(data[first + b]) << (8 * b);
        out.push_back(static_cast<std::uint32_t>((window >> (bit % 8)) & mask));
    }
}

}  // namespace

void decode_rle_hybrid(ByteView in, int bit_width, std::size_t n, std::vector<std::uint32_t>& out,
                       const std::string& context) {
    out.clear();
    if (bit_width < 0 || bit_width > 32) corrupt(context, str("bit width ", bit_width, " outside 0..32"));
    // Reserve only what the bytes could plausibly hold; huge RLE runs grow the vector as needed.
    out.reserve(std::min<std::size_t>(n, in.size * 8 + 64));
    while (out.size() < n) {
        const std::uint64_t header = read_varint(in, context);
        const std::size_t remaining = n - out.size();
        if (header & 1) {
            const std::uint64_t groups = header >> 1;
            if (groups > (UINT64_MAX >> 4)) corrupt(context, "bit-packed group count overflows");
            const std::uint64_t values = groups * 8;
            const std::size_t take = static_cast<std::size_t>(std::min<std::uint64_t>(values, remaining));
            // Bytes holding the values we take; writers may cut the padding of the last group.
            const std::size_t need = (take * static_cast<std::size_t>(bit_width) + 7) / 8;
            if (need > in.size)
                corrupt(context, str("bit-packed run needs ", need, " bytes, ", in.size, " left"));
            if (take == 0 && values == 0) corrupt(context, "empty bit-packed run");
            unpack_bits(in.data, in.size, bit_width, take, out);
            const std::uint64_t full = groups * static_cast<std::uint64_t>(bit_width);
            const std::size_t skip = static_cast<std::size_t>(std::min<std::uint64_t>(full, in.size));
            in.data += skip;
            in.size -= skip;
        } else {
            const std::uint64_t count = header >> 1;
            if (count == 0) corrupt(context, "RLE run of length 0");
            const std::size_t width = static_cast<std::size_t>((bit_width + 7) / 8);
            if (width > in.size) corrupt(context, "RLE run value runs past the end");
            std::uint32_t value = 0;
            for (std::size_t b = 0; b < width; ++b)
                value |= static_cast<std::uint32_t>(in.data[b]) << (8 * b);
            in.data += width;
            in.size -= width;
            const std::size_t take = static_cast<std::size_t>(std::min<std::uint64_t>(count, remaining));
            out.insert(out.end(), take, value);
        }
    }
}

ByteView take_length_prefixed(ByteView& in, const std::string& context, const char* what) {
    if (in.size < 4) corrupt(context, str(what, " length prefix runs past the end of the page"));
    std::uint32_t length = 0;
    std::memcpy(&length, in.data, 4);
    in.data += 4;
    in.size -= 4;
    if (length > in.size)
        corrupt(context,
                str(what, " of ", length, " bytes runs past the end of the page (", in.size, " left)"));
    ByteView view{in.data, length};
    in.data += length;
    in.size -= length;
    return view;
}

std::size_t min_plain_bits(PhysicalType type) {
    switch (type) {
        case PhysicalType::kBoolean: return 1;
        case PhysicalType::kInt32:
        case PhysicalType::kFloat:
        case PhysicalType::kByteArray: return 32;
        default: return 64;
    }
}

namespace {

template <typename T>
T load(const std::uint8_t* p) {
    T v;
    std::memcpy(&v, p, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
    return v;
}

template <typename Raw, typename Out>
void decode_fixed(ByteView& in, std::size_t n, std::vector<Value>& out, const std::string& context) {
    if (n > in.size / sizeof(Raw)) {
        corrupt(context,
                str(n, " values of ", sizeof(Raw), " bytes need more than the ", in.size, " bytes left"));
    }
    for (std::size_t i = 0; i < n; ++i)
        out.emplace_back(static_cast<Out>(load<Raw>(in.data + i * sizeof(Raw))));
    in.data += n * sizeof(Raw);
    in.size -= n * sizeof(Raw);
}

}  // namespace

void decode_plain(ByteView& in, PhysicalType type, std::size_t n, std::vector<Value>& out,
                  const std::string& context) {
    switch (type) {
        case PhysicalType::kBoolean: {
            const std::size_t bytes = n / 8 + (n % 8 != 0);
            if (bytes > in.size)
                corrupt(context, str(n, " booleans need ", bytes, " bytes, ", in.size, " left"));
            for (std::size_t i = 0; i < n; ++i)
                out.emplace_back(static_cast<bool>((in.data[i / 8] >> (i % 8)) & 1));
            in.data += bytes;
            in.size -= bytes;
            return;
        }
        case PhysicalType::kInt32: return decode_fixed<std::int32_t, std::int64_t>(in, n, out, context);
        case PhysicalType::kInt64: return decode_fixed<std::int64_t, std::int64_t>(in, n, out, context);
        case PhysicalType::kFloat: return decode_fixed<float, double>(in, n, out, context);
        case PhysicalType::kDouble: return decode_fixed<double, double>(in, n, out, context);
        case PhysicalType::kByteArray:
            for (std::size_t i = 0; i < n; ++i) {
                const ByteView s = take_length_prefixed(in, context, "byte array");
                out.emplace_back(std::string(reinterpret_cast<const char*>(s.data), s.size));
            }
            return;
        default: break;
    }
    throw DataError(str(context, ": physical type ", to_string(type),
                        " is not supported (supported: BOOLEAN, INT32, "
                        "INT64, FLOAT, DOUBLE, BYTE_ARRAY); cast the column before writing the file"));
}

}  // namespace dtune::io::parquet
