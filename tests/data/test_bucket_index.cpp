// Discovery over a real folder of generated images: buckets, skipped files with reasons,
// persistence next to the data, and refresh picking up new and removed files only.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/fs.h"
#include "core/thread_pool.h"
#include "data/bucket_index.h"
#include "data/dataset_buckets.h"

#include <set>
#include "data/storage.h"
#include "io/image.h"
#include "support/test_support.h"

namespace dtune::data {
namespace test_bucket_index_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

void write_png(const std::filesystem::path& p, int w, int h) {
    io::RgbImage im(w, h);
    io::write_image(p, im);
}

DatasetConfig config_for(const std::filesystem::path& dir) {
    DatasetConfig c;
    c.id = "pics";
    c.cache_file_suffix = "pics";
    c.instance_data_dir = dir.string();
    c.resolution = pixel_edge_to_megapixels(1024);
    c.resolution_type = ResolutionType::kArea;
    c.minimum_image_size = 0.25;
    c.crop_style = CropStyle::kCenter;
    return c;
}

TEST(BucketIndex, DiscoverPersistRefresh) {
    test::TempDir dir;
    write_png(dir / "wide.png", 1920, 1080);
    write_png(dir / "tall.png", 1080, 1920);
    std::filesystem::create_directories(dir / "sub");
    write_png(dir / "sub" / "wide2.png", 3840, 2160);
    write_png(dir / "tiny.png", 300, 200);                       // under 0.25 MP
    test::write_bytes(dir / "broken.jpg", "not really a jpeg");  // unreadable
    test::write_bytes(dir / "notes.txt", "ignored");
    DatasetConfig c = config_for(dir.path());
    BucketSettings s = BucketSettings::from(c);
    LocalStorage storage;
    ThreadPool pool(2);
    AspectResolutionMap map(c.resolution);

    BucketIndex index;
    EXPECT_EQ(index.refresh(storage, c, s, pool, &map, 42), 5);
    EXPECT_EQ(index.sizes(), (std::map<std::string, int64_t>{{"0.57", 1}, {"1.75", 2}}));
    ASSERT_EQ(index.skipped.size(), 2u);
    EXPECT_EQ(index.stats.error, 1);
    EXPECT_EQ(index.stats.too_small, 1);
    const std::string wide = (dir / "wide.png").string();
    EXPECT_EQ(index.metadata.at(wide).target, (Size{1344, 768}));
    EXPECT_EQ(index.metadata.at(wide).intermediary, (Size{1365, 768}));  // int(768·1920/1080)

    index.save(storage, c);
    const auto doc = nlohmann::json::parse(fs::read_file(dir / "aspect_ratio_bucket_indices_pics.json"));
    EXPECT_EQ(doc["aspect_ratio_bucket_indices"]["1.75"].size(), 2u);
    const auto meta = nlohmann::json::parse(fs::read_file(dir / "aspect_ratio_bucket_metadata_pics.json"));
    EXPECT_EQ(meta[wide]["original_size"], nlohmann::json({1920, 1080}));
    EXPECT_EQ(meta[wide]["target_size"], nlohmann::json({1344, 768}));
    EXPECT_EQ(meta[wide]["intermediary_size"], nlohmann::json({1365, 768}));
    EXPECT_EQ(meta[wide]["crop_coordinates"], nlohmann::json({0, 10}));  // centre: (1365-1344)/2
    EXPECT_DOUBLE_EQ(meta[wide]["aspect_ratio"].get<double>(), 1.75);
    const auto skipped = nlohmann::json::parse(fs::read_file(dir / "skipped_files_pics.json"));
    ASSERT_EQ(skipped.size(), 2u);
    EXPECT_NE(skipped[(dir / "broken.jpg").string()].get<std::string>().find("broken.jpg"),
              std::string::npos);
    EXPECT_NE(skipped[(dir / "tiny.png").string()].get<std::string>().find("too small"), std::string::npos);

    // Restart: load, then one file removed and one added → only the new one is scanned.
    BucketIndex again;
    ASSERT_TRUE(again.load(storage, c));
    EXPECT_EQ(again.sample_count(), 3);
    std::filesystem::remove(dir / "tall.png");
    write_png(dir / "square.png", 1024, 1024);
    EXPECT_EQ(again.refresh(storage, c, s, pool, &map, 42), 3);  // square + the two skipped ones
    EXPECT_EQ(again.sizes(), (std::map<std::string, int64_t>{{"1.0", 1}, {"1.75", 2}}));
    EXPECT_EQ(again.stats.not_found, 1);

    // Changed bucketing settings invalidate the stored metadata.
    again.save(storage, c);
    DatasetConfig cropped = c;
    cropped.crop = true;
    BucketIndex stale;
    EXPECT_FALSE(stale.load(storage, cropped));
    EXPECT_TRUE(stale.load(storage, c));
}

// Metadata written with the old geometry (before SimpleTuner bc8e6ab's: stretched resizes, the
// rounded aspect) carries config_version 2 and is rebuilt, not trusted.
TEST(BucketIndex, MetadataOfTheOldGeometryIsRebuilt) {
    test::TempDir dir;
    write_png(dir / "wide.png", 1344, 768);
    DatasetConfig c = config_for(dir.path());
    c.crop = true;
    c.crop_aspect = CropAspect::kSquare;
    BucketSettings s = BucketSettings::from(c);
    LocalStorage storage;
    ThreadPool pool(2);
    AspectResolutionMap map(c.resolution);
    BucketIndex index;
    index.refresh(storage, c, s, pool, &map, 42);
    index.save(storage, c);
    const auto path = dir / "aspect_ratio_bucket_indices_pics.json";
    auto doc = nlohmann::json::parse(fs::read_file(path));
    ASSERT_TRUE(BucketIndex().load(storage, c));
    doc["config"]["config_version"] = 2;
    fs::write_file_atomic(path, doc.dump());
    EXPECT_FALSE(BucketIndex().load(storage, c));
}

TEST(BucketIndex, HeaderScanListsFailures) {
    test::TempDir dir;
    write_png(dir / "a.png", 10, 20);
    test::write_bytes(dir / "b.png", "\x89PNG\r\n\x1a\n");  // signature only
    ThreadPool pool(2);
    HeaderScan scan = scan_image_headers({(dir / "a.png").string(), (dir / "b.png").string()}, pool, false);
    ASSERT_EQ(scan.images.size(), 1u);
    EXPECT_EQ(scan.images[0].second, (Size{10, 20}));
    ASSERT_EQ(scan.failed.size(), 1u);
    EXPECT_NE(scan.failed[0].second.find("b.png"), std::string::npos);
}

}  // namespace
}  // namespace test_bucket_index_local
}  // namespace dtune::data

