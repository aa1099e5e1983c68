// Test-file writers over libpng, libjpeg and libwebp (see image_test_files.h).
#include "image_test_files.h"

// jpeglib.h uses size_t and FILE without including their headers.
#include <cstddef>
#include <cstdio>

#include <jpeglib.h>
#include <png.h>
#include <webp/encode.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace dtune::test {

namespace {
void append(png_structp png, png_bytep data, png_size_t n) {
    static_cast<std::string*>(png_get_io_ptr(png))->append(reinterpret_cast<const char*>(data), n);
}
void flush(png_structp) {}
void put_le32(std::string& s, uint32_t v) {
    for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
void put_le24(std::string& s, uint32_t v) {
    for (int i = 0; i < 3; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
}  // namespace

std::string png_bytes(int w, int h, int color_type, int depth, const std::vector<uint16_t>& samples) {
    std::string out;
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
    png_infop info = png_create_info_struct(png);
    png_set_write_fn(png, &out, append, flush);
    png_set_IHDR(png, info, w, h, depth, color_type, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
                 PNG_FILTER_TYPE_DEFAULT);
    png_write_info(png, info);
    const int channels = png_get_channels(png, info);
    const int bytes = depth / 8;
    std::vector<uint8_t> row(static_cast<size_t>(w) * channels * bytes);
    for (int y = 0; y < h; ++y) {
        for (int i = 0; i < w * channels; ++i) {
            const uint16_t v = samples[static_cast<size_t>(y) * w * channels + i];
            if (bytes == 2)
                row[i * 2] = v >> 8, row[i * 2 + 1] = v & 0xFF;  // PNG is big-endian
            else
                row[i] = static_cast<uint8_t>(v);
        }
        png_write_row(png, row.data());
    }
    png_write_end(png, nullptr);
    png_destroy_write_struct(&png, &info);
    return out;
}

std::string jpeg_bytes(int w, int h, int components, const std::vector<uint8_t>& samples, int quality) {
    jpeg_compress_struct cinfo;
    jpeg_error_mgr err;
    cinfo.err = jpeg_std_error(&err);
    jpeg_create_compress(&cinfo);
    unsigned char* buf = nullptr;
    unsigned long size = 0;
    jpeg_mem_dest(&cinfo, &buf, &size);
    cinfo.image_width = w;
    cinfo.image_height = h;
    cinfo.input_components = components;
    cinfo.in_color_space = components == 1 ? JCS_GRAYSCALE : JCS_CMYK;
    jpeg_set_defaults(&cinfo);
    jpeg_set_quality(&cinfo, quality, TRUE);
    jpeg_start_compress(&cinfo, TRUE);
    std::vector<uint8_t> row(static_cast<size_t>(w) * components);
    while (cinfo.next_scanline < cinfo.image_height) {
        const size_t y = cinfo.next_scanline;
        for (size_t i = 0; i < row.size(); ++i) {
            const uint8_t v = samples[y * row.size() + i];
            row[i] = components == 4 ? 255 - v : v;  // Adobe CMYK is stored inverted
        }
        JSAMPROW r = row.data();
        jpeg_write_scanlines(&cinfo, &r, 1);
    }
    jpeg_finish_compress(&cinfo);
    jpeg_destroy_compress(&cinfo);
    std::string out(reinterpret_cast<char*>(buf), size);
    std::free(buf);
    return out;
}

std::string webp_bytes(int w, int h, const std::vector<uint8_t>& rgb, bool lossless) {
    uint8_t* out = nullptr;
    const size_t n = lossless ? WebPEncodeLosslessRGB(rgb.data(), w, h, w * 3, &out)
                              : WebPEncodeRGB(rgb.data(), w, h, w * 3, 95.f, &out);
    if (n == 0) throw std::runtime_error("WebP encoding failed");
    std::string s(reinterpret_cast<char*>(out), n);
    WebPFree(out);
    return s;
}

std::string webp_extended_with_exif(const std::string& simple, int w, int h, int orientation) {
    const std::string image_chunk = simple.substr(12);  // after "RIFF" size "WEBP"
    std::string vp8x = "VP8X";
    put_le32(vp8x, 10);
    vp8x.push_back(0x08);  // EXIF flag
    vp8x.append(3, '\0');
    put_le24(vp8x, w - 1);
    put_le24(vp8x, h - 1);
    const uint8_t tiff[] = {'M',  'M',  0, 42, 0, 0, 0, 8, 0, 1,
                            0x01, 0x12, 0, 3,  0, 0, 0, 1, 0, static_cast<uint8_t>(orientation),
                            0,    0,    0, 0,  0, 0};
    std::string exif = "EXIF";
    put_le32(exif, sizeof tiff);
    exif.append(reinterpret_cast<const char*>(tiff), sizeof tiff);
    std::string body = "WEBP" + vp8x + image_chunk + exif;
    std::string file = "RIFF";
    put_le32(file, static_cast<uint32_t>(body.size()));
    return file + body;
}

}  // namespace dtune::test
