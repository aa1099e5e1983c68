// Writers for image test files in layouts our own encoders do not produce (grey, 16-bit, alpha,
// CMYK JPEG, WebP lossy/lossless/extended). Each file is generated, so nothing binary is committed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtune::test {

// PNG with the given libpng colour type (PNG_COLOR_TYPE_*) and bit depth; `samples` holds
// width·height·channels values (16-bit values when depth is 16).
std::string png_bytes(int width, int height, int color_type, int depth, const std::vector<uint16_t>& samples);
// A JPEG of `components` 1 (grey) or 4 (CMYK, stored Adobe-inverted as Photoshop and Pillow do).
std::string jpeg_bytes(int width, int height, int components, const std::vector<uint8_t>& samples,
                       int quality = 95);
// WebP via libwebp: lossy (VP8) or lossless (VP8L) from RGB.
std::string webp_bytes(int width, int height, const std::vector<uint8_t>& rgb, bool lossless);
// Wraps a simple WebP (VP8/VP8L) in the extended format with a trailing EXIF orientation chunk.
std::string webp_extended_with_exif(const std::string& simple, int width, int height, int orientation);

}  // namespace dtune::test
