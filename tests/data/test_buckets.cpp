// Bucket math against SIMPLETUNER.md §3's worked examples, hand-computed intermediaries, and a
// property test over thousands of random sizes.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>

#include "data/buckets.h"
#include "support/test_support.h"

namespace dtune::data {
namespace test_buckets_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

BucketSettings area_1024(bool crop = false) {
    BucketSettings s;
    s.resolution_type = ResolutionType::kArea;
    s.resolution = pixel_edge_to_megapixels(1024);
    s.crop = crop;
    s.crop_aspect = CropAspect::kPreserve;
    s.crop_style = CropStyle::kCenter;
    return s;
}

BucketSettings pixel_1024() {
    BucketSettings s = area_1024();
    s.resolution_type = ResolutionType::kPixel;
    s.resolution = 1024;
    return s;
}

TEST(Buckets, PythonRounding) {
    EXPECT_DOUBLE_EQ(python_round(1920.0 / 1080, 2), 1.78);
    EXPECT_DOUBLE_EQ(python_round(0.125, 2), 0.12);  // exact tie → even
    EXPECT_DOUBLE_EQ(python_round(0.375, 2), 0.38);
    EXPECT_DOUBLE_EQ(python_round(2.675, 2), 2.67);  // 2.675 is 2.67499999... in binary
    EXPECT_EQ(round_to_multiple(32, 64), 64);        // round(0.5) = 0 → clamped to the multiple
    EXPECT_EQ(round_to_multiple(96, 64), 128);       // round(1.5) = 2
    EXPECT_EQ(round_to_multiple(160, 64), 128);      // round(2.5) = 2 (half to even)
    EXPECT_EQ(python_float_str(1.0), "1.0");
    EXPECT_EQ(python_float_str(1.75), "1.75");
    EXPECT_EQ(python_float_str(1.048576), "1.048576");
    EXPECT_EQ(AspectResolutionMap::file_name(1.048576), "aspect_resolution_map-1.048576.json");
}

struct Example {
    Size original;
    Size target;
    double bucket;
};

TEST(Buckets, WorkedExamplesAreaSDXL) {
    // SIMPLETUNER.md §3.2 table: pixel_area 1024 → 1.048576 MP, alignment 64, crop=false.
    const Example examples[] = {{{1920, 1080}, {1344, 768}, 1.75}, {{1080, 1920}, {768, 1344}, 0.57},
                                {{1500, 1000}, {1280, 832}, 1.54}, {{3000, 2000}, {1280, 832}, 1.54},
                                {{800, 1200}, {832, 1280}, 0.65},  {{2048, 512}, {2048, 512}, 4.0}};
    std::mt19937_64 rng(1);
    for (const auto& ex : examples) {
        SamplePlan p = plan_sample(area_1024(), ex.original, rng);
        EXPECT_EQ(p.target, ex.target) << ex.original.width << "x" << ex.original.height;
        EXPECT_DOUBLE_EQ(p.aspect, ex.bucket);
    }
}

TEST(Buckets, WorkedExamplesPixel) {
    std::mt19937_64 rng(1);
    SamplePlan p = plan_sample(pixel_1024(), {1920, 1080}, rng);
    EXPECT_EQ(p.target, (Size{1792, 1024}));
    EXPECT_DOUBLE_EQ(p.aspect, 1.75);
    // Hand-computed: H=1024, W=int(1024·1920/1080)=1820 (the exact aspect, not 1.78's 1822).
    EXPECT_EQ(p.intermediary, (Size{1820, 1024}));
    p = plan_sample(pixel_1024(), {1500, 1000}, rng);
    EXPECT_EQ(p.target, (Size{1536, 1024}));
    EXPECT_DOUBLE_EQ(p.aspect, 1.5);
}

// C: crop=false/preserve resize with the image's exact aspect, not the rounded one.
TEST(Buckets, IntermediaryKeepsTheExactAspect) {
    std::mt19937_64 rng(1);
    // 1920x1080 → target 1344x768; landscape: H_i = 768, W_i = int(768·1920/1080) = 1365 (the
    // rounded aspect 1.78 gave 1367, a 0.15% stretch).
    SamplePlan p = plan_sample(area_1024(), {1920, 1080}, rng);
    EXPECT_EQ(p.intermediary, (Size{1365, 768}));
    EXPECT_EQ(p.resize_size, p.intermediary);
    EXPECT_EQ(p.crop_top, 0);
    EXPECT_EQ(p.crop_left, (1365 - 1344) / 2);
    // 800x1200 → target 832x1280; portrait: W_i = 832, H_i = int(832·1.5) = 1248 < 1280, so
    // SimpleTuner grows: H_diff = 32, W_diff = int(32·800/1200) = 21 → 853x1280.
    p = plan_sample(area_1024(), {800, 1200}, rng);
    EXPECT_EQ(p.intermediary, (Size{853, 1280}));
    EXPECT_EQ(p.crop_top, 0);
    EXPECT_EQ(p.crop_left, 10);
}

// A: square crops resize with the aspect kept (short side to the square's edge), then crop.
TEST(Buckets, SquareCropResizesKeepingTheAspect) {
    BucketSettings s = area_1024(true);
    s.crop_aspect = CropAspect::kSquare;
    s.crop_style = CropStyle::kCorner;
    std::mt19937_64 rng(1);
    // SIMPLETUNER.md §3.2's table: 3000x2000 → 1536x1024, 1344x768 → 1792x1024, crop 1024x1024.
    SamplePlan p = plan_sample(s, {3000, 2000}, rng);
    EXPECT_EQ(p.target, (Size{1024, 1024}));
    EXPECT_DOUBLE_EQ(p.aspect, 1.0);
    EXPECT_EQ(p.intermediary, (Size{1536, 1024}));
    EXPECT_EQ(p.resize_size, (Size{1536, 1024}));
    p = plan_sample(s, {1344, 768}, rng);
    EXPECT_EQ(p.resize_size, (Size{1792, 1024}));  // was 1344x1024: 1.75 stretched to 1.31
    // A small image is brought up the same way; pixel resolution does the same.
    p = plan_sample(s, {600, 400}, rng);
    EXPECT_EQ(p.intermediary, (Size{1536, 1024}));
    BucketSettings px = pixel_1024();
    px.crop = true;
    px.crop_aspect = CropAspect::kSquare;
    p = plan_sample(px, {768, 1344}, rng);
    EXPECT_EQ(p.resize_size, (Size{1024, 1792}));
}

// D: with the downsample keys the pixels are resized to the downsample size, and the recorded
// intermediary (SDXL's original-size time id) is the calculator's, not the original size.
TEST(Buckets, DownsampleBeforeCrop) {
    BucketSettings s = area_1024(true);
    s.crop_aspect = CropAspect::kSquare;
    s.maximum_image_size = pixel_edge_to_megapixels(2048);
    s.target_downsample_size = pixel_edge_to_megapixels(1536);
    std::mt19937_64 rng(1);
    SamplePlan p = plan_sample(s, {6000, 4000}, rng);
    // Calculator at 2.359296 MP, aspect 1.5: edge 1536, W_t = rm(1536·√1.5 = 1881.2) = 1856,
    // H_t = rm(1254.1) = 1280; landscape: H_i = 1280, W_i = int(1280·1.5) = 1920.
    EXPECT_EQ(p.resize_size, (Size{1920, 1280}));
    EXPECT_EQ(p.target, (Size{1024, 1024}));
    EXPECT_EQ(p.intermediary, (Size{1536, 1024}));  // was 6000x4000
    // The quickstart's dataset: area 1.0, square, both keys 1.0 (SIMPLETUNER.md §3.2).
    BucketSettings q = area_1024(true);
    q.resolution = 1.0;
    q.crop_aspect = CropAspect::kSquare;
    q.maximum_image_size = 1.0;
    q.target_downsample_size = 1.0;
    p = plan_sample(q, {3000, 2000}, rng);
    EXPECT_EQ(p.intermediary, (Size{1536, 1024}));  // was 3000x2000
    EXPECT_EQ(p.resize_size, (Size{1536, 1024}));
}

// B: closest/random crop aspects keep the image's aspect and crop the bucket's shape out of it.
TEST(Buckets, ClosestCropAspectKeepsTheAspect) {
    BucketSettings s = area_1024(true);
    s.crop_aspect = CropAspect::kClosest;
    s.crop_aspect_buckets = {{0.75, {}}, {1.0, {}}, {1.5, {}}};
    std::mt19937_64 rng(1);
    SamplePlan p = plan_sample(s, {1920, 1080}, rng);  // 1.78 → closest 1.5
    EXPECT_EQ(p.target, (Size{1280, 832}));
    EXPECT_EQ(p.resize_size, (Size{1479, 832}));  // int(832·1920/1080); was 1280x832 (stretched)
    p = plan_sample(s, {1000, 1100}, rng);        // 0.91 → closest 1.0 → square
    EXPECT_EQ(p.target, (Size{1024, 1024}));
    // pixel 1024: 2048x512 → closest 2.0 → 2048x1024; SimpleTuner resizes to 4096x1024.
    BucketSettings px = pixel_1024();
    px.crop = true;
    px.crop_aspect = CropAspect::kClosest;
    px.crop_aspect_buckets = {{1.0, {}}, {1.5, {}}, {2.0, {}}};
    p = plan_sample(px, {2048, 512}, rng);
    EXPECT_EQ(p.target, (Size{2048, 1024}));
    EXPECT_EQ(p.resize_size, (Size{4096, 1024}));  // was 2048x1024
}

// F: random crops record the offsets actually used (SimpleTuner records the centre offsets).
TEST(Buckets, RandomCropRecordsTheOffsetsUsed) {
    BucketSettings s = area_1024(true);
    s.crop_aspect = CropAspect::kSquare;
    s.crop_style = CropStyle::kRandom;
    std::set<int> lefts;
    for (uint64_t seed = 0; seed < 20; ++seed) {
        std::mt19937_64 rng(seed);
        const SamplePlan p = plan_sample(s, {3000, 2000}, rng);
        ASSERT_EQ(p.resize_size, (Size{1536, 1024}));
        ASSERT_EQ(p.crop_top, 0);
        ASSERT_LE(p.crop_left, 1536 - 1024);
        lefts.insert(p.crop_left);
    }
    EXPECT_GT(lefts.size(), 10u);  // not the centre (256) every time
}

TEST(Buckets, ResolutionMapPinsFirstSeenSize) {
    test::TempDir dir;
    AspectResolutionMap map(1.048576);
    const auto first = size_by_pixel_area(1.78, 1.048576, {1920, 1080}, {}, &map);
    map.set(1.75, {1408, 768});  // pretend an earlier run stored a different shape for 1.75
    const auto pinned = size_by_pixel_area(1.78, 1.048576, {1920, 1080}, {}, &map);
    EXPECT_EQ(first.target, (Size{1344, 768}));
    EXPECT_EQ(pinned.target, (Size{1408, 768}));
    EXPECT_GE(pinned.intermediary.width, 1408);
    map.save(dir.path());
    AspectResolutionMap reloaded(1.048576);
    reloaded.load(dir.path());
    EXPECT_EQ(reloaded.get(1.75), (Size{1408, 768}));
    EXPECT_TRUE(std::filesystem::exists(dir / "aspect_resolution_map-1.048576.json"));
}

TEST(Buckets, Filters) {
    BucketSettings s = pixel_1024();
    s.minimum_image_size = 512;
    EXPECT_TRUE(resolution_filter_reason(s, {512, 900}).empty());
    EXPECT_FALSE(resolution_filter_reason(s, {511, 900}).empty());
    s = area_1024(true);
    s.crop_aspect = CropAspect::kSquare;
    s.minimum_image_size = 0.25;  // 250000 px and, for square crops, 500 px edges
    EXPECT_TRUE(resolution_filter_reason(s, {500, 500}).empty());
    EXPECT_FALSE(resolution_filter_reason(s, {499, 1000}).empty());
    EXPECT_FALSE(resolution_filter_reason(s, {400, 600}).empty());
    s.minimum_aspect_ratio = 0.5;
    s.maximum_aspect_ratio = 2.0;
    EXPECT_TRUE(bucket_in_aspect_range(s, 2.0));
    EXPECT_FALSE(bucket_in_aspect_range(s, 2.01));
    EXPECT_FALSE(bucket_in_aspect_range(s, 0.49));
}

// Invariants over thousands of random sizes and every mode.
TEST(Buckets, PropertyRandomSizes) {
    std::mt19937_64 rng(1234);
    std::uniform_int_distribution<int> side(256, 6000);
    std::uniform_real_distribution<double> log_aspect(std::log(0.25), std::log(4.0));
    const CropStyle styles[] = {CropStyle::kRandom, CropStyle::kCenter, CropStyle::kCorner};
    AspectResolutionMap map(1.048576);
    int checked = 0;
    for (int i = 0; i < 6000; ++i) {
        const int w = side(rng);
        const int h = std::clamp(static_cast<int>(w / std::exp(log_aspect(rng))), 64, 24000);
        BucketSettings s = (i % 2) ? area_1024(i % 3 == 0) : pixel_1024();
        s.crop_style = styles[i % 3];
        if (i % 5 == 0) s.crop_aspect = CropAspect::kSquare, s.crop = true;
        if (i % 7 == 0) {
            s.crop = true;
            s.crop_aspect = CropAspect::kClosest;
            s.crop_aspect_buckets = {{0.5, {}}, {0.75, {}}, {1.0, {}}, {1.33, {}}, {2.0, {}}};
        }
        const SamplePlan p = plan_sample(s, {w, h}, rng, (i % 2) ? &map : nullptr);
        ASSERT_EQ(p.target.width % 64, 0) << w << "x" << h;
        ASSERT_EQ(p.target.height % 64, 0) << w << "x" << h;
        ASSERT_GE(p.intermediary.width, p.target.width) << w << "x" << h;
        ASSERT_GE(p.intermediary.height, p.target.height) << w << "x" << h;
        ASSERT_GE(p.resize_size.width, p.target.width);
        ASSERT_GE(p.resize_size.height, p.target.height);
        ASSERT_GE(p.crop_top, 0);
        ASSERT_GE(p.crop_left, 0);
        ASSERT_LE(p.crop_top + p.target.height, p.resize_size.height);
        ASSERT_LE(p.crop_left + p.target.width, p.resize_size.width);
        ASSERT_DOUBLE_EQ(p.aspect,
                         p.aspect == 1.0 ? 1.0 : python_round(double(p.target.width) / p.target.height, 2));
        if (!s.crop || s.crop_aspect == CropAspect::kPreserve) {
            // The bucket keeps the image's shape within the 64-px rounding error.
            const double image_aspect = double(w) / h;
            const double target_aspect = double(p.target.width) / p.target.height;
            ASSERT_LT(std::abs(std::log(target_aspect / image_aspect)), 0.16) << w << "x" << h;
            // The intermediary keeps the original aspect (up to integer truncation and growth).
            const double inter_aspect = double(p.intermediary.width) / p.intermediary.height;
            ASSERT_LT(std::abs(std::log(inter_aspect / image_aspect)), 0.05) << w << "x" << h;
            ++checked;
        }
        // Area targets stay near the requested pixel count.
        if (s.resolution_type == ResolutionType::kArea && p.aspect != 1.0) {
            const double mp = double(p.target.width) * p.target.height / 1e6;
            ASSERT_NEAR(mp, 1.048576, 0.2) << w << "x" << h;
        }
    }
    EXPECT_GT(checked, 1000);
}

}  // namespace
}  // namespace test_buckets_local
}  // namespace dtune::data
