// Value-level decoders for Parquet pages: the RLE/bit-packed hybrid (definition levels,
// dictionary indices, RLE booleans) and PLAIN values of each supported physical type.
// Invariants: inputs are (pointer, size) views; nothing is read past size; a short or malformed
// stream is a DataError that starts with `context` (file and column).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "io/parquet_meta.h"
#include "io/table.h"

namespace dtune::io::parquet {

// A read-only byte view that is advanced as it is consumed.
struct ByteView {
    const std::uint8_t* data = nullptr;
    std::size_t size = 0;
};

// Decodes exactly n values of bit_width (0..32) bits from the RLE/bit-packed hybrid stream in
// `in` (no length prefix) into out (cleared first).
void decode_rle_hybrid(ByteView in, int bit_width, std::size_t n, std::vector<std::uint32_t>& out,
                       const std::string& context);

// Reads a 4-byte little-endian length prefix and returns the view it covers, advancing `in`
// past both. Used by v1 definition levels and RLE-encoded booleans.
ByteView take_length_prefixed(ByteView& in, const std::string& context, const char* what);

// Decodes n PLAIN values of `type` from the front of `in` into out (appended), advancing `in`.
void decode_plain(ByteView& in, PhysicalType type, std::size_t n, std::vector<Value>& out,
                  const std::string& context);

// Smallest encoded size of one PLAIN value, so callers can bound a claimed count by the bytes.
std::size_t min_plain_bits(PhysicalType type);

}  // namespace dtune::io::parquet
