// DatasetBatchSource on generated images with counting stand-in encoders (no model): buckets of
// two shapes, caches written then reused (encoder calls counted), a corrupted entry rebuilt with a
// warning naming it, parquet captions against the fixture's expected rows, SDXL time ids against
// hand-computed geometry, resume equality with the prefetch thread running ahead, the same batches
// with and without prefetching, the effective-batch-size error and two ranks in one process.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <memory>
#include <set>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "data/sampler.h"
#include "io/image.h"
#include "support/test_support.h"
#include "train/dataset_source.h"
#include "train/dataset_source_test_util.h"

namespace dtune::train {
namespace test_dataset_source_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using namespace test_util;
namespace stdfs = std::filesystem;

TEST(DatasetSource, BucketsOfSeveralShapesAndCachesReusedOnTheSecondRun) {
    Workspace s;
    auto c1 = std::make_shared<Counters>();
    std::vector<TrainBatch> first;
    {
        DatasetBatchSource src(s.options(), fake_encoders(c1));
        EXPECT_EQ(c1->vae_images, 16);
        EXPECT_EQ(c1->vae_calls, 4);       // 8 per shape in vae_batch_size 4
        EXPECT_EQ(c1->text_captions, 17);  // 16 filenames + ""
        EXPECT_TRUE(src.vae_released());
        EXPECT_TRUE(src.text_encoder_released());
        EXPECT_EQ(src.batches_per_epoch(), 8);
        auto g = unused_generator();
        std::set<std::vector<int64_t>> shapes;
        for (int i = 0; i < 8; ++i) {
            TrainBatch b = src.next(g);
            shapes.insert(b.latents.sizes().vec());
            ASSERT_EQ(b.latents.size(0), 2);
            EXPECT_EQ(b.cond.at("prompt_embeds").sizes(), (at::IntArrayRef{2, 77, 8}));
            EXPECT_EQ(b.cond.at("time_ids").sizes(), (at::IntArrayRef{2, 6}));
            first.push_back(std::move(b));
        }
        EXPECT_EQ(shapes, (std::set<std::vector<int64_t>>{{2, 4, 8, 16}, {2, 4, 16, 8}}));
    }
    EXPECT_EQ(count_files(s.dir / "vae"), 16);
    EXPECT_EQ(count_files(s.dir / "text"), 17);

    auto c2 = std::make_shared<Counters>();
    DatasetBatchSource again(s.options(), fake_encoders(c2));
    EXPECT_EQ(c2->vae_calls, 0);
    EXPECT_EQ(c2->text_calls, 0);
    EXPECT_EQ(again.cache_reports().at(0).latents.reused, 16);
    auto g = unused_generator();
    for (const auto& expected : first) {
        TrainBatch b = again.next(g);
        EXPECT_EQ(b.paths, expected.paths);
        EXPECT_TRUE(at::equal(b.latents, expected.latents));
        EXPECT_TRUE(at::equal(b.cond.at("prompt_embeds"), expected.cond.at("prompt_embeds")));
    }
    EXPECT_EQ(c2->vae_calls, 0);
}

// A bucket with fewer images than one batch is pruned and never served, so its images are never
// encoded. Before: a lone 20000x10 image (a 2000:1 bucket of its own) was resized to 128000x64 and
// sent through the VAE. The VAE is still released after caching (every served latent is on disk).
TEST(DatasetSource, PrunedBucketIsNeverEncoded) {
    Workspace s(4, 0);  // four 256x128 images: one bucket, two batches of 2
    write_png(s.dir / "images" / "strip.png", 20000, 10, 1);
    auto c = std::make_shared<Counters>();
    DatasetBatchSource src(s.options(), fake_encoders(c));
    EXPECT_EQ(src.batches_per_epoch(), 2);
    EXPECT_EQ(c->vae_images, 4);
    EXPECT_EQ(count_files(s.dir / "vae"), 4);
    EXPECT_TRUE(src.vae_released());
}

TEST(DatasetSource, CorruptedLatentEntryIsRebuiltWithAWarningNamingIt) {
    Workspace s;
    { DatasetBatchSource src(s.options(), fake_encoders(std::make_shared<Counters>())); }
    stdfs::path victim;
    for (const auto& e : stdfs::recursive_directory_iterator(s.dir / "vae"))
        if (e.path().extension() == ".safetensors") victim = e.path();
    ASSERT_FALSE(victim.empty());
    std::string bytes = fs::read_file(victim);
    bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x5a);
    fs::write_file_atomic(victim, bytes);

