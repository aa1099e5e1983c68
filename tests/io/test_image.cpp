// Decoding every supported layout to RGB8, orientation, Lanczos resize, crop/flip, encoders,
// grid, tensors and whole-sample preparation.
#include <gtest/gtest.h>
#include <png.h>

#include <ATen/ATen.h>

#include <cmath>
#include <functional>
#include <random>

#include "core/error.h"
#include "image_test_files.h"
#include "io/image.h"
#include "io/image_tensor.h"
#include "support/test_support.h"

namespace dtune::io {
namespace test_image_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

RgbImage random_image(int w, int h, uint32_t seed) {
    std::mt19937 rng(seed);
    RgbImage im(w, h);
    for (auto& v : im.pixels) v = static_cast<uint8_t>(rng() & 0xFF);
    return im;
}

// Four flat quadrants (red, green, blue, white): survives JPEG and shows orientation.
RgbImage quadrants(int w, int h) {
    RgbImage im(w, h);
    const uint8_t colours[4][3] = {{255, 0, 0}, {0, 255, 0}, {0, 0, 255}, {255, 255, 255}};
    for (int y = 0; y < h; ++y)
        for (int x = 0; x < w; ++x) std::memcpy(im.at(x, y), colours[(y >= h / 2) * 2 + (x >= w / 2)], 3);
    return im;
}

double mean_abs_diff(const RgbImage& a, const RgbImage& b) {
    EXPECT_EQ(a.width, b.width);
    EXPECT_EQ(a.height, b.height);
    double s = 0;
    for (size_t i = 0; i < a.pixels.size() && i < b.pixels.size(); ++i)
        s += std::abs(a.pixels[i] - b.pixels[i]);
    return s / static_cast<double>(a.pixels.size());
}

TEST(Image, PngRoundTripIsExact) {
    const RgbImage im = random_image(33, 17, 1);
    const RgbImage back = decode_image(encode_png(im), "mem.png");
    EXPECT_EQ(back.pixels, im.pixels);
}

// An image whose header claims more pixels than the limit is refused before any pixel buffer is
// allocated; the limit follows DTUNE_MAX_IMAGE_PIXELS.
TEST(Image, TooManyPixelsAreRefusedBeforeDecoding) {
    std::string png = encode_png(random_image(4, 4, 2));
    // IHDR's width and height (big-endian) follow the 8-byte signature, the chunk length and "IHDR".
    for (size_t offset : {16u, 20u}) png.replace(offset, 4, std::string("\x00\x00\xea\x60", 4));  // 60000
    try {
        decode_image(png, "bomb.png");
        FAIL() << "a 60000x60000 PNG was decoded";
    } catch (const DataError& e) {
        EXPECT_NE(
            std::string(e.what()).find("bomb.png: 60000x60000 = 3600000000 pixels is above the limit of " +
                                       std::to_string(kDefaultMaxImagePixels)),
            std::string::npos)
            << e.what();
    }
    const std::string small = encode_png(random_image(4, 4, 2));
    const auto with_limit = [&](const char* value) {
        setenv("DTUNE_MAX_IMAGE_PIXELS", value, 1);
        try {
            decode_image(small, "small.png");
            unsetenv("DTUNE_MAX_IMAGE_PIXELS");
            return std::string("decoded");
        } catch (const std::exception& e) {
            unsetenv("DTUNE_MAX_IMAGE_PIXELS");
            return std::string(dynamic_cast<const UsageError*>(&e) ? "usage: " : "data: ") + e.what();
        }
    };
    EXPECT_EQ(with_limit("16"), "decoded");
    EXPECT_EQ(with_limit("0"), "decoded");
    EXPECT_NE(with_limit("15").find("data: small.png: 4x4 = 16 pixels is above the limit of 15"),
              std::string::npos);
    EXPECT_NE(with_limit("lots").find("usage: DTUNE_MAX_IMAGE_PIXELS='lots' is not a pixel count"),
              std::string::npos);
}

// The limit also holds for the size the bucket resizes an image to. A 100000x2 PNG (a few hundred
// bytes; 200,000 pixels pass the header check) lands in a bucket with a 64-pixel short side, so
// it is resized to 3200000x64: 204,800,000 pixels, 2.4 GB as floats. It is refused by name before
// the file is decoded, on the local and the in-memory (S3) path alike.
TEST(Image, ResizeAboveThePixelLimitIsRefusedBeforeDecoding) {
    test::TempDir dir;
    const int w = 100000, h = 2;
    const std::string png =
        test::png_bytes(w, h, PNG_COLOR_TYPE_GRAY, 8, std::vector<uint16_t>(size_t(w) * h, 0));
    EXPECT_LT(png.size(), 2000u);
    test::write_bytes(dir / "strip.png", png);
    PrepareSpec spec;
    spec.resize_height = 64;
    spec.resize_width = w / h * spec.resize_height;
    spec.crop_width = spec.crop_height = 64;
    const std::string expected =
        str("strip.png: its bucket resizes it to ", spec.resize_width, "x", spec.resize_height, " = ",
            int64_t(spec.resize_width) * spec.resize_height, " pixels, above the limit of ",
            kDefaultMaxImagePixels);
    const auto message = [&](const std::function<void()>& prepare) {
        try {
            prepare();
        } catch (const DataError& e) {
            return std::string(e.what());
        }
        return std::string("<prepared>");
    };
    // Before: both returned the 64x64 crop after a 614 MB resize.
    EXPECT_NE(message([&] { prepare_image(dir / "strip.png", spec); }).find(expected), std::string::npos)
        << message([&] { prepare_image(dir / "strip.png", spec); });
    EXPECT_NE(message([&] { prepare_image_bytes(png, "s3://b/strip.png", spec); }).find(expected),
              std::string::npos);
    // Within the limit the same strip is prepared.
    spec.resize_width = w;
    spec.resize_height = h;
    spec.crop_width = 64;
    spec.crop_height = 2;
    EXPECT_EQ(prepare_image(dir / "strip.png", spec).width, 64);
}

TEST(Image, JpegRoundTripIsClose) {
    const RgbImage im = quadrants(64, 48);
    const RgbImage back = decode_image(encode_jpeg(im, 95), "mem.jpg");
    EXPECT_LT(mean_abs_diff(im, back), 3.0);
}

TEST(Image, PngGreyAlphaSixteenBit) {
    // grey 8-bit → replicated
    RgbImage g = decode_image(test::png_bytes(2, 1, PNG_COLOR_TYPE_GRAY, 8, {10, 200}), "g.png");
    EXPECT_EQ(g.pixels, (std::vector<uint8_t>{10, 10, 10, 200, 200, 200}));
    // RGBA → alpha dropped, not composited
    RgbImage a = decode_image(test::png_bytes(1, 1, PNG_COLOR_TYPE_RGBA, 8, {40, 80, 120, 0}), "a.png");
    EXPECT_EQ(a.pixels, (std::vector<uint8_t>{40, 80, 120}));
    // 16-bit RGB → high byte
    RgbImage s =
        decode_image(test::png_bytes(1, 1, PNG_COLOR_TYPE_RGB, 16, {0xABCD, 0x1234, 0xFF00}), "s.png");
    EXPECT_EQ(s.pixels, (std::vector<uint8_t>{0xAB, 0x12, 0xFF}));
    // 16-bit grey + alpha
    RgbImage ga =
        decode_image(test::png_bytes(1, 1, PNG_COLOR_TYPE_GRAY_ALPHA, 16, {0x7F00, 0x0100}), "ga.png");
    EXPECT_EQ(ga.pixels, (std::vector<uint8_t>{0x7F, 0x7F, 0x7F}));
}

TEST(Image, JpegGreyAndCmyk) {
    RgbImage g = decode_image(test::jpeg_bytes(16, 16, 1, std::vector<uint8_t>(256, 100)), "g.jpg");
    for (size_t i = 0; i < g.pixels.size(); ++i) ASSERT_NEAR(g.pixels[i], 100, 1);
    // C=0, M=128, Y=255, K=64 → R = 255·191/255 = 191, G = 127·191/255 ≈ 95, B = 0
    std::vector<uint8_t> cmyk;
    for (int i = 0; i < 256; ++i) cmyk.insert(cmyk.end(), {0, 128, 255, 64});
    RgbImage c = decode_image(test::jpeg_bytes(16, 16, 4, cmyk), "c.jpg");
    EXPECT_NEAR(c.at(8, 8)[0], 191, 3);
    EXPECT_NEAR(c.at(8, 8)[1], 95, 3);
    EXPECT_NEAR(c.at(8, 8)[2], 0, 3);
}

TEST(Image, WebpLossyLosslessAndExtended) {
    const RgbImage im = quadrants(40, 24);
    EXPECT_EQ(decode_image(test::webp_bytes(40, 24, im.pixels, true), "l.webp").pixels, im.pixels);
    EXPECT_LT(mean_abs_diff(decode_image(test::webp_bytes(40, 24, im.pixels, false), "y.webp"), im), 6.0);
    const std::string ext =
        test::webp_extended_with_exif(test::webp_bytes(40, 24, im.pixels, true), 40, 24, 6);
    const RgbImage rotated = decode_image(ext, "x.webp");
    EXPECT_EQ(rotated.width, 24);
    EXPECT_EQ(rotated.height, 40);
    EXPECT_EQ(rotated.pixels, apply_orientation(im, 6).pixels);
}

TEST(Image, OrientationByHand) {
    // 3x2 image with pixel values 1..6 in the red channel:
    //   1 2 3
    //   4 5 6
    RgbImage im(3, 2);
    for (int i = 0; i < 6; ++i) im.pixels[i * 3] = static_cast<uint8_t>(i + 1);
    auto reds = [](const RgbImage& r) {
        std::vector<int> v;
        for (size_t i = 0; i < r.pixels.size(); i += 3) v.push_back(r.pixels[i]);
        return v;
    };
    EXPECT_EQ(reds(apply_orientation(im, 2)), (std::vector<int>{3, 2, 1, 6, 5, 4}));
    EXPECT_EQ(reds(apply_orientation(im, 3)), (std::vector<int>{6, 5, 4, 3, 2, 1}));
    EXPECT_EQ(reds(apply_orientation(im, 4)), (std::vector<int>{4, 5, 6, 1, 2, 3}));
    EXPECT_EQ(reds(apply_orientation(im, 5)), (std::vector<int>{1, 4, 2, 5, 3, 6}));  // transpose
    EXPECT_EQ(reds(apply_orientation(im, 6)), (std::vector<int>{4, 1, 5, 2, 6, 3}));  // 90° clockwise
    EXPECT_EQ(reds(apply_orientation(im, 7)), (std::vector<int>{6, 3, 5, 2, 4, 1}));
    EXPECT_EQ(reds(apply_orientation(im, 8)), (std::vector<int>{3, 6, 2, 5, 1, 4}));  // 90° counter-clockwise
    EXPECT_EQ(apply_orientation(im, 6).width, 2);
}

TEST(Image, JpegExifOrientationIsApplied) {
    const RgbImage im = quadrants(64, 32);
    const RgbImage back = decode_image(encode_jpeg(im, 95, 8), "o.jpg");
    EXPECT_LT(mean_abs_diff(apply_orientation(im, 8), back), 4.0);
    DecodeOptions raw;
    raw.apply_exif_orientation = false;
    EXPECT_EQ(decode_image(encode_jpeg(im, 95, 8), "o.jpg", raw).width, 64);
}

TEST(Image, CorruptPixelsRaiseDataError) {
    std::string jpeg = encode_jpeg(random_image(64, 64, 3), 90);
    std::string cut = jpeg.substr(0, jpeg.size() / 2);  // header fine, data cut short
    std::string png = encode_png(random_image(64, 64, 4));
    std::string png_cut = png.substr(0, png.size() - 40);
    for (const auto& [bytes, name] : std::vector<std::pair<std::string, std::string>>{
             {png_cut, "cut.png"}, {"RIFF1234WEBPVP8 xxxxxxxxxxxxxxxxxxxx", "bad.webp"}}) {
        try {
            decode_image(bytes, name);
            FAIL() << name;
        } catch (const DataError& e) {
            EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
        }
    }
    // libjpeg pads a truncated scan with grey and warns rather than failing, like Pillow with
    // LOAD_TRUNCATED_IMAGES; corrupting the entropy data itself must fail or decode to something.
    EXPECT_NO_THROW(decode_image(cut, "cut.jpg"));
}

TEST(Image, LanczosPreservesConstantsAndLinearRamps) {
    RgbImage flat(100, 80);
    std::fill(flat.pixels.begin(), flat.pixels.end(), 77);
    for (auto [w, h] : {std::pair{37, 23}, std::pair{250, 190}, std::pair{100, 40}}) {
        const RgbImage r = resize_lanczos(flat, w, h);
        ASSERT_EQ(r.width, w);
        for (uint8_t v : r.pixels) ASSERT_EQ(v, 77);
    }
    // A horizontal ramp 0..255 over 256 px resized to 128 px: interior samples sit at the mean of
    // each source pair, (2k + 2k+1)/2 = 2k + 0.5 → 2k or 2k+1 after rounding.
    RgbImage ramp(256, 4);
    for (int y = 0; y < 4; ++y)
        for (int x = 0; x < 256; ++x) std::fill_n(ramp.at(x, y), 3, static_cast<uint8_t>(x));
    const RgbImage half = resize_lanczos(ramp, 128, 4);
    for (int k = 8; k < 120; ++k) ASSERT_NEAR(half.at(k, 2)[0], 2 * k + 0.5, 0.6) << k;
    // Antialiasing: a 1-px checkerboard downscaled 4× is flat grey, not aliased.
    RgbImage checker(64, 64);
    for (int y = 0; y < 64; ++y)
        for (int x = 0; x < 64; ++x)
            std::fill_n(checker.at(x, y), 3, static_cast<uint8_t>(((x + y) & 1) * 255));
    const RgbImage small = resize_lanczos(checker, 16, 16);
    for (int y = 3; y < 13; ++y)
        for (int x = 3; x < 13; ++x) ASSERT_NEAR(small.at(x, y)[0], 127.5, 2) << x << "," << y;
}

TEST(Image, CropFlipGrid) {
    const RgbImage im = random_image(10, 8, 5);
    const RgbImage c = crop(im, 2, 3, 4, 5);
    EXPECT_EQ(c.width, 4);
    EXPECT_EQ(c.height, 5);
    EXPECT_EQ(0, std::memcmp(c.at(0, 0), im.at(3, 2), 3));
    EXPECT_EQ(0, std::memcmp(c.at(3, 4), im.at(6, 6), 3));
    EXPECT_THROW(crop(im, 4, 0, 10, 5), DataError);
    const RgbImage f = flip_horizontal(im);
    EXPECT_EQ(0, std::memcmp(f.at(0, 1), im.at(9, 1), 3));
    const uint8_t white[3] = {255, 255, 255};
    const RgbImage g = make_grid({im, c, im}, 2, 1, white);
    EXPECT_EQ(g.width, 2 * 10 + 1);
    EXPECT_EQ(g.height, 2 * 8 + 1);
    EXPECT_EQ(0, std::memcmp(g.at(0, 0), im.at(0, 0), 3));
    EXPECT_EQ(0, std::memcmp(g.at(0, 9), im.at(0, 0), 3));  // third image: second row
    EXPECT_EQ(0, std::memcmp(g.at(14, 1), c.at(0, 0), 3));  // centred: (10-4)/2, (8-5)/2 into the cell
    EXPECT_EQ(g.at(11, 0)[0], 255);                         // cell margin around the smaller image
    EXPECT_EQ(g.at(10, 0)[0], 255);                         // padding column
    EXPECT_EQ(g.at(16, 12)[1], 255);                        // empty fourth cell
}

TEST(Image, TensorConversion) {
    RgbImage im(2, 1);
    im.pixels = {0, 255, 51, 128, 64, 204};
    const at::Tensor t = to_tensor(im);
    ASSERT_EQ(t.sizes(), (std::vector<int64_t>{3, 1, 2}));
    EXPECT_FLOAT_EQ(t[0][0][0].item<float>(), -1.f);
    EXPECT_FLOAT_EQ(t[1][0][0].item<float>(), 1.f);
    EXPECT_NEAR(t[2][0][0].item<float>(), 51 / 127.5 - 1, 1e-6);
    EXPECT_NEAR(t[0][0][1].item<float>(), 128 / 127.5 - 1, 1e-6);
    EXPECT_EQ(from_tensor(t).pixels, im.pixels);
}

TEST(Image, PrepareImageResizesCropsAndFlips) {
    test::TempDir dir;
    const RgbImage im = quadrants(200, 100);
    write_image(dir / "q.png", im);
    PrepareSpec spec{100, 50, 5, 10, 64, 32, true};
    const RgbImage out = prepare_image(dir / "q.png", spec);
    ASSERT_EQ(out.width, 64);
    ASSERT_EQ(out.height, 32);
    // After resize to 100x50 the quadrant border is at x=50; crop starts at x=10, so the border
    // sits at x=40 and the flip moves it to x=24: left of it is green (top-right quadrant).
    EXPECT_NEAR(out.at(5, 2)[1], 255, 2);
    EXPECT_NEAR(out.at(40, 2)[0], 255, 2);
    spec.crop_top = 30;  // 30 + 32 > 50
    EXPECT_THROW(prepare_image(dir / "q.png", spec), DataError);
    const at::Tensor t = prepare_image_tensor(dir / "q.png", PrepareSpec{100, 50, 0, 0, 100, 50, false});
    EXPECT_EQ(t.sizes(), (std::vector<int64_t>{3, 50, 100}));
    EXPECT_LE(t.max().item<float>(), 1.f);
    EXPECT_GE(t.min().item<float>(), -1.f);
}

TEST(Image, JpegDctScalingKeepsEnoughPixels) {
    const RgbImage im = quadrants(800, 600);
    DecodeOptions o;
    o.min_width = 100;
    o.min_height = 75;  // with margin 2: at least 200x150 → 1/4 scale gives 200x150
    const RgbImage d = decode_image(encode_jpeg(im, 90), "big.jpg", o);
    EXPECT_EQ(d.width, 200);
    EXPECT_EQ(d.height, 150);
}

// A smooth colour ramp: what lossy codecs keep well (random noise would not compress).
RgbImage ramp(int w, int h) {
    RgbImage im(w, h);
    for (int y = 0; y < h; ++y)
        for (int x = 0; x < w; ++x) {
            uint8_t* p = im.at(x, y);
            p[0] = static_cast<uint8_t>(255 * x / (w - 1));
            p[1] = static_cast<uint8_t>(255 * y / (h - 1));
            p[2] = static_cast<uint8_t>(128 + 100 * std::sin(0.1 * (x + y)));
        }
    return im;
}

TEST(Image, WebpWriterRoundTripsThroughOurDecoder) {
    const RgbImage noise = random_image(37, 21, 7);
    const std::string lossless = encode_webp(noise, 100);
    EXPECT_EQ(lossless.substr(0, 4), "RIFF");
    EXPECT_EQ(lossless.substr(8, 4), "WEBP");
    EXPECT_EQ(decode_image(lossless, "lossless.webp").pixels, noise.pixels);  // exact

    const RgbImage smooth = ramp(96, 64);
    const std::string lossy = encode_webp(smooth, 90);
    const RgbImage back = decode_image(lossy, "lossy.webp");
    EXPECT_LT(mean_abs_diff(back, smooth), 3.0);
    EXPECT_NE(back.pixels, smooth.pixels);                    // really the lossy path
    EXPECT_LT(encode_webp(smooth, 20).size(), lossy.size());  // quality is passed through

    test::TempDir dir;
    write_image(dir / "out.webp", smooth, 100);
    EXPECT_EQ(read_image(dir / "out.webp").pixels, smooth.pixels);
    EXPECT_THROW(write_image(dir / "out.gif", smooth), UsageError);
}

TEST(Image, ImageExtensionNamesFormats) {
    EXPECT_EQ(image_extension("png"), ".png");
    EXPECT_EQ(image_extension("JPEG"), ".jpg");
    EXPECT_EQ(image_extension("jpg"), ".jpg");
    EXPECT_EQ(image_extension("webp"), ".webp");
    EXPECT_THROW(image_extension("gif"), UsageError);
}

}  // namespace
}  // namespace test_image_local
}  // namespace dtune::io
