// Decoders and encoders over libjpeg-turbo, libpng and libwebp, and the EXIF orientation.
//
// libjpeg and libpng report fatal errors by longjmp. Each *_impl function below keeps only plain
// C locals between setjmp and the library calls; every C++ object it fills lives in the caller
// and is reached through a reference, so a longjmp skips no destructor.
#include "io/image.h"

// jpeglib.h uses size_t and FILE without including their headers.
#include <cstddef>
#include <cstdio>

#include <jpeglib.h>
#include <png.h>
#include <webp/decode.h>

#include <cerrno>
#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "core/fs.h"
#include "io/image_info.h"

namespace dtune::io {

namespace {

struct JpegError {
    jpeg_error_mgr mgr;
    std::jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

void jpeg_error_exit(j_common_ptr cinfo) {
    auto* err = reinterpret_cast<JpegError*>(cinfo->err);
    (*cinfo->err->format_message)(cinfo, err->message);
    std::longjmp(err->jump, 1);
}

void jpeg_silent(j_common_ptr, int) {}

uint8_t cmyk_channel(uint8_t c, uint8_t k, bool inverted) {
    if (inverted) c = 255 - c, k = 255 - k;  // Adobe writes inverted CMYK
    return static_cast<uint8_t>((255 - c) * (255 - k) / 255);
}

// Decodes into `out` (and `cmyk` for 4-channel files). Returns false with err.message set on a
// libjpeg error.
bool decode_jpeg_impl(const uint8_t* data, size_t size, int scale_denom_hint_w, int scale_denom_hint_h,
                      RgbImage& out, std::vector<uint8_t>& cmyk, JpegError& err) {
    jpeg_decompress_struct cinfo;
    cinfo.err = jpeg_std_error(&err.mgr);
    err.mgr.error_exit = jpeg_error_exit;
    err.mgr.emit_message = jpeg_silent;
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        return false;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
    jpeg_read_header(&cinfo, TRUE);
    const bool four = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
    cinfo.out_color_space = four ? JCS_CMYK : JCS_RGB;
    // DCT scaling: the largest 1/d that keeps the decoded image above the requested minimum.
    for (int d = 8; d > 1; d /= 2) {
        if (scale_denom_hint_w > 0 && static_cast<int>(cinfo.image_width) / d >= scale_denom_hint_w &&
            static_cast<int>(cinfo.image_height) / d >= scale_denom_hint_h) {
            cinfo.scale_num = 1;
            cinfo.scale_denom = d;
            break;
        }
    }
    jpeg_start_decompress(&cinfo);
    const int w = static_cast<int>(cinfo.output_width), h = static_cast<int>(cinfo.output_height);
    out = RgbImage(w, h);
    if (four) cmyk.resize(static_cast<size_t>(w) * 4);
    while (cinfo.output_scanline < cinfo.output_height) {
        const int y = static_cast<int>(cinfo.output_scanline);
        JSAMPROW row = four ? cmyk.data() : out.row(y);
        jpeg_read_scanlines(&cinfo, &row, 1);
        if (four) {
            const bool inverted = cinfo.saw_Adobe_marker;
            uint8_t* dst = out.row(y);
            for (int x = 0; x < w; ++x) {
                const uint8_t* p = cmyk.data() + x * 4;
                for (int c = 0; c < 3; ++c) dst[x * 3 + c] = cmyk_channel(p[c], p[3], inverted);
            }
        }
    }
    jpeg_finish_decompress(&cinfo);
    jpeg_destroy_decompress(&cinfo);
    return true;
}

struct PngSource {
    const uint8_t* data;
    size_t size;
    size_t pos;
};

void png_read_mem(png_structp png, png_bytep dst, png_size_t n) {
    auto* src = static_cast<PngSource*>(png_get_io_ptr(png));
    if (src->pos + n > src->size) png_error(png, "file is truncated");
    std::memcpy(dst, src->data + src->pos, n);
    src->pos += n;
}

void png_error_fn(png_structp png, png_const_charp message) {
    auto* msg = static_cast<std::string*>(png_get_error_ptr(png));
    *msg = message;
    png_longjmp(png, 1);
}
void png_warning_fn(png_structp, png_const_charp) {}

bool decode_png_impl(const uint8_t* data, size_t size, RgbImage& out, std::vector<png_bytep>& rows,
                     std::string& message) {
    png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &message, png_error_fn, png_warning_fn);
    if (!png) return false;
    png_infop info = png_create_info_struct(png);
    PngSource src{data, size, 0};
    if (setjmp(png_jmpbuf(png))) {
        png_destroy_read_struct(&png, &info, nullptr);
        return false;
    }
    png_set_read_fn(png, &src, png_read_mem);
    png_read_info(png, info);
    const int depth = png_get_bit_depth(png, info);
    const int type = png_get_color_type(png, info);
    png_set_expand(png);                     // palette → RGB, grey < 8 bit → 8 bit, tRNS → alpha
    if (depth == 16) png_set_strip_16(png);  // keep the high byte, as Pillow does
    if (type == PNG_COLOR_TYPE_GRAY || type == PNG_COLOR_TYPE_GRAY_ALPHA) png_set_gray_to_rgb(png);
    png_set_strip_alpha(png);  // drop alpha without compositing, like convert("RGB")
    png_set_interlace_handling(png);
    png_read_update_info(png, info);
    const int w = static_cast<int>(png_get_image_width(png, info));
    const int h = static_cast<int>(png_get_image_height(png, info));
    if (png_get_rowbytes(png, info) != static_cast<size_t>(w) * 3)
        png_error(png, "unexpected row layout after transforms");
    out = RgbImage(w, h);
    rows.resize(h);
    for (int y = 0; y < h; ++y) rows[y] = out.row(y);
    png_read_image(png, rows.data());
    png_read_end(png, nullptr);
    png_destroy_read_struct(&png, &info, nullptr);
    return true;
}

RgbImage decode_webp(const uint8_t* data, size_t size, const std::string& name) {
    int w = 0, h = 0;
    uint8_t* rgb = WebPDecodeRGB(data, size, &w, &h);  // alpha is dropped, not composited
    if (!rgb) throw DataError(str(name, ": cannot decode WebP (corrupt, or animated); the image is skipped"));
    RgbImage out(w, h);
    std::memcpy(out.pixels.data(), rgb, out.pixels.size());
    WebPFree(rgb);
    return out;
}

}  // namespace

int64_t max_image_pixels() {
    const char* env = std::getenv("DTUNE_MAX_IMAGE_PIXELS");
    if (env == nullptr || *env == '\0') return kDefaultMaxImagePixels;
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(env, &end, 10);
    if (errno != 0 || *end != '\0' || v < 0)
        throw UsageError(
            str("DTUNE_MAX_IMAGE_PIXELS='", env,
                "' is not a pixel count; use a whole number such as 250000000, or 0 for no limit"));
    return v;
}

RgbImage decode_image(std::string_view bytes, const std::string& name, const DecodeOptions& options) {
    const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
    ImageInfo info;
    std::string error;
    if (parse_image_info(data, bytes.size(), true, info, error) != ParseStatus::kOk)
        throw DataError(str(name, ": ", error, "; the image is skipped"));
    const int64_t pixels = static_cast<int64_t>(info.width) * info.height, limit = max_image_pixels();
    if (limit > 0 && pixels > limit)
        throw DataError(str(
            name, ": ", info.width, "x", info.height, " = ", pixels, " pixels is above the limit of ", limit,
            " (a decompression bomb, or an image far larger than training needs); the image is "
            "skipped. Downscale it, or raise DTUNE_MAX_IMAGE_PIXELS (0 = no limit)"));
    RgbImage out;
    if (info.format == ImageFormat::kJpeg) {
        int min_w = 0, min_h = 0;
        if (options.min_width > 0 && options.min_height > 0) {
            // The minimum is given in display orientation; the decoder works on stored pixels.
            const bool swap = options.apply_exif_orientation && info.transposed();
            min_w = static_cast<int>((swap ? options.min_height : options.min_width) * options.scale_margin);
            min_h = static_cast<int>((swap ? options.min_width : options.min_height) * options.scale_margin);
        }
        JpegError err{};
        std::vector<uint8_t> cmyk;
        if (!decode_jpeg_impl(data, bytes.size(), min_w, min_h, out, cmyk, err))
            throw DataError(str(name, ": corrupt JPEG (", err.message, "); the image is skipped"));
    } else if (info.format == ImageFormat::kPng) {
        std::vector<png_bytep> rows;
        std::string message;
        if (!decode_png_impl(data, bytes.size(), out, rows, message))
            throw DataError(str(name, ": corrupt PNG (", message, "); the image is skipped"));
    } else {
        out = decode_webp(data, bytes.size(), name);
    }
    if (options.apply_exif_orientation && info.orientation != 1)
        return apply_orientation(out, info.orientation);
    return out;
}

RgbImage read_image(const std::filesystem::path& path, const DecodeOptions& options) {
    return decode_image(fs::read_file(path), path.string(), options);
}

RgbImage apply_orientation(const RgbImage& in, int o) {
    if (o < 2 || o > 8) return in;
    const int W = in.width, H = in.height;
    const bool transpose = o >= 5;
    RgbImage out(transpose ? H : W, transpose ? W : H);
    for (int y = 0; y < out.height; ++y) {
        for (int x = 0; x < out.width; ++x) {
            int sx = x, sy = y;
            switch (o) {
                case 2: sx = W - 1 - x; break;                  // mirror horizontal
                case 3: sx = W - 1 - x, sy = H - 1 - y; break;  // rotate 180
                case 4: sy = H - 1 - y; break;                  // mirror vertical
                case 5: sx = y, sy = x; break;                  // transpose
                case 6: sx = y, sy = H - 1 - x; break;          // rotate 90 clockwise
                case 7: sx = W - 1 - y, sy = H - 1 - x; break;  // transverse
                case 8: sx = W - 1 - y, sy = x; break;          // rotate 90 counter-clockwise
            }
            std::memcpy(out.at(x, y), in.at(sx, sy), 3);
        }
    }
    return out;
}

RgbImage crop(const RgbImage& in, int top, int left, int width, int height) {
    if (top < 0 || left < 0 || width <= 0 || height <= 0 || left + width > in.width ||
        top + height > in.height)
        throw DataError(str("crop ", width, "x", height, " at (top ", top, ", left ", left, ") leaves the ",
                            in.width, "x", in.height,
                            " image; the bucket metadata is stale, delete it to rebuild"));
    RgbImage out(width, height);
    for (int y = 0; y < height; ++y)
        std::memcpy(out.row(y), in.at(left, top + y), static_cast<size_t>(width) * 3);
    return out;
}

RgbImage flip_horizontal(const RgbImage& in) {
    RgbImage out(in.width, in.height);
    for (int y = 0; y < in.height; ++y)
        for (int x = 0; x < in.width; ++x) std::memcpy(out.at(x, y), in.at(in.width - 1 - x, y), 3);
    return out;
}

RgbImage make_grid(const std::vector<RgbImage>& images, int columns, int padding,
                   const uint8_t background[3]) {
    DTUNE_CHECK(!images.empty() && columns > 0 && padding >= 0, "make_grid needs images and columns > 0");
    int cell_w = 0, cell_h = 0;
    for (const auto& im : images) cell_w = std::max(cell_w, im.width), cell_h = std::max(cell_h, im.height);
    const int n = static_cast<int>(images.size());
    const int cols = std::min(columns, n), rows = (n + columns - 1) / columns;
    RgbImage grid(cols * cell_w + (cols - 1) * padding, rows * cell_h + (rows - 1) * padding);
    const uint8_t black[3] = {0, 0, 0};
    const uint8_t* bg = background ? background : black;
    for (size_t i = 0; i < grid.pixels.size(); ++i) grid.pixels[i] = bg[i % 3];
    for (int i = 0; i < n; ++i) {
        const RgbImage& im = images[i];
        const int x0 = (i % columns) * (cell_w + padding) + (cell_w - im.width) / 2;
        const int y0 = (i / columns) * (cell_h + padding) + (cell_h - im.height) / 2;
        for (int y = 0; y < im.height; ++y)
            std::memcpy(grid.at(x0, y0 + y), im.row(y), static_cast<size_t>(im.width) * 3);
    }
    return grid;
}

}  // namespace dtune::io