    const auto log_file = s.dir / "log.txt";
    log::set_file(log_file);
    auto c = std::make_shared<Counters>();
    { DatasetBatchSource src(s.options(), fake_encoders(c)); }
    log::set_file({});
    EXPECT_EQ(c->vae_images, 1);
    const std::string log = fs::read_file(log_file);
    EXPECT_NE(log.find(victim.string()), std::string::npos) << log;
    EXPECT_NE(log.find("corrupt"), std::string::npos) << log;
}

TEST(DatasetSource, ParquetCaptionsComeFromTheTable) {
    test::TempDir dir;
    const auto images = dir / "images";
    stdfs::create_directories(images);
    // The fixture's first rows: filename → caption (row 0 has a null caption).
    std::map<std::string, nlohmann::json> expected;
    std::ifstream rows(test::fixtures_dir() / "parquet" / "expected_rows.jsonl");
    std::string line;
    for (int i = 0; i < 9 && std::getline(rows, line); ++i) {
        const auto row = nlohmann::json::parse(line);
        expected[row.at("filename").get<std::string>()] = row.at("caption");
        // 64×64 files: their buckets must come from the table's width/height, not the headers.
        write_png(images / row.at("filename").get<std::string>(), 64, 64, i);  // PNG bytes, .jpg name
    }
    const nlohmann::json backends = nlohmann::json::array(
        {{{"id", "pq"},
          {"type", "local"},
          {"instance_data_dir", images.string()},
          {"resolution", 64},
          {"resolution_type", "pixel"},
          {"caption_strategy", "parquet"},
          {"metadata_backend", "parquet"},
          {"parquet",
           {{"path", (test::fixtures_dir() / "parquet" / "zstd_dict_v2.parquet").string()},
            {"filename_column", "filename"},
            {"caption_column", "caption"},
            {"width_column", "width"},
            {"height_column", "height"},
            {"identifier_includes_extension", true}}},
          {"cache_dir_vae", (dir / "vae").string()}},
         {{"id", "text"},
          {"dataset_type", "text_embeds"},
          {"default", true},
          {"cache_dir", (dir / "text").string()}}});
    fs::write_file_atomic(dir / "mdb.json", backends.dump());
    DatasetSourceOptions o;
    o.data_backend_config = dir / "mdb.json";
    o.global.output_dir = (dir / "out").string();
    o.train_batch_size = o.global.train_batch_size = 1;
    o.show_progress = false;
    DatasetBatchSource src(o, fake_encoders(std::make_shared<Counters>()));
    EXPECT_EQ(src.batches_per_epoch(), 8);  // 8 captioned images, the captionless one left out
    auto g = unused_generator();
    std::set<std::string> seen;
    for (int i = 0; i < 8; ++i) {
        const TrainBatch b = src.next(g);
        const std::string name = stdfs::path(b.paths.at(0)).filename().string();
        ASSERT_TRUE(expected.at(name).is_string()) << name;
        EXPECT_EQ(b.captions.at(0), expected.at(name).get<std::string>());
        seen.insert(name);
        if (name == "img_00001.jpg") {
            // The table says 768×1344: aspect round(768/1344, 2) = 0.57, width 64, height
            // 64 / 0.57 = 112.3 → nearest multiple of 64 = 128; the file itself is 64×64.
            EXPECT_EQ(b.latents.sizes(), (at::IntArrayRef{1, 4, 16, 8}));
            EXPECT_EQ(b.cond.at("time_ids")[0][4].item<float>(), 128.f);
            EXPECT_EQ(b.cond.at("time_ids")[0][5].item<float>(), 64.f);
        }
    }
    EXPECT_EQ(seen.size(), 8u);
    EXPECT_EQ(seen.count("img_00000.jpg"), 0u);
}

