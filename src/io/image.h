// Image codecs and pixel operations on 8-bit RGB: decode JPEG (libjpeg-turbo), PNG (libpng) and
// WebP (libwebp) with EXIF orientation applied; Lanczos3 resize; crop; flip; PNG/JPEG/WebP writers;
// a grid helper. Torch-free; image_tensor.h turns an RgbImage into a normalised tensor.
//
// Invariants: an RgbImage holds width·height·3 bytes, row-major, no padding. Decoding converts
// every input to RGB the way Pillow's convert("RGB") does for SimpleTuner: grey is replicated,
// alpha is dropped (not composited), 16-bit samples keep their high byte, CMYK (plain or Adobe
// inverted) becomes (255−C)(255−K)/255. Any decoder failure is a DataError naming the file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace dtune::io {

struct RgbImage {
    int width = 0;
    int height = 0;
    std::vector<uint8_t> pixels;  // [H, W, 3]

    RgbImage() = default;
    RgbImage(int w, int h) : width(w), height(h), pixels(static_cast<size_t>(w) * h * 3) {}
    uint8_t* row(int y) { return pixels.data() + static_cast<size_t>(y) * width * 3; }
    const uint8_t* row(int y) const { return pixels.data() + static_cast<size_t>(y) * width * 3; }
    uint8_t* at(int x, int y) { return row(y) + x * 3; }
    const uint8_t* at(int x, int y) const { return row(y) + x * 3; }
};

struct DecodeOptions {
    // When > 0, JPEG decoding may use libjpeg's DCT scaling (1/2, 1/4, 1/8) as long as the
    // decoded image stays at least this large (display orientation) times `scale_margin`; the
    // Lanczos resize that follows then has less to do. 0 decodes at full size.
    int min_width = 0;
    int min_height = 0;
    double scale_margin = 2.0;
    bool apply_exif_orientation = true;
};

// The most pixels (width·height, from the file's header) an image may have before it is decoded;
// larger ones are refused as a DataError (the sample is skipped) instead of filling memory: a
// 60000×60000 PNG of zeros is a 10 MB file but 10.8 GB of pixels. The default is Pillow's
// decompression-bomb limit (2 × 89,478,485), so what SimpleTuner refuses, dtune refuses too.
// DTUNE_MAX_IMAGE_PIXELS overrides it (0 = no limit); a value that is not a count is a UsageError.
constexpr int64_t kDefaultMaxImagePixels = 2 * 89478485LL;
int64_t max_image_pixels();

// `name` is used in error messages (usually the path).
RgbImage decode_image(std::string_view bytes, const std::string& name, const DecodeOptions& options = {});
RgbImage read_image(const std::filesystem::path& path, const DecodeOptions& options = {});

// Applies an EXIF orientation (1..8) to the pixels, as Pillow's exif_transpose does.
RgbImage apply_orientation(const RgbImage& image, int orientation);

// High-quality resize with a separable Lanczos3 filter whose support widens with the downscale
// factor (antialiased, the same family as Pillow's LANCZOS, which SimpleTuner uses).
RgbImage resize_lanczos(const RgbImage& image, int width, int height);
// The rectangle [left, left+width) × [top, top+height); DataError if it leaves the image.
RgbImage crop(const RgbImage& image, int top, int left, int width, int height);
RgbImage flip_horizontal(const RgbImage& image);

// Encoders: bytes of a PNG (compression 0–9) or a baseline JPEG (quality 1–100). `exif_orientation`
// other than 1 adds an EXIF APP1 block (used by tests and to round-trip camera files).
std::string encode_png(const RgbImage& image, int compression = 6);
std::string encode_jpeg(const RgbImage& image, int quality = 90, int exif_orientation = 1);
// WebP (libwebp): lossy at quality 1–99 (SimpleTuner writes validation WebPs at 90), lossless at
// quality 100, so a decode gives back the exact pixels. At most 16383 pixels per side.
std::string encode_webp(const RgbImage& image, int quality = 90);
// Writes atomically; the format follows the extension (.png, .jpg/.jpeg, .webp); `quality` is
// the JPEG/WebP quality above.
void write_image(const std::filesystem::path& path, const RgbImage& image, int quality = 90);
// ".png", ".jpg" or ".webp" for an image format name (png, jpg/jpeg, webp; any case), e.g.
// SimpleTuner's validation_image_format; UsageError for anything else.
std::string image_extension(const std::string& format);

// Lays images out in rows of `columns` cells of the largest width/height, `padding` pixels apart,
// on a background colour; each image is centred in its cell.
RgbImage make_grid(const std::vector<RgbImage>& images, int columns, int padding = 0,
                   const uint8_t background[3] = nullptr);

}  // namespace dtune::io
