// Image size and EXIF orientation from the first bytes of a JPEG, PNG or WebP file, without
// decoding pixels (what discovery needs to bucket thousands of files per second). Torch-free.
//
// Invariants: width/height are the stored (encoded) dimensions; display_width/height apply the
// EXIF orientation (5–8 are transposed, so they swap), which is the size Pillow reports after
// exif_transpose and therefore the size SimpleTuner buckets by.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

namespace dtune::io {

enum class ImageFormat { kUnknown, kJpeg, kPng, kWebp };

const char* to_string(ImageFormat format);

struct ImageInfo {
    ImageFormat format = ImageFormat::kUnknown;
    int width = 0;
    int height = 0;
    int orientation = 1;  // EXIF 1..8; 1 when absent

    bool transposed() const { return orientation >= 5 && orientation <= 8; }
    int display_width() const { return transposed() ? height : width; }
    int display_height() const { return transposed() ? width : height; }
};

enum class ParseStatus { kOk, kNeedMore, kInvalid };

// Parses `size` bytes from the start of a file. kNeedMore when the header (or the EXIF block the
// header points to) lies beyond `size`; `error` gets the reason for kInvalid.
ParseStatus parse_image_info(const uint8_t* data, size_t size, bool is_whole_file, ImageInfo& out,
                             std::string& error);

// Reads the first 64 KiB (the whole file only when the header lies further) and parses it.
// Throws DataError naming the file for unreadable, unknown or corrupt files.
ImageInfo read_image_info(const std::filesystem::path& path);

// The EXIF orientation in a TIFF block ("II*\0" or "MM\0*"), 1 when absent or malformed.
int exif_orientation(const uint8_t* tiff, size_t size);

// Lower-case extension check: .jpg .jpeg .png .webp
bool has_image_extension(const std::filesystem::path& path);

}  // namespace dtune::io