TEST(DatasetSource, TimeIdsAreTheBucketGeometry) {
    // 256×128 at 64 px: resized to 128×64 (the "original" SDXL size), then either kept whole
    // (target 128×64) or centre-cropped square (target 64×64 from left (128 − 64) / 2 = 32).
    for (const bool crop : {false, true}) {
        Workspace s(4, 0);
        if (crop) {
            s.entry["crop"] = true;
            s.entry["crop_style"] = "center";
            s.entry["crop_aspect"] = "square";
        }
        DatasetBatchSource src(s.options(), fake_encoders(std::make_shared<Counters>()));
        auto g = unused_generator();
        const TrainBatch b = src.next(g);
        const std::vector<float> want =
            crop ? std::vector<float>{64, 128, 0, 32, 64, 64} : std::vector<float>{64, 128, 0, 0, 64, 128};
        for (int64_t i = 0; i < 2; ++i)
            EXPECT_TRUE(at::equal(b.cond.at("time_ids")[i], at::tensor(want))) << b.cond.at("time_ids");
        EXPECT_EQ(b.latents.size(2) * 8, static_cast<int64_t>(want[4]));
        EXPECT_EQ(b.latents.size(3) * 8, static_cast<int64_t>(want[5]));
    }
}

TEST(DatasetSource, ResumeContinuesWithTheExactNextBatchWhilePrefetching) {
    Workspace s;
    s.entry["caption_strategy"] = "textfile";  // several captions per image: the per-sample pick
    for (const auto& e : stdfs::directory_iterator(s.dir / "images")) {
        auto txt = e.path();
        fs::write_file_atomic(txt.replace_extension(".txt"),
                              "first caption\nsecond caption\nthird caption\n");
    }
    auto run = [&](int prefetch, int take, const nlohmann::json* resume, nlohmann::json* state_at,
                   int state_after) {
        DatasetBatchSource src(s.options(2, prefetch), fake_encoders(std::make_shared<Counters>()));
        if (resume) src.load_state(*resume);
        auto g = unused_generator();
        std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> out;
        for (int i = 0; i < take; ++i) {
            const TrainBatch b = src.next(g);
            out.emplace_back(b.paths, b.captions);
            if (state_at && i + 1 == state_after) *state_at = src.state();
        }
        return out;
    };
    nlohmann::json mid;
    const auto straight = run(4, 20, nullptr, &mid, 11);  // crosses the epoch end (8 per epoch)
    const auto resumed = run(4, 9, &mid, nullptr, 0);
    ASSERT_EQ(resumed.size(), 9u);
    for (size_t i = 0; i < resumed.size(); ++i) EXPECT_EQ(resumed[i], straight[11 + i]) << i;
    const auto sync = run(0, 20, nullptr, nullptr, 0);
    EXPECT_EQ(sync, straight);  // timing-independent: no prefetch gives the same batches
    std::set<std::string> captions;
    for (const auto& [paths, caps] : straight) captions.insert(caps.begin(), caps.end());
    EXPECT_EQ(captions.size(), 3u);  // every candidate caption gets picked somewhere
}

