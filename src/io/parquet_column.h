// Reads one column chunk of a flat Parquet column into cells: walks its pages (dictionary,
// data v1, data v2), decompresses each, decodes definition levels and values. Invariants: every
// page lies inside [chunk start, chunk end) which the caller has checked lies inside the file;
// the chunk yields exactly `num_values` cells or a DataError names what is wrong.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "io/parquet_meta.h"
#include "io/table.h"

namespace dtune::io::parquet {

struct ChunkSpec {
    PhysicalType type = PhysicalType::kBoolean;
    Codec codec = Codec::kUncompressed;
    bool optional = false;       // max definition level 1 (nullable) or 0 (required)
    bool is_unsigned = false;    // INT32 values zero-extend; INT64 values must be < 2^63
    std::size_t num_values = 0;  // cells this chunk must yield
    std::size_t max_page_bytes = 0;
    std::string context;  // "'file.parquet' column 'caption' row group 3"
};

// Appends the chunk's cells to out. `data` and `size` are the chunk's bytes.
void read_chunk(const std::uint8_t* data, std::size_t size, const ChunkSpec& spec, std::vector<Cell>& out);

}  // namespace dtune::io::parquet
