// PNG/JPEG encoders and the Lanczos3 resampler.
//
// Why our own resampler rather than libvips: libvips is not among the packages we may assume
// (it pulls GLib and a large dependency tree into a static tool), while a separable Lanczos3 is
// ~80 lines, matches Pillow's LANCZOS (what SimpleTuner resizes with) in kernel and support, and
// runs per image on our own thread pool, so there is no second threading runtime to tune.
// jpeglib.h uses size_t and FILE without including their headers.
#include <cstddef>
#include <cstdio>

#include <jpeglib.h>
#include <png.h>
#include <webp/encode.h>

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstring>

#include "core/error.h"
#include "core/fs.h"
#include "io/image.h"

namespace dtune::io {

namespace {

double sinc(double x) {
    if (x == 0) return 1;
    x *= M_PI;
    return std::sin(x) / x;
}

double lanczos3(double x) {
    return (x > -3 && x < 3) ? sinc(x) * sinc(x / 3) : 0;
}

// For each output index: the first input index and normalised weights. The support widens by the
// downscale factor so the filter also low-passes (antialiasing), as Pillow does.
struct Taps {
    std::vector<int> first;
    std::vector<int> count;
    std::vector<float> weights;  // [out, max_taps]
    int max_taps = 0;
};

Taps compute_taps(int in_size, int out_size) {
    const double scale = static_cast<double>(in_size) / out_size;
    const double filter_scale = std::max(scale, 1.0);
    const double support = 3.0 * filter_scale;
    Taps t;
    t.max_taps = static_cast<int>(std::ceil(support)) * 2 + 1;
    t.first.resize(out_size);
    t.count.resize(out_size);
    t.weights.assign(static_cast<size_t>(out_size) * t.max_taps, 0.f);
    for (int o = 0; o < out_size; ++o) {
        const double center = (o + 0.5) * scale;
        const int lo = std::max(static_cast<int>(center - support + 0.5), 0);
        const int hi = std::min(static_cast<int>(center + support + 0.5), in_size);
        double total = 0;
        float* w = &t.weights[static_cast<size_t>(o) * t.max_taps];
        const int n = std::min(hi - lo, t.max_taps);
        for (int i = 0; i < n; ++i)
            total += (w[i] = static_cast<float>(lanczos3((lo + i - center + 0.5) / filter_scale)));
        if (total != 0)
            for (int i = 0; i < n; ++i) w[i] = static_cast<float>(w[i] / total);
        t.first[o] = lo;
        t.count[o] = n;
    }
    return t;
}

uint8_t to_u8(float v) {
    return static_cast<uint8_t>(std::clamp(std::lround(v), 0L, 255L));
}

RgbImage resize_horizontal(const RgbImage& in, int out_w) {
    const Taps t = compute_taps(in.width, out_w);
    RgbImage out(out_w, in.height);
    for (int y = 0; y < in.height; ++y) {
        const uint8_t* src = in.row(y);
        uint8_t* dst = out.row(y);
        for (int o = 0; o < out_w; ++o) {
            const float* w = &t.weights[static_cast<size_t>(o) * t.max_taps];
            const uint8_t* p = src + t.first[o] * 3;
            float r = 0, g = 0, b = 0;
            for (int i = 0; i < t.count[o]; ++i, p += 3) r += w[i] * p[0], g += w[i] * p[1], b += w[i] * p[2];
            dst[o * 3] = to_u8(r), dst[o * 3 + 1] = to_u8(g), dst[o * 3 + 2] = to_u8(b);
        }
    }
    return out;
}

RgbImage resize_vertical(const RgbImage& in, int out_h) {
    const Taps t = compute_taps(in.height, out_h);
    RgbImage out(in.width, out_h);
    const size_t row_len = static_cast<size_t>(in.width) * 3;
    std::vector<float> acc(row_len);
    for (int o = 0; o < out_h; ++o) {
        std::fill(acc.begin(), acc.end(), 0.f);
        const float* w = &t.weights[static_cast<size_t>(o) * t.max_taps];
        for (int i = 0; i < t.count[o]; ++i) {  // row-wise accumulation keeps memory access linear
            const uint8_t* src = in.row(t.first[o] + i);
            const float wi = w[i];
            for (size_t k = 0; k < row_len; ++k) acc[k] += wi * src[k];
        }
        uint8_t* dst = out.row(o);
        for (size_t k = 0; k < row_len; ++k) dst[k] = to_u8(acc[k]);
    }
    return out;
}

void png_write_mem(png_structp png, png_bytep data, png_size_t n) {
    static_cast<std::string*>(png_get_io_ptr(png))->append(reinterpret_cast<const char*>(data), n);
}
void png_flush_noop(png_structp) {}
void png_error_throw(png_structp png, png_const_charp message) {
    *static_cast<std::string*>(png_get_error_ptr(png)) = message;
    png_longjmp(png, 1);
}

bool encode_png_impl(const RgbImage& image, int level, std::string& out, std::vector<png_bytep>& rows,
                     std::string& message) {
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &message, png_error_throw, nullptr);
    if (!png) return false;
    png_infop info = png_create_info_struct(png);
    if (setjmp(png_jmpbuf(png))) {
        png_destroy_write_struct(&png, &info);
        return false;
    }
    png_set_write_fn(png, &out, png_write_mem, png_flush_noop);
    png_set_compression_level(png, level);
    png_set_IHDR(png, info, image.width, image.height, 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
                 PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
    png_write_info(png, info);
    rows.resize(image.height);
    for (int y = 0; y < image.height; ++y) rows[y] = const_cast<png_bytep>(image.row(y));
    png_write_image(png, rows.data());
    png_write_end(png, nullptr);
    png_destroy_write_struct(&png, &info);
    return true;
}

struct JpegWriteError {
    jpeg_error_mgr mgr;
    std::jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};
void jpeg_write_error_exit(j_common_ptr cinfo) {
    auto* err = reinterpret_cast<JpegWriteError*>(cinfo->err);
    (*cinfo->err->format_message)(cinfo, err->message);
    std::longjmp(err->jump, 1);
}

// A big-endian TIFF block holding only the Orientation tag, wrapped as an EXIF APP1 payload.
std::string exif_block(int orientation) {
    const uint8_t bytes[] = {'E',  'x',  'i', 'f', 0, 0, 'M', 'M', 0, 42,
                             0,    0,    0,   8,  // header, IFD at 8
                             0,    1,             // one entry
                             0x01, 0x12, 0,   3,   0, 0, 0,   1,   0, static_cast<uint8_t>(orientation),
                             0,    0,    0,   0,   0, 0};  // no next IFD
    return std::string(reinterpret_cast<const char*>(bytes), sizeof bytes);
}

bool encode_jpeg_impl(const RgbImage& image, int quality, const std::string& exif, unsigned char** buffer,
                      unsigned long* size, JpegWriteError& err) {
    jpeg_compress_struct cinfo;
    cinfo.err = jpeg_std_error(&err.mgr);
    err.mgr.error_exit = jpeg_write_error_exit;
    if (setjmp(err.jump)) {
        jpeg_destroy_compress(&cinfo);
        return false;
    }
    jpeg_create_compress(&cinfo);
    jpeg_mem_dest(&cinfo, buffer, size);
    cinfo.image_width = static_cast<JDIMENSION>(image.width);
    cinfo.image_height = static_cast<JDIMENSION>(image.height);
    cinfo.input_components = 3;
    cinfo.in_color_space = JCS_RGB;
    jpeg_set_defaults(&cinfo);
    jpeg_set_quality(&cinfo, quality, TRUE);
    jpeg_start_compress(&cinfo, TRUE);
    if (!exif.empty())
        jpeg_write_marker(&cinfo, JPEG_APP0 + 1, reinterpret_cast<const JOCTET*>(exif.data()),
                          static_cast<unsigned>(exif.size()));
    while (cinfo.next_scanline < cinfo.image_height) {
        JSAMPROW row = const_cast<JSAMPROW>(image.row(static_cast<int>(cinfo.next_scanline)));
        jpeg_write_scanlines(&cinfo, &row, 1);
    }
    jpeg_finish_compress(&cinfo);
    jpeg_destroy_compress(&cinfo);
    return true;
}

}  // namespace

RgbImage resize_lanczos(const RgbImage& image, int width, int height) {
    DTUNE_CHECK(width > 0 && height > 0 && image.width > 0 && image.height > 0, "resize to ", width, "x",
                height, " from ", image.width, "x", image.height, ": sizes must be positive");
    RgbImage cur = image;
    // Pass order by estimated cost: the vertical pass accumulates whole rows (contiguous, so the
    // compiler vectorises it, counted ~8x cheaper per tap); the horizontal pass is per pixel.
    auto taps = [](int in, int out) { return 6.0 * std::max(1.0, static_cast<double>(in) / out) + 1; };
    const double th = taps(image.width, width), tv = taps(image.height, height);
    const double h_first = double(image.height) * width * th + double(height) * width * tv / 8;
    const double v_first = double(height) * image.width * tv / 8 + double(height) * width * th;
    const bool horizontal_first = h_first < v_first;
    for (int pass = 0; pass < 2; ++pass) {
        const bool horizontal = (pass == 0) == horizontal_first;
        if (horizontal && cur.width != width) cur = resize_horizontal(cur, width);
        if (!horizontal && cur.height != height) cur = resize_vertical(cur, height);
    }
    return cur;
}

std::string encode_png(const RgbImage& image, int compression) {
    std::string out, message;
    std::vector<png_bytep> rows;
    if (!encode_png_impl(image, std::clamp(compression, 0, 9), out, rows, message))
        throw Error(str("PNG encoding failed: ", message));
    return out;
}

std::string encode_jpeg(const RgbImage& image, int quality, int exif_orientation) {
    unsigned char* buffer = nullptr;
    unsigned long size = 0;
    JpegWriteError err{};
    const std::string exif = exif_orientation != 1 ? exif_block(exif_orientation) : std::string();
    const bool ok = encode_jpeg_impl(image, std::clamp(quality, 1, 100), exif, &buffer, &size, err);
    std::string out = ok ? std::string(reinterpret_cast<const char*>(buffer), size) : std::string();
    std::free(buffer);
    if (!ok) throw Error(str("JPEG encoding failed: ", err.message));
    return out;
}

std::string encode_webp(const RgbImage& image, int quality) {
    DTUNE_CHECK(image.width > 0 && image.height > 0 && image.width <= WEBP_MAX_DIMENSION &&
                    image.height <= WEBP_MAX_DIMENSION,
                "WebP encoding: image size ", image.width, "x", image.height, " is outside 1..",
                WEBP_MAX_DIMENSION, " per side; write PNG instead");
    uint8_t* buffer = nullptr;
    const int stride = image.width * 3;
    const size_t size =
        quality >= 100
            ? WebPEncodeLosslessRGB(image.pixels.data(), image.width, image.height, stride, &buffer)
            : WebPEncodeRGB(image.pixels.data(), image.width, image.height, stride,
                            static_cast<float>(std::clamp(quality, 1, 99)), &buffer);
    std::string out = size > 0 ? std::string(reinterpret_cast<const char*>(buffer), size) : std::string();
    WebPFree(buffer);
    if (size == 0) throw Error("WebP encoding failed (libwebp returned no data; out of memory?)");
    return out;
}

std::string image_extension(const std::string& format) {
    std::string f = format;
    std::transform(f.begin(), f.end(), f.begin(), [](unsigned char c) { return std::tolower(c); });
    if (f == "png") return ".png";
    if (f == "jpg" || f == "jpeg") return ".jpg";
    if (f == "webp") return ".webp";
    throw UsageError(str("image format '", format, "' is not supported; use png, jpeg or webp"));
}

void write_image(const std::filesystem::path& path, const RgbImage& image, int quality) {
    std::string ext = path.extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
    if (ext == ".png") return fs::write_file_atomic(path, encode_png(image));
    if (ext == ".jpg" || ext == ".jpeg") return fs::write_file_atomic(path, encode_jpeg(image, quality));
    if (ext == ".webp") return fs::write_file_atomic(path, encode_webp(image, quality));
    throw UsageError(
        str(path.string(), ": cannot tell the image format from the extension; use .png, .jpg or .webp"));
}

}  // namespace dtune::io
