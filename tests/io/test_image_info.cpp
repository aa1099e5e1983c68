// Header parsing for JPEG, PNG and WebP (simple and extended), EXIF orientation, corrupt files.
#include <gtest/gtest.h>
#include <png.h>

#include "core/error.h"
#include "image_test_files.h"
#include "io/image.h"
#include "io/image_info.h"
#include "support/test_support.h"

namespace dtune::io {
namespace test_image_info_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

RgbImage gradient(int w, int h) {
    RgbImage im(w, h);
    for (int y = 0; y < h; ++y)
        for (int x = 0; x < w; ++x) {
            uint8_t* p = im.at(x, y);
            p[0] = static_cast<uint8_t>(x * 255 / std::max(1, w - 1));
            p[1] = static_cast<uint8_t>(y * 255 / std::max(1, h - 1));
            p[2] = 128;
        }
    return im;
}

ImageInfo info_of(const std::string& bytes) {
    ImageInfo info;
    std::string error;
    const auto s =
        parse_image_info(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), true, info, error);
    EXPECT_EQ(s, ParseStatus::kOk) << error;
    return info;
}

TEST(ImageInfo, JpegPngWebpSizes) {
    const RgbImage im = gradient(37, 23);
    ImageInfo j = info_of(encode_jpeg(im));
    EXPECT_EQ(j.format, ImageFormat::kJpeg);
    EXPECT_EQ(j.width, 37);
    EXPECT_EQ(j.height, 23);
    EXPECT_EQ(j.orientation, 1);
    ImageInfo p = info_of(encode_png(im));
    EXPECT_EQ(p.format, ImageFormat::kPng);
    EXPECT_EQ(p.width, 37);
    EXPECT_EQ(p.height, 23);
    for (bool lossless : {false, true}) {
        ImageInfo w = info_of(test::webp_bytes(37, 23, im.pixels, lossless));
        EXPECT_EQ(w.format, ImageFormat::kWebp);
        EXPECT_EQ(w.width, 37) << lossless;
        EXPECT_EQ(w.height, 23) << lossless;
    }
    // Grey and CMYK JPEGs use other SOF layouts of the same marker.
    ImageInfo g = info_of(test::jpeg_bytes(19, 41, 1, std::vector<uint8_t>(19 * 41, 90)));
    EXPECT_EQ(g.width, 19);
    EXPECT_EQ(g.height, 41);
}

TEST(ImageInfo, ExifOrientationSwapsForFiveToEight) {
    const RgbImage im = gradient(40, 24);
    for (int o = 1; o <= 8; ++o) {
        ImageInfo j = info_of(encode_jpeg(im, 90, o));
        EXPECT_EQ(j.orientation, o);
        EXPECT_EQ(j.display_width(), o >= 5 ? 24 : 40) << o;
        EXPECT_EQ(j.display_height(), o >= 5 ? 40 : 24) << o;
    }
    const std::string webp = test::webp_bytes(40, 24, im.pixels, true);
    ImageInfo x = info_of(test::webp_extended_with_exif(webp, 40, 24, 6));
    EXPECT_EQ(x.width, 40);
    EXPECT_EQ(x.height, 24);
    EXPECT_EQ(x.orientation, 6);
    EXPECT_EQ(x.display_width(), 24);
}

TEST(ImageInfo, TiffLittleAndBigEndian) {
    const uint8_t le[] = {'I', 'I', 42, 0, 8, 0, 0, 0, 1, 0, 0x12, 0x01, 3,
                          0,   1,   0,  0, 0, 8, 0, 0, 0, 0, 0,    0,    0};
    const uint8_t be[] = {'M', 'M', 0, 42, 0, 0, 0, 8, 0, 1, 0x01, 0x12, 0,
                          3,   0,   0, 0,  1, 0, 3, 0, 0, 0, 0,    0,    0};
    EXPECT_EQ(exif_orientation(le, sizeof le), 8);
    EXPECT_EQ(exif_orientation(be, sizeof be), 3);
    EXPECT_EQ(exif_orientation(be, 10), 1);  // truncated → default
}

TEST(ImageInfo, CorruptFilesRaiseDataErrorNamingTheFile) {
    test::TempDir dir;
    test::write_bytes(dir / "garbage.jpg", "this is not an image at all");
    test::write_bytes(dir / "empty.png", "");
    const std::string jpeg = encode_jpeg(gradient(64, 64));
    test::write_bytes(dir / "cut.jpg", jpeg.substr(0, 40));  // ends before the SOF
    for (const char* name : {"garbage.jpg", "empty.png", "cut.jpg", "missing.webp"}) {
        try {
            read_image_info(dir / name);
            FAIL() << name;
        } catch (const DataError& e) {
            EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
        }
    }
}

TEST(ImageInfo, LargeSegmentBeforeFrameHeaderIsFound) {
    // A 100 KiB APP2 segment pushes the SOF past the first 64 KiB read.
    const std::string jpeg = encode_jpeg(gradient(50, 30));
    std::string big = jpeg.substr(0, 2);
    for (int k = 0; k < 2; ++k) {
        const size_t len = 60000;
        big += "\xFF\xE2";
        big.push_back(static_cast<char>((len >> 8) & 0xFF));
        big.push_back(static_cast<char>(len & 0xFF));
        big += std::string(len - 2, 'x');
    }
    big += jpeg.substr(2);
    test::TempDir dir;
    test::write_bytes(dir / "big.jpg", big);
    const ImageInfo info = read_image_info(dir / "big.jpg");
    EXPECT_EQ(info.width, 50);
    EXPECT_EQ(info.height, 30);
}

}  // namespace
}  // namespace test_image_info_local
}  // namespace dtune::io
