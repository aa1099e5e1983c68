// SHA-256 (FIPS 180-4), CRC-32 through zlib, zstd and gzip wrappers for cache entries.
#include "data/cache_codec.h"

#include <zlib.h>
#include <zstd.h>

#include <array>
#include <cstring>

#include "core/error.h"

namespace dtune::data {
namespace {

constexpr std::array<uint32_t, 64> kSha256K = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

uint32_t rotr(uint32_t x, int n) {
    return (x >> n) | (x << (32 - n));
}

void sha256_block(std::array<uint32_t, 8>& h, const uint8_t* block) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i)
        w[i] = (uint32_t(block[4 * i]) << 24) | (uint32_t(block[4 * i + 1]) << 16) |
               (uint32_t(block[4 * i + 2]) << 8) | uint32_t(block[4 * i + 3]);
    for (int i = 16; i < 64; ++i) {
        const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
        const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int i = 0; i < 64; ++i) {
        const uint32_t t1 =
            k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kSha256K[i] + w[i];
        const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
}

bool has_magic(std::string_view s, std::initializer_list<uint8_t> magic) {
    if (s.size() < magic.size()) return false;
    size_t i = 0;
    for (uint8_t m : magic)
        if (static_cast<uint8_t>(s[i++]) != m) return false;
    return true;
}

std::string gzip(std::string_view raw) {
    z_stream z{};
    DTUNE_CHECK(deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) == Z_OK,
                "deflateInit2 failed");
    std::string out(deflateBound(&z, raw.size()) + 32, '\0');
    z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(raw.data()));
    z.avail_in = static_cast<uInt>(raw.size());
    z.next_out = reinterpret_cast<Bytef*>(out.data());
    z.avail_out = static_cast<uInt>(out.size());
    const int rc = deflate(&z, Z_FINISH);
    out.resize(z.total_out);
    deflateEnd(&z);
    DTUNE_CHECK(rc == Z_STREAM_END, "gzip compression failed (", rc, ")");
    return out;
}

std::string gunzip(std::string_view stored, const std::string& file) {
    z_stream z{};
    DTUNE_CHECK(inflateInit2(&z, 15 + 16) == Z_OK, "inflateInit2 failed");
    z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(stored.data()));
    z.avail_in = static_cast<uInt>(stored.size());
    std::string out;
    char buf[1 << 16];
    int rc = Z_OK;
    while (rc == Z_OK) {
        z.next_out = reinterpret_cast<Bytef*>(buf);
        z.avail_out = sizeof buf;
        rc = inflate(&z, Z_NO_FLUSH);
        out.append(buf, sizeof buf - z.avail_out);
        if (rc == Z_BUF_ERROR && z.avail_in == 0) break;  // input ended early
    }
    inflateEnd(&z);
    if (rc != Z_STREAM_END)
        throw DataError(str(file, ": gzip data is truncated or corrupt (zlib code ", rc,
                            "); delete the entry and it will be rebuilt"));
    return out;
}

std::string unzstd(std::string_view stored, const std::string& file) {
    const unsigned long long size = ZSTD_getFrameContentSize(stored.data(), stored.size());
    if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN || size > (1ull << 34))
        throw DataError(str(file, ": zstd frame header is corrupt; delete the entry and it will be rebuilt"));
    std::string out(size, '\0');
    const size_t rc = ZSTD_decompress(out.data(), out.size(), stored.data(), stored.size());
    if (ZSTD_isError(rc) || rc != size)
        throw DataError(str(file, ": zstd data is truncated or corrupt (",
                            ZSTD_isError(rc) ? ZSTD_getErrorName(rc) : "short output",
                            "); delete the entry and it will be rebuilt"));
    return out;
}

}  // namespace

const char* to_string(CacheCompression value) {
    switch (value) {
        case CacheCompression::kNone: return "none";
        case CacheCompression::kZstd: return "zstd";
        case CacheCompression::kGzip: return "gzip";
    }
    return "?";
}

std::string sha256_hex(std::string_view bytes) {
    std::array<uint32_t, 8> h = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
    size_t n = bytes.size();
    for (; n >= 64; n -= 64, p += 64) sha256_block(h, p);
    uint8_t tail[128] = {};
    std::memcpy(tail, p, n);
    tail[n] = 0x80;
    const size_t tail_len = n < 56 ? 64 : 128;
    const uint64_t bits = uint64_t(bytes.size()) * 8;
    for (int i = 0; i < 8; ++i) tail[tail_len - 1 - i] = uint8_t(bits >> (8 * i));
    sha256_block(h, tail);
    if (tail_len == 128) sha256_block(h, tail + 64);
    static const char* kHex = "0123456789abcdef";
    std::string out;
    for (uint32_t v : h)
        for (int s = 28; s >= 0; s -= 4) out += kHex[(v >> s) & 0xf];
    return out;
}

uint32_t crc32_of(std::string_view bytes) {
    uLong crc = crc32(0L, Z_NULL, 0);
    // zlib takes uInt lengths; feed large buffers in pieces.
    for (size_t off = 0; off < bytes.size();) {
        const size_t len = std::min<size_t>(bytes.size() - off, 1u << 30);
        crc = crc32(crc, reinterpret_cast<const Bytef*>(bytes.data() + off), static_cast<uInt>(len));
        off += len;
    }
    return static_cast<uint32_t>(crc);
}

CacheCompression detect_compression(std::string_view stored) {
    if (has_magic(stored, {0x28, 0xb5, 0x2f, 0xfd})) return CacheCompression::kZstd;
    if (has_magic(stored, {0x1f, 0x8b})) return CacheCompression::kGzip;
    return CacheCompression::kNone;
}

std::string compress_cache_bytes(std::string_view raw, CacheCompression compression) {
    switch (compression) {
        case CacheCompression::kNone: return std::string(raw);
        case CacheCompression::kGzip: return gzip(raw);
        case CacheCompression::kZstd: {
            std::string out(ZSTD_compressBound(raw.size()), '\0');
            const size_t rc = ZSTD_compress(out.data(), out.size(), raw.data(), raw.size(), 3);
            DTUNE_CHECK(!ZSTD_isError(rc), "zstd compression failed: ", ZSTD_getErrorName(rc));
            out.resize(rc);
            return out;
        }
    }
    return std::string(raw);
}

std::string decompress_cache_bytes(std::string_view stored, const std::string& file) {
    switch (detect_compression(stored)) {
        case CacheCompression::kZstd: return unzstd(stored, file);
        case CacheCompression::kGzip: return gunzip(stored, file);
        case CacheCompression::kNone: break;
    }
    return std::string(stored);
}

}  // namespace dtune::data
