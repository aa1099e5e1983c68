// Header parsers for JPEG (markers up to the SOF), PNG (IHDR, eXIf before IDAT) and WebP
// (VP8, VP8L, VP8X and its EXIF chunk), plus a minimal TIFF walk for the orientation tag.
#include "io/image_info.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/fs.h"

namespace dtune::io {

namespace {

uint16_t be16(const uint8_t* p) {
    return static_cast<uint16_t>(p[0] << 8 | p[1]);
}
uint32_t be32(const uint8_t* p) {
    return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3];
}
uint16_t le16(const uint8_t* p) {
    return static_cast<uint16_t>(p[0] | p[1] << 8);
}
uint32_t le32(const uint8_t* p) {
    return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}
uint32_t le24(const uint8_t* p) {
    return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16;
}

bool is_sof(uint8_t m) {
    // SOF0..SOF15 except DHT (C4), JPG (C8) and DAC (CC).
    return m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC;
}

ParseStatus parse_jpeg(const uint8_t* d, size_t n, ImageInfo& out, std::string& error) {
    size_t pos = 2;  // after SOI
    while (true) {
        if (pos + 4 > n) return ParseStatus::kNeedMore;
        if (d[pos] != 0xFF) {
            error = "JPEG marker expected at byte " + std::to_string(pos);
            return ParseStatus::kInvalid;
        }
        uint8_t marker = d[pos + 1];
        if (marker == 0xFF) {  // fill byte
            ++pos;
            continue;
        }
        if (marker == 0xD8 || marker == 0x01 || (marker >= 0xD0 && marker <= 0xD7)) {  // no payload
            pos += 2;
            continue;
        }
        if (marker == 0xD9 || marker == 0xDA) {
            error = "JPEG has no frame header (SOF) before the image data";
            return ParseStatus::kInvalid;
        }
        const size_t length = be16(d + pos + 2);
        if (length < 2) {
            error = "JPEG segment with length < 2";
            return ParseStatus::kInvalid;
        }
        const uint8_t* payload = d + pos + 4;
        if (is_sof(marker)) {
            if (pos + 2 + length > n || length < 7)
                return pos + 2 + length > n ? ParseStatus::kNeedMore : ParseStatus::kInvalid;
            out.height = be16(payload + 1);
            out.width = be16(payload + 3);
            if (out.width == 0 || out.height == 0) {
                error = "JPEG frame header has a zero dimension";
                return ParseStatus::kInvalid;
            }
            return ParseStatus::kOk;
        }
        if (marker == 0xE1 && out.orientation == 1 && length >= 8) {
            if (pos + 2 + length > n) return ParseStatus::kNeedMore;
            if (std::memcmp(payload, "Exif\0\0", 6) == 0)
                out.orientation = exif_orientation(payload + 6, length - 8);
        }
        pos += 2 + length;
    }
}

ParseStatus parse_png(const uint8_t* d, size_t n, ImageInfo& out, std::string& error) {
    if (n < 33) return ParseStatus::kNeedMore;
    if (std::memcmp(d + 12, "IHDR", 4) != 0) {
        error = "PNG does not start with an IHDR chunk";
        return ParseStatus::kInvalid;
    }
    out.width = static_cast<int>(be32(d + 16));
    out.height = static_cast<int>(be32(d + 20));
    if (out.width <= 0 || out.height <= 0) {
        error = "PNG IHDR has an invalid dimension";
        return ParseStatus::kInvalid;
    }
    // An eXIf chunk, when present, comes before the first IDAT.
    size_t pos = 8;
    while (pos + 12 <= n) {
        const size_t len = be32(d + pos);
        const uint8_t* type = d + pos + 4;
        if (std::memcmp(type, "IDAT", 4) == 0 || std::memcmp(type, "IEND", 4) == 0) return ParseStatus::kOk;
        if (std::memcmp(type, "eXIf", 4) == 0) {
            if (pos + 8 + len > n) return ParseStatus::kNeedMore;
            out.orientation = exif_orientation(d + pos + 8, len);
            return ParseStatus::kOk;
        }
        pos += 12 + len;
    }
    return ParseStatus::kOk;  // header known; a missing orientation is not worth a full read
}

ParseStatus parse_webp(const uint8_t* d, size_t n, bool whole, ImageInfo& out, std::string& error) {
    if (n < 30) return ParseStatus::kNeedMore;
    const uint8_t* chunk = d + 12;
    const uint8_t* data = chunk + 8;
    if (std::memcmp(chunk, "VP8 ", 4) == 0) {
        if (data[3] != 0x9D || data[4] != 0x01 || data[5] != 0x2A) {
            error = "WebP VP8 frame has no start code";
            return ParseStatus::kInvalid;
        }
        out.width = le16(data + 6) & 0x3FFF;
        out.height = le16(data + 8) & 0x3FFF;
    } else if (std::memcmp(chunk, "VP8L", 4) == 0) {
        if (data[0] != 0x2F) {
            error = "WebP VP8L stream has no signature";
            return ParseStatus::kInvalid;
        }
        const uint32_t bits = le32(data + 1);
        out.width = static_cast<int>((bits & 0x3FFF) + 1);
        out.height = static_cast<int>(((bits >> 14) & 0x3FFF) + 1);
    } else if (std::memcmp(chunk, "VP8X", 4) == 0) {
        const uint8_t flags = data[0];
        out.width = static_cast<int>(le24(data + 4) + 1);
        out.height = static_cast<int>(le24(data + 7) + 1);
        if (flags & 0x08) {  // EXIF chunk present, usually after the image data
            size_t pos = 12;
            while (pos + 8 <= n) {
                const size_t len = le32(d + pos + 4);
                if (std::memcmp(d + pos, "EXIF", 4) == 0) {
                    if (pos + 8 + len > n) return ParseStatus::kNeedMore;
                    const uint8_t* exif = d + pos + 8;
                    size_t skip = (len >= 6 && std::memcmp(exif, "Exif\0\0", 6) == 0) ? 6 : 0;
                    out.orientation = exif_orientation(exif + skip, len - skip);
                    break;
                }
                pos += 8 + len + (len & 1);
            }
            if (pos + 8 > n && !whole) return ParseStatus::kNeedMore;
        }
    } else {
        error = "unknown WebP chunk '" + std::string(reinterpret_cast<const char*>(chunk), 4) + "'";
        return ParseStatus::kInvalid;
    }
    if (out.width <= 0 || out.height <= 0) {
        error = "WebP header has a zero dimension";
        return ParseStatus::kInvalid;
    }
    return ParseStatus::kOk;
}

}  // namespace