namespace dtune::data {
namespace test_bucket_index_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

TEST(DatasetBuckets, ConfigToRankShards) {
    test::TempDir data, out;
    for (int i = 0; i < 9; ++i) write_png(data / ("w" + std::to_string(i) + ".png"), 1920, 1080);
    for (int i = 0; i < 4; ++i) write_png(data / ("s" + std::to_string(i) + ".png"), 800, 800);
    DatasetConfig c = config_for(data.path());
    c.train_batch_size = 2;
    BucketBuildOptions o;
    o.output_dir = out.path().string();
    o.seed = 7;
    o.world_size = 2;
    ThreadPool pool(2);
    std::set<std::string> seen;
    int64_t held = 0;
    for (int rank = 0; rank < 2; ++rank) {
        o.rank = rank;
        o.write_index = rank == 0;  // rank 1 reads what rank 0 wrote
        const DatasetBuckets b = build_dataset_buckets(c, o, pool);
        EXPECT_EQ(b.newly_scanned, rank == 0 ? 13 : 0);
        EXPECT_EQ(b.plan.effective_batch_size, 4);
        for (const auto& [key, list] : b.local) {
            held += static_cast<int64_t>(list.size());
            seen.insert(list.begin(), list.end());
        }
    }
    EXPECT_EQ(seen.size(), 13u);  // every sample reaches some rank
    EXPECT_EQ(held, 14);          // 9 → 5 + 5 with one padded duplicate; 4 → 2 + 2
    EXPECT_TRUE(std::filesystem::exists(out / "aspect_resolution_map-1.048576.json"));
    // max_num_samples keeps a deterministic subset and reports the rest.
    c.max_num_samples = 10;
    o.allow_dataset_oversubscription = true;  // the subset may leave a bucket under the EBS of 4
    o.rank = 0;
    o.write_index = true;
    const DatasetBuckets limited = build_dataset_buckets(c, o, pool);
    EXPECT_EQ(limited.index.sample_count(), 10);
    EXPECT_EQ(limited.plan.total_samples, 10);
    EXPECT_EQ(limited.plan.excluded_before_bucketing.at("removed by max_num_samples 10"), 3);
    EXPECT_NE(limited.plan.report().find("not bucketed: 3 file(s) removed by max_num_samples 10"),
              std::string::npos);
}

}  // namespace
}  // namespace test_bucket_index_local
}  // namespace dtune::data