TEST(DatasetSource, VaeCacheDisableEncodesEveryBatchAndOndemandStoresOnFirstUse) {
    for (const char* mode : {"vae_cache_disable", "vae_cache_ondemand"}) {
        Workspace s;
        s.entry[mode] = true;
        auto c = std::make_shared<Counters>();
        DatasetBatchSource src(s.options(2, 0), fake_encoders(c));
        EXPECT_EQ(c->vae_calls, 0) << mode;  // nothing prebuilt
        EXPECT_FALSE(src.vae_released()) << mode;
        auto g = unused_generator();
        for (int i = 0; i < 16; ++i) src.next(g);  // two epochs
        const bool disabled = std::string(mode) == "vae_cache_disable";
        EXPECT_EQ(c->vae_images, disabled ? 32 : 16) << mode;
        EXPECT_EQ(stdfs::exists(s.dir / "vae") ? count_files(s.dir / "vae") : 0, disabled ? 0 : 16) << mode;
    }
}

TEST(DatasetSource, EffectiveBatchSizeErrorUsesSimpleTunersText) {
    Workspace s(3, 0);
    try {
        auto o = s.options(2);
        o.gradient_accumulation_steps = 2;  // 3 images, batch 2 × 2 accumulation = 4 > 3
        DatasetBatchSource src(o, fake_encoders(std::make_shared<Counters>()));
        FAIL() << "expected the effective-batch-size error";
    } catch (const UsageError& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("Dataset configuration will produce zero usable batches."), std::string::npos) << m;
        EXPECT_NE(m.find("pics"), std::string::npos) << m;
        EXPECT_NE(m.find("allow_dataset_oversubscription"), std::string::npos) << m;
        EXPECT_NE(m.find("Minimum repeats required: 1"), std::string::npos) << m;  // ceil(4 / 3) - 1
    }
    // Batch 4 prunes the only bucket (3 < 4): SimpleTuner's "no usable samples" error.
    try {
        DatasetBatchSource src(s.options(4), fake_encoders(std::make_shared<Counters>()));
        FAIL() << "expected the no-usable-samples error";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("(id=pics) Dataset produced no usable samples."),
                  std::string::npos)
            << e.what();
    }
}

TEST(DatasetSource, OversubscriptionFillsADatasetSmallerThanOneBatchOnOneProcess) {
    // Issue #25 (README "Training data", quickstart §4): 3 images, train_batch_size 4, one process.
    Workspace s(3, 0);
    auto o = s.options(4);
    o.allow_dataset_oversubscription = true;
    DatasetBatchSource src(o, fake_encoders(std::make_shared<Counters>()));
    EXPECT_EQ(src.batches_per_epoch(), 2);  // repeats 1 (auto) → 6 → 8 scheduled → 2 batches of 4
    auto g = unused_generator();
    std::multiset<std::string> seen;
    for (int i = 0; i < 2; ++i) {
        const TrainBatch b = src.next(g);
        ASSERT_EQ(b.latents.size(0), 4);
        seen.insert(b.paths.begin(), b.paths.end());
    }
    EXPECT_EQ(std::set<std::string>(seen.begin(), seen.end()).size(), 3u);
}

TEST(DatasetSource, ImagesRemovedByAFilterAreNamedAndCountedInTheError) {
    // Issue #25: every image under minimum_image_size gave the batch-size advice and a summary
    // saying "0 excluded".
    Workspace s(3, 0);  // 256×128
    s.entry["minimum_image_size"] = 300;
    try {
        DatasetBatchSource src(s.options(2), fake_encoders(std::make_shared<Counters>()));
        FAIL() << "expected the no-usable-samples error";
    } catch (const UsageError& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("(id=pics) Dataset produced no usable samples"), std::string::npos) << m;
        EXPECT_NE(m.find("3 removed by minimum_image_size 300"), std::string::npos) << m;
        EXPECT_EQ(m.find("Lower train_batch_size"), std::string::npos) << m;
        EXPECT_NE(m.find("3 excluded"), std::string::npos) << m;  // the summary agrees
    }
}

