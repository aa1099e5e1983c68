// Codec glue over zlib, libzstd and snappy's C API.
#include "io/parquet_codec.h"

#include <snappy-c.h>
#include <zlib.h>
#include <zstd.h>

#include <climits>
#include <cstring>

#include "core/error.h"

namespace dtune::io::parquet {

namespace {

[[noreturn]] void corrupt(const std::string& context, Codec codec, const std::string& what) {
    throw DataError(str(context, ": ", to_string(codec), " page does not decompress (", what,
                        "); the file is corrupt or truncated, re-export it"));
}

void inflate_gzip(const std::uint8_t* src, std::size_t src_size, std::vector<std::uint8_t>& out,
                  const std::string& context) {
    DTUNE_CHECK_AS(DataError, src_size <= UINT_MAX && out.size() <= UINT_MAX, context,
                   ": gzip page larger than 4 GiB is not supported");
    z_stream z{};
    // 15 window bits + 32: accept both gzip and zlib headers, as Parquet writers differ.
    if (inflateInit2(&z, 15 + 32) != Z_OK) corrupt(context, Codec::kGzip, "inflateInit2 failed");
    z.next_in = const_cast<Bytef*>(src);
    z.avail_in = static_cast<uInt>(src_size);
    Bytef empty = 0;  // zlib rejects a null output pointer even for zero bytes
    z.next_out = out.empty() ? &empty : out.data();
    z.avail_out = static_cast<uInt>(out.size());
    int rc = Z_OK;
    // Several gzip members may follow each other; stop when the output is full.
    while (true) {
        rc = inflate(&z, Z_FINISH);
        if (rc == Z_STREAM_END && z.avail_in > 0 && z.avail_out > 0) {
            if (inflateReset(&z) != Z_OK) break;
            continue;
        }
        break;
    }
    const std::size_t produced = out.size() - z.avail_out;
    inflateEnd(&z);
    if (rc != Z_STREAM_END) corrupt(context, Codec::kGzip, str("zlib error ", rc));
    if (produced != out.size()) {
        corrupt(context, Codec::kGzip,
                str(produced, " bytes instead of the ", out.size(), " the header states"));
    }
}

}  // namespace

std::vector<std::uint8_t> decompress(Codec codec, const std::uint8_t* src, std::size_t src_size,
                                     std::size_t uncompressed_size, const std::string& context) {
    std::vector<std::uint8_t> out;
    if (codec == Codec::kUncompressed) {
        if (src_size != uncompressed_size) {
            corrupt(context, codec,
                    str("compressed size ", src_size, " != uncompressed size ", uncompressed_size));
        }
        out.assign(src, src + src_size);
        return out;
    }
    switch (codec) {
        case Codec::kSnappy: {
            std::size_t length = 0;
            if (snappy_uncompressed_length(reinterpret_cast<const char*>(src), src_size, &length) !=
                SNAPPY_OK) {
                corrupt(context, codec, "bad length preamble");
            }
            if (length != uncompressed_size) {
                corrupt(context, codec,
                        str(length, " bytes instead of the ", uncompressed_size, " the header states"));
            }
            out.resize(uncompressed_size);
            std::size_t out_len = out.size();
            if (snappy_uncompress(reinterpret_cast<const char*>(src), src_size,
                                  reinterpret_cast<char*>(out.data()), &out_len) != SNAPPY_OK ||
                out_len != uncompressed_size) {
                corrupt(context, codec, "invalid snappy stream");
            }
            return out;
        }
        case Codec::kGzip:
            // Deflate expands at most ~1032:1; a larger claim is corrupt and must not allocate.
            if (uncompressed_size / 1032 > src_size + 1) {
                corrupt(context, codec, str(src_size, " bytes cannot inflate to ", uncompressed_size));
            }
            out.resize(uncompressed_size);
            inflate_gzip(src, src_size, out, context);
            return out;
        case Codec::kZstd: {
            const unsigned long long declared = ZSTD_getFrameContentSize(src, src_size);
            if (declared == ZSTD_CONTENTSIZE_ERROR) corrupt(context, codec, "bad frame header");
            if (declared != ZSTD_CONTENTSIZE_UNKNOWN && declared != uncompressed_size) {
                corrupt(context, codec,
                        str(declared, " bytes instead of the ", uncompressed_size, " the header states"));
            }
            out.resize(uncompressed_size);
            const std::size_t n = ZSTD_decompress(out.data(), out.size(), src, src_size);
            if (ZSTD_isError(n)) corrupt(context, codec, ZSTD_getErrorName(n));
            if (n != uncompressed_size) {
                corrupt(context, codec,
                        str(n, " bytes instead of the ", uncompressed_size, " the header states"));
            }
            return out;
        }
        default: break;
    }
    throw DataError(
        str(context, ": compression codec ", to_string(codec),
            " is not supported (supported: UNCOMPRESSED, SNAPPY, GZIP, ZSTD); rewrite the file with "
            "one of them, e.g. pyarrow.parquet.write_table(table, path, compression='zstd')"));
}

}  // namespace dtune::io::parquet