const char* to_string(ImageFormat f) {
    switch (f) {
        case ImageFormat::kJpeg: return "jpeg";
        case ImageFormat::kPng: return "png";
        case ImageFormat::kWebp: return "webp";
        default: return "unknown";
    }
}

int exif_orientation(const uint8_t* t, size_t n) {
    if (n < 8) return 1;
    const bool little = t[0] == 'I' && t[1] == 'I';
    if (!little && !(t[0] == 'M' && t[1] == 'M')) return 1;
    auto u16 = [&](size_t at) { return little ? le16(t + at) : be16(t + at); };
    auto u32 = [&](size_t at) { return little ? le32(t + at) : be32(t + at); };
    if (u16(2) != 42) return 1;
    const size_t ifd = u32(4);
    if (ifd + 2 > n) return 1;
    const size_t count = u16(ifd);
    for (size_t i = 0; i < count; ++i) {
        const size_t e = ifd + 2 + i * 12;
        if (e + 12 > n) return 1;
        if (u16(e) == 0x0112) {  // Orientation, SHORT
            const int v = u16(e + 8);
            return v >= 1 && v <= 8 ? v : 1;
        }
    }
    return 1;
}

ParseStatus parse_image_info(const uint8_t* d, size_t n, bool whole, ImageInfo& out, std::string& error) {
    out = ImageInfo{};
    auto finish = [&](ParseStatus s) {
        if (s == ParseStatus::kNeedMore && whole) {
            error = str("truncated ", to_string(out.format), " header");
            return ParseStatus::kInvalid;
        }
        return s;
    };
    if (n >= 3 && d[0] == 0xFF && d[1] == 0xD8 && d[2] == 0xFF) {
        out.format = ImageFormat::kJpeg;
        return finish(parse_jpeg(d, n, out, error));
    }
    if (n >= 8 && std::memcmp(d, "\x89PNG\r\n\x1a\n", 8) == 0) {
        out.format = ImageFormat::kPng;
        return finish(parse_png(d, n, out, error));
    }
    if (n >= 12 && std::memcmp(d, "RIFF", 4) == 0 && std::memcmp(d + 8, "WEBP", 4) == 0) {
        out.format = ImageFormat::kWebp;
        return finish(parse_webp(d, n, whole, out, error));
    }
    if (n < 12 && !whole) return ParseStatus::kNeedMore;
    error = "not a JPEG, PNG or WebP file";
    return ParseStatus::kInvalid;
}

ImageInfo read_image_info(const std::filesystem::path& path) {
    constexpr size_t kHead = 64 * 1024;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw DataError(str(path.string(), ": cannot open (", std::strerror(errno), ")"));
    // One buffer per thread: scans call this tens of thousands of times, and zeroing 64 KiB per
    // call costs as much as the read of a small file.
    thread_local std::vector<uint8_t> buf(kHead);
    ssize_t got = ::pread(fd, buf.data(), kHead, 0);
    ::close(fd);
    if (got < 0) throw DataError(str(path.string(), ": cannot read (", std::strerror(errno), ")"));
    ImageInfo info;
    std::string error;
    const bool whole = static_cast<size_t>(got) < kHead;
    ParseStatus s = parse_image_info(buf.data(), static_cast<size_t>(got), whole, info, error);
    if (s == ParseStatus::kNeedMore) {  // a large APP segment or a trailing EXIF chunk
        const std::string all = fs::read_file(path);
        s = parse_image_info(reinterpret_cast<const uint8_t*>(all.data()), all.size(), true, info, error);
    }
    if (s != ParseStatus::kOk)
        throw DataError(str(path.string(), ": ", error, "; the file is skipped (re-export or delete it)"));
    return info;
}

bool has_image_extension(const std::filesystem::path& path) {
    std::string ext = path.extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
    return ext == ".jpg" || ext == ".jpeg" || ext == ".png" || ext == ".webp";
}

}  // namespace dtune::io
