// Byte-level helpers of the latent and text-embedding caches: content hashing (SHA-256), the
// integrity checksum (CRC-32), and the optional compression wrapper around a cache entry.
//
// Invariants: decompress_cache_bytes() accepts every form compress_cache_bytes() writes (zstd,
// gzip, or the raw bytes) and tells them apart by their magic numbers, so a cache written with
// one `compress_cache` setting stays readable under another. Corrupt compressed data is a
// DataError naming the file, never a crash or a silently short buffer. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace dtune::data {

enum class CacheCompression { kNone, kZstd, kGzip };

const char* to_string(CacheCompression value);

// Lower-case hex SHA-256 of `bytes` (64 characters).
std::string sha256_hex(std::string_view bytes);
// zlib's CRC-32 of `bytes`.
uint32_t crc32_of(std::string_view bytes);

// `raw` wrapped as asked (kNone returns it unchanged).
std::string compress_cache_bytes(std::string_view raw, CacheCompression compression);
// Undoes either wrapper (detected by magic); anything else is returned as is. `file` names the
// entry in errors.
std::string decompress_cache_bytes(std::string_view stored, const std::string& file);
// Which wrapper `stored` carries.
CacheCompression detect_compression(std::string_view stored);

}  // namespace dtune::data
