// Page decompression for the codecs pyarrow and pandas write: uncompressed, snappy, gzip, zstd.
// Invariant: the output is exactly `uncompressed_size` bytes or a DataError is thrown; corrupt
// input never writes past the output buffer (each library is called with the buffer's bound).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "io/parquet_meta.h"

namespace dtune::io::parquet {

// Decompresses src into a new buffer of uncompressed_size bytes. context names the file and
// column for messages.
std::vector<std::uint8_t> decompress(Codec codec, const std::uint8_t* src, std::size_t src_size,
                                     std::size_t uncompressed_size, const std::string& context);

}  // namespace dtune::io::parquet