TEST(DatasetSource, TwoRanksServeDisjointSlicesOfTheSameGlobalBatch) {
    Workspace s;
    auto c0 = std::make_shared<Counters>(), c1 = std::make_shared<Counters>();
    auto o0 = s.options(2), o1 = s.options(2);
    o0.world_size = o1.world_size = 2;
    o1.rank = 1;
    DatasetBatchSource r0(o0, fake_encoders(c0));
    DatasetBatchSource r1(o1, fake_encoders(c1));
    EXPECT_GT(c0->vae_images, 0);
    EXPECT_GT(c1->vae_images, 0);
    EXPECT_EQ(c0->vae_images + c1->vae_images, 16);  // sharded cache build
    EXPECT_EQ(r0.batches_per_epoch(), 4);            // per-rank micro-batches: 16 / (2 × 2)
    EXPECT_EQ(r1.batches_per_epoch(), 4);
    // One process of batch 4 sees the global batches the two ranks split.
    auto o = s.options(4);
    DatasetBatchSource whole(o, fake_encoders(std::make_shared<Counters>()));
    auto g = unused_generator();
    std::multiset<std::string> all;
    for (int i = 0; i < 4; ++i) {
        const TrainBatch a = r0.next(g), b = r1.next(g), w = whole.next(g);
        EXPECT_EQ(a.latents.sizes(), b.latents.sizes());
        std::vector<std::string> joined = a.paths;
        joined.insert(joined.end(), b.paths.begin(), b.paths.end());
        EXPECT_EQ(joined, w.paths);
        for (const auto& p : a.paths) EXPECT_EQ(std::count(b.paths.begin(), b.paths.end(), p), 0) << p;
        all.insert(joined.begin(), joined.end());
    }
    EXPECT_EQ(all.size(), 16u);
    EXPECT_EQ(std::set<std::string>(all.begin(), all.end()).size(), 16u);  // an epoch covers every image once
}

TEST(DatasetSource, ThreeRanksServeTheOneProcessBatchesWhenThreeDoesNotDivideTheBuckets) {
    // 7 wide and 5 tall images on 3 ranks x batch 1 against 1 process x batch 3. SimpleTuner's
    // padding (the bucket's last image added to the short rank shares) made the global lists 9 and
    // 6 long instead of 7 and 5, so they were shuffled otherwise and the very first global batch
    // held other images than one process's (step 1 logged another loss).
    Workspace s(7, 5);
    std::vector<std::unique_ptr<DatasetBatchSource>> ranks;
    for (int r = 0; r < 3; ++r) {
        auto o = s.options(1);
        o.world_size = 3;
        o.rank = r;
        ranks.push_back(std::make_unique<DatasetBatchSource>(o, fake_encoders(std::make_shared<Counters>())));
    }
    DatasetBatchSource whole(s.options(3), fake_encoders(std::make_shared<Counters>()));
    ASSERT_EQ(whole.batches_per_epoch(), 3 + 2);  // ceil(7 / 3) + ceil(5 / 3)
    for (const auto& r : ranks) EXPECT_EQ(r->batches_per_epoch(), whole.batches_per_epoch());
    EXPECT_EQ(ranks[0]->cache_reports().at(0).samples, 12);  // nothing padded
    auto g = unused_generator();
    std::multiset<std::string> epoch;
    for (int i = 0; i < 2 * whole.batches_per_epoch(); ++i) {  // two epochs, short batches filled
        const TrainBatch w = whole.next(g);
        std::vector<std::string> joined, captions;
        for (const auto& r : ranks) {
            const TrainBatch b = r->next(g);
            joined.insert(joined.end(), b.paths.begin(), b.paths.end());
            captions.insert(captions.end(), b.captions.begin(), b.captions.end());
        }
        EXPECT_EQ(joined, w.paths) << "global batch " << i;
        EXPECT_EQ(captions, w.captions) << "global batch " << i;
        if (i < whole.batches_per_epoch()) epoch.insert(joined.begin(), joined.end());
    }
    EXPECT_EQ(std::set<std::string>(epoch.begin(), epoch.end()).size(), 12u);  // every image once an epoch
}

}  // namespace
}  // namespace test_dataset_source_local
}  // namespace dtune::train
