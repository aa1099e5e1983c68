// Per-draw and per-epoch sample variants (data/sample_variants.h): the mirrored crop coordinate
// checked on real pixels, plan_sample's split into choose + plan-for-aspect, and crop_aspect
// random's epoch plans (deterministic, independent of other images, fixed crop per aspect,
// weighted choice frequencies, different buckets across epochs, buckets outside the aspect range
// dropped every epoch as the bucket index drops them, the config check of an aspect list that lies
// wholly outside that range).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <random>
#include <set>

#include "core/error.h"
#include "core/thread_pool.h"
#include "data/bucket_index.h"
#include "data/dataset_buckets.h"
#include "data/sample_variants.h"
#include "data/sampler.h"
#include "data/storage.h"
#include "io/image.h"
#include "support/test_support.h"

namespace dtune::data {
namespace test_sample_variants_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

BucketSettings random_aspect(std::vector<CropAspectBucket> buckets) {
    BucketSettings s;
    s.resolution_type = ResolutionType::kPixel;
    s.resolution = 64;
    s.crop = true;
    s.crop_style = CropStyle::kRandom;
    s.crop_aspect = CropAspect::kRandom;
    s.crop_aspect_buckets = std::move(buckets);
    return s;
}

SamplePlan indexed(Size original) {
    SamplePlan p;
    p.original = original;
    return p;
}

TEST(SampleVariants, MirroredCropLeftByHand) {
    SamplePlan p;
    p.resize_size = {128, 64};
    p.target = {64, 64};
    p.crop_left = 10;
    EXPECT_EQ(mirrored_crop_left(p), 54);  // 128 - 10 - 64
    p.crop_left = 0;
    EXPECT_EQ(mirrored_crop_left(p), 64);
    p.crop_left = 64;
    EXPECT_EQ(mirrored_crop_left(p), 0);
}

// Cropping at (top, left) then mirroring gives the pixels of the mirrored image cropped at
// (top, mirrored_crop_left): the coordinate the time ids report is where the pixels really are.
TEST(SampleVariants, MirroredCropLeftMatchesMirroredPixels) {
    io::RgbImage im(37, 9);
    for (size_t k = 0; k < im.pixels.size(); ++k) im.pixels[k] = static_cast<uint8_t>((k * 7 + 3) % 251);
    const io::RgbImage mirrored = io::flip_horizontal(im);
    for (int left = 0; left + 16 <= 37; left += 5) {
        SamplePlan p;
        p.resize_size = {37, 9};
        p.target = {16, 8};
        p.crop_top = 1;
        p.crop_left = left;
        const io::RgbImage a = io::flip_horizontal(io::crop(im, 1, left, 16, 8));
        const io::RgbImage b = io::crop(mirrored, 1, mirrored_crop_left(p), 16, 8);
        EXPECT_EQ(a.pixels, b.pixels) << "left " << left;
    }
}

TEST(SampleVariants, PlanSampleIsChooseThenPlanForAspect) {
    std::mt19937_64 sizes(7);
    for (int i = 0; i < 500; ++i) {
        const Size original{int(64 + sizes() % 2000), int(64 + sizes() % 2000)};
        BucketSettings s = random_aspect({{0.5, {}}, {1.0, {}}, {1.5, {}}, {2.0, {}}});
        if (i % 2) s.crop_aspect = CropAspect::kClosest;
        if (i % 3 == 0) s.resolution_type = ResolutionType::kArea, s.resolution = 0.25;
        std::mt19937_64 a(i), b(i);
        const SamplePlan whole = plan_sample(s, original, a);
        const double aspect = choose_crop_aspect(s, original, b);
        const SamplePlan split = plan_sample_for_aspect(s, original, aspect, b);
        EXPECT_EQ(whole.target, split.target);
        EXPECT_EQ(whole.intermediary, split.intermediary);
        EXPECT_EQ(whole.resize_size, split.resize_size);
        EXPECT_EQ(whole.crop_top, split.crop_top);
        EXPECT_EQ(whole.crop_left, split.crop_left);
        EXPECT_EQ(whole.aspect, split.aspect);
    }
}

TEST(SampleVariants, EpochPlansAreDeterministicAndChangeAcrossEpochs) {
    const BucketSettings s = random_aspect({{0.5, {}}, {1.0, {}}, {2.0, {}}});
    std::map<std::string, SamplePlan> images;
    for (int i = 0; i < 40; ++i) images["img" + std::to_string(i)] = indexed({300 + 7 * i, 310 - 3 * i});
    const AspectResolutionMap pins(0);
    const EpochBuckets e0 = rebucket_epoch(s, images, 42, "ds", 0, pins);
    const EpochBuckets again = rebucket_epoch(s, images, 42, "ds", 0, pins);
    const EpochBuckets e1 = rebucket_epoch(s, images, 42, "ds", 1, pins);
    EXPECT_EQ(e0.buckets, again.buckets);
    int moved = 0;
    for (const auto& [path, plan] : e0.plans) {
        EXPECT_EQ(plan.target, again.plans.at(path).target);
        EXPECT_EQ(plan.crop_left, again.plans.at(path).crop_left);
        moved += plan.aspect != e1.plans.at(path).aspect;
    }
    EXPECT_GT(moved, 10);  // 2/3 of 40 expected to change bucket
    EXPECT_GE(e0.buckets.size(), 2u);
    size_t total = 0;
    for (const auto& [key, paths] : e1.buckets) {
        total += paths.size();
        EXPECT_TRUE(std::is_sorted(paths.begin(), paths.end()));
        for (const auto& p : paths) EXPECT_EQ(bucket_key(e1.plans.at(p).aspect), key);
    }
    EXPECT_EQ(total, images.size());  // every image once per epoch
    // Another seed or dataset gives another layout.
    EXPECT_NE(rebucket_epoch(s, images, 43, "ds", 0, pins).buckets, e0.buckets);
    EXPECT_NE(rebucket_epoch(s, images, 42, "other", 0, pins).buckets, e0.buckets);
}

TEST(SampleVariants, OneImageInOneAspectIsAlwaysTheSameCropAndIndependentOfOthers) {
    const BucketSettings s = random_aspect({{0.5, {}}, {1.0, {}}, {2.0, {}}});
    const SamplePlan im = indexed({500, 420});
    const AspectResolutionMap pins(0);
    std::map<std::string, SamplePlan> first;  // geometry → first plan
    for (int64_t epoch = 0; epoch < 30; ++epoch) {
        const SamplePlan p = epoch_plan(s, im, 9, "ds", "a.png", epoch, pins);
        auto [it, fresh] = first.emplace(geometry_key(p), p);
        EXPECT_EQ(it->second.crop_left, p.crop_left) << "epoch " << epoch;
        EXPECT_EQ(it->second.crop_top, p.crop_top) << "epoch " << epoch;
        EXPECT_EQ(it->second.target, p.target);
    }
    // 30 epochs visit every aspect; for this near-square image 0.5 and 1.0 both end in the 1.0
    // bucket with the same resize size (76x64: the image's own aspect, whatever aspect was drawn),
    // so two geometries in two buckets.
    EXPECT_EQ(first.size(), 2u);
    std::set<double> buckets;
    for (const auto& [key, p] : first) buckets.insert(p.aspect);
    EXPECT_EQ(buckets, (std::set<double>{1.0, 2.0}));
    // The same image planned inside a larger set gets the same plan.
    std::map<std::string, SamplePlan> many{{"a.png", im}, {"b.png", indexed({90, 200})}};
    for (int64_t epoch = 0; epoch < 5; ++epoch) {
        const SamplePlan alone = epoch_plan(s, im, 9, "ds", "a.png", epoch, pins);
        const SamplePlan in_set = rebucket_epoch(s, many, 9, "ds", epoch, pins).plans.at("a.png");
        EXPECT_EQ(alone.target, in_set.target);
        EXPECT_EQ(alone.crop_left, in_set.crop_left);
    }
}

TEST(SampleVariants, WeightedAspectsFollowTheirWeights) {
    const BucketSettings s = random_aspect({{0.5, 0.8}, {2.0, 0.2}});
    const AspectResolutionMap pins(0);
    int wide = 0;
    const int n = 4000;
    for (int i = 0; i < n; ++i)
        wide +=
            epoch_plan(s, indexed({400, 400}), 1, "ds", "p" + std::to_string(i % 200), i / 200, pins).aspect >
            1.0;
    // Binomial(4000, 0.2): sd ≈ 25, so ±100 is 4 sd.
    EXPECT_NEAR(wide, 0.2 * n, 100);
}

TEST(SampleVariants, SeedsDifferPerPathEpochAndDataset) {
    const uint64_t a = sample_epoch_seed(1, "ds", "x", 0);
    EXPECT_EQ(a, sample_epoch_seed(1, "ds", "x", 0));
    EXPECT_NE(a, sample_epoch_seed(1, "ds", "x", 1));
    EXPECT_NE(a, sample_epoch_seed(1, "ds", "y", 0));
    EXPECT_NE(a, sample_epoch_seed(1, "dt", "x", 0));
    EXPECT_NE(a, sample_epoch_seed(2, "ds", "x", 0));
}

TEST(SampleVariants, RandomFlipKeyFallsBackToConfigJson) {
    const nlohmann::json entries = nlohmann::json::array(
        {{{"id", "a"}, {"instance_data_dir", "/a"}},
         {{"id", "b"}, {"instance_data_dir", "/b"}, {"random_flip", false}},
         {{"id", "c"}, {"instance_data_dir", "/c"}, {"random_flip", true}},
         {{"id", "text"}, {"dataset_type", "text_embeds"}, {"default", true}, {"cache_dir", "/t"}}});
    for (const bool global : {false, true}) {
        GlobalDataArgs args;
        args.random_flip = global;
        const auto cfg = parse_data_backend_config(entries, args);
        EXPECT_EQ(cfg.datasets.at(0).random_flip, global);
        EXPECT_FALSE(cfg.datasets.at(1).random_flip);
        EXPECT_TRUE(cfg.datasets.at(2).random_flip);
        EXPECT_TRUE(cfg.warnings.empty()) << cfg.warnings.front();  // a known key, no warning
    }
    auto bad = entries;
    bad[0]["random_flip"] = "yes";
    EXPECT_THROW(parse_data_backend_config(bad, GlobalDataArgs{}), UsageError);
}

TEST(SampleVariants, EpochBucketsOutsideTheAspectRangeAreDropped) {
    // Real files through the bucket index, then eight epochs of draws: no served bucket is ever
    // outside [0.75, 1.5]; every image passing the per-image filters is a candidate each epoch,
    // including those the index's own draw put out of range.
    test::TempDir dir;
    for (int i = 0; i < 12; ++i) {
        io::RgbImage im(i % 2 ? 300 : 200, i % 2 ? 200 : 300);
        io::write_image(dir / ("img" + std::to_string(i) + ".png"), im);
    }
    DatasetConfig c;
    c.id = c.cache_file_suffix = "pics";
    c.instance_data_dir = dir.path().string();
    c.resolution_type = ResolutionType::kPixel;
    c.resolution = 64;
    c.crop = true;
    c.crop_aspect = CropAspect::kRandom;
    c.crop_aspect_buckets = {{0.5, {}}, {1.0, {}}, {2.0, {}}};
    c.minimum_aspect_ratio = 0.75;
    c.maximum_aspect_ratio = 1.5;
    const BucketSettings s = BucketSettings::from(c);
    LocalStorage storage;
    ThreadPool pool(2);
    // The draws hash the image paths, which hold this run's temporary directory: with some
    // directories seed 42 puts all twelve at 1.0. Take the first seed whose draw sends some images
    // to 0.5 or 2.0, the case this test is about.
    BucketIndex index;
    uint64_t seed = 42;
    for (; seed < 42 + 32; ++seed) {
        index = BucketIndex();
        EXPECT_EQ(index.refresh(storage, c, s, pool, nullptr, seed), 12);
        if (!index.out_of_range.empty()) break;
    }
    for (const auto& [key, paths] : index.buckets) EXPECT_EQ(key, "1.0");
    ASSERT_FALSE(index.out_of_range.empty()) << "no seed up to " << seed << " drew outside the range";
    EXPECT_EQ(index.sample_count() + int64_t(index.out_of_range.size()), 12);
    EXPECT_EQ(index.skipped.size(), index.out_of_range.size());
    // Persisted with their metadata: a reload knows them and a refresh does not rescan them.
    index.save(storage, c);
    BucketIndex again;
    ASSERT_TRUE(again.load(storage, c));
    EXPECT_EQ(again.buckets, index.buckets);
    EXPECT_EQ(again.out_of_range.size(), index.out_of_range.size());
    EXPECT_EQ(again.refresh(storage, c, s, pool, nullptr, seed), 0);
    EXPECT_EQ(again.skipped.size(), index.out_of_range.size());

    const RedrawCandidates candidates = redraw_candidates(again, c);
    EXPECT_EQ(candidates.plans.size(), 12u);
    std::map<std::string, SamplePlan> indexed;
    for (const auto& [key, paths] : candidates.buckets)
        for (const auto& p : paths) indexed.emplace(p, candidates.plans.at(p));
    std::set<std::string> trained;
    for (int64_t epoch = 0; epoch < 8; ++epoch) {
        const EpochBuckets e = rebucket_epoch(s, indexed, seed, "pics", epoch, AspectResolutionMap(0));
        size_t n = 0;
        for (const auto& [key, paths] : e.buckets) {
            EXPECT_TRUE(bucket_in_aspect_range(s, std::stod(key))) << key << " epoch " << epoch;
            for (const auto& p : paths) EXPECT_EQ(bucket_key(e.plans.at(p).aspect), key);
            trained.insert(paths.begin(), paths.end());
            n += paths.size();
        }
        for (const auto& [key, paths] : e.dropped) {
            EXPECT_FALSE(bucket_in_aspect_range(s, std::stod(key))) << key;
            for (const auto& p : paths) EXPECT_EQ(e.plans.count(p), 0u) << p;
            n += paths.size();
        }
        EXPECT_EQ(n, 12u);  // every candidate drawn once, kept or dropped
    }
    int redrawn = 0;
    for (const auto& [path, plan] : index.out_of_range) redrawn += trained.count(path);
    EXPECT_GT(redrawn, 0);
    // max_num_samples counts the candidates, set-aside images included; each file keeps one reason.
    BucketIndex limited = again;
    c.max_num_samples = 8;
    limit_samples(limited, c);
    EXPECT_EQ(redraw_candidates(limited, c).plans.size(), 8u);
    std::map<std::string, std::string> reasons(limited.skipped.begin(), limited.skipped.end());
    EXPECT_EQ(reasons.size(), limited.skipped.size());
    int beyond = 0;
    for (const auto& [path, reason] : reasons) beyond += reason.rfind("beyond max_num_samples", 0) == 0;
    EXPECT_EQ(beyond, 4);
    c.max_num_samples.reset();
    // Without crop_aspect random the index's draw is final: the set-aside images stay out.
    c.crop_aspect = CropAspect::kClosest;
    EXPECT_EQ(redraw_candidates(again, c).plans.size(), size_t(again.sample_count()));
}

TEST(SampleVariants, AspectBucketsAllOutsideTheRangeAreAConfigError) {
    auto load = [](nlohmann::json extra) {
        nlohmann::json image = {
            {"id", "pics"}, {"instance_data_dir", "/pics"}, {"crop", true}, {"crop_aspect", "random"}};
        image.update(extra);
        return parse_data_backend_config(
            nlohmann::json::array(
                {image,
                 {{"id", "text"}, {"dataset_type", "text_embeds"}, {"default", true}, {"cache_dir", "/t"}}}),
            GlobalDataArgs{});
    };
    auto error_of = [&](nlohmann::json extra) -> std::string {
        try {
            load(std::move(extra));
        } catch (const UsageError& e) {
            return e.what();
        }
        return "";
    };
    const std::string e = error_of(
        {{"crop_aspect_buckets", {0.5, 2.0}}, {"minimum_aspect_ratio", 0.75}, {"maximum_aspect_ratio", 1.5}});
    for (const char* part : {"dataset 'pics'", "crop_aspect_buckets", "minimum_aspect_ratio 0.75",
                             "maximum_aspect_ratio 1.5", "add an aspect within"})
        EXPECT_NE(e.find(part), std::string::npos) << part << " not in: " << e;
    // One bound is enough; weighted lists and crop_aspect closest are checked alike.
    EXPECT_NE(error_of({{"crop_aspect_buckets", {0.5, 0.6}}, {"minimum_aspect_ratio", 0.75}}), "");
    EXPECT_NE(error_of({{"crop_aspect_buckets", {{{"aspect", 2.0}, {"weight", 1.0}}}},
                        {"maximum_aspect_ratio", 1.5}}),
              "");
    EXPECT_NE(
        error_of({{"crop_aspect", "closest"}, {"crop_aspect_buckets", {3.0}}, {"maximum_aspect_ratio", 2.0}}),
        "");
    // One aspect inside is enough, and without crop the list is not used.
    EXPECT_EQ(error_of({{"crop_aspect_buckets", {0.5, 1.0, 2.0}},
                        {"minimum_aspect_ratio", 0.75},
                        {"maximum_aspect_ratio", 1.5}}),
              "");
    EXPECT_EQ(error_of({{"crop", false},
                        {"crop_aspect_buckets", {0.5, 2.0}},
                        {"minimum_aspect_ratio", 0.75},
                        {"maximum_aspect_ratio", 1.5}}),
              "");
}

TEST(SampleVariants, RebucketingFollowsTheDatasetSettings) {
    DatasetConfig c;
    EXPECT_FALSE(rebuckets_per_epoch(c));
    c.crop = true;
    c.crop_aspect = CropAspect::kRandom;
    EXPECT_TRUE(rebuckets_per_epoch(c));
    c.crop = false;  // without crop the aspect is the image's own
    EXPECT_FALSE(rebuckets_per_epoch(c));
}

}  // namespace
}  // namespace test_sample_variants_local
}  // namespace dtune::data
