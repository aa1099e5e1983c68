// Caption strategies (JSON-lines table standing in for Parquet) and the per-rank sampler logic,
// tested with world_size/rank parameters instead of processes.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <set>

#include "core/error.h"
#include "data/captions.h"
#include "data/sampler.h"
#include "data/storage.h"
#include "support/test_support.h"

namespace dtune::data {
namespace test_captions_sampler_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

DatasetConfig captions_config(CaptionStrategy strategy) {
    DatasetConfig c;
    c.id = "d";
    c.caption_strategy = strategy;
    return c;
}

TEST(Captions, Strategies) {
    test::TempDir dir;
    LocalStorage storage;
    const std::string img = (dir / "a_red_fox.png").string();
    EXPECT_EQ(resolve_captions(captions_config(CaptionStrategy::kFilename), storage, img),
              std::vector<std::string>{"a red fox"});
    DatasetConfig t = captions_config(CaptionStrategy::kTextfile);
    EXPECT_THROW(resolve_captions(t, storage, img), DataError);
    test::write_bytes(dir / "a_red_fox.txt", "first caption\n\n  second caption  \n");
    EXPECT_EQ(resolve_captions(t, storage, img),
              (std::vector<std::string>{"first caption", "second caption"}));
    t.disable_multiline_split = true;
    EXPECT_EQ(resolve_captions(t, storage, img).size(), 1u);
    t.disable_multiline_split = false;
    t.instance_prompt = "sks";
    t.prepend_instance_prompt = true;
    EXPECT_EQ(resolve_captions(t, storage, img)[1], "sks second caption");
    t.only_instance_prompt = true;
    EXPECT_EQ(resolve_captions(t, storage, img), std::vector<std::string>{"sks"});
    DatasetConfig ip = captions_config(CaptionStrategy::kInstancePrompt);
    EXPECT_THROW(resolve_captions(ip, storage, img), DataError);  // empty instance prompt
    ip.instance_prompt = "a photo of sks";
    EXPECT_EQ(resolve_captions(ip, storage, img), std::vector<std::string>{"a photo of sks"});
}

// A caption that is not UTF-8 (a Latin-1 .txt, a Latin-1 file name) leaves its sample out with a
// DataError naming the caption's source; before, the text encoder stopped the run later with "text
// is not valid UTF-8 at byte 8" and no file name.
TEST(Captions, NonUtf8CaptionNamesItsSource) {
    test::TempDir dir;
    LocalStorage storage;
    const std::string img = (dir / "caf\xe9.png").string();
    test::write_bytes(dir / "caf\xe9.txt", "a caf\xe9 at night\n");
    const auto message = [&](CaptionStrategy strategy) {
        try {
            resolve_captions(captions_config(strategy), storage, img);
        } catch (const DataError& e) {
            return std::string(e.what());
        }
        return std::string("no DataError");
    };
    const std::string textfile = message(CaptionStrategy::kTextfile);
    EXPECT_NE(textfile.find("caption file " + (dir / "caf\xe9.txt").string()), std::string::npos) << textfile;
    EXPECT_NE(textfile.find("not valid UTF-8 (byte 5"), std::string::npos) << textfile;
    const std::string filename = message(CaptionStrategy::kFilename);
    EXPECT_NE(filename.find("file name is not valid UTF-8"), std::string::npos) << filename;
    test::write_bytes(dir / "caf\xe9.txt", "a caf\xc3\xa9 at night\n");  // the same text in UTF-8
    EXPECT_EQ(resolve_captions(captions_config(CaptionStrategy::kTextfile), storage, img),
              std::vector<std::string>{"a caf\xc3\xa9 at night"});
}

TEST(Captions, JsonLinesTable) {
    test::TempDir dir;
    LocalStorage storage;
    test::write_bytes(dir / "meta.jsonl",
                      "{\"id\": \"img1\", \"description\": \"a cat\", \"w\": 640, \"h\": 480}\n"
                      "{\"id\": \"img2\", \"description\": [\"a dog\", \"a puppy\"], \"w\": 1, \"h\": 2}\n"
                      "{\"id\": 3, \"description\": \"\", \"alt\": \"fallback text\"}\n");
    ParquetSettings s;
    s.path = (dir / "meta.jsonl").string();
    s.width_column = "w";
    s.height_column = "h";
    EXPECT_THROW(MetadataTable::load(storage, s, true), UsageError);  // row 3 has no caption
    s.fallback_caption_column = "alt";
    const MetadataTable table = MetadataTable::load(storage, s, true);
    EXPECT_EQ(table.size(), 3u);
    const MetadataRow* r1 = table.find_for_path("/data/img1.png");
    ASSERT_NE(r1, nullptr);
    EXPECT_EQ(r1->width, 640);
    EXPECT_EQ(r1->height, 480);
    DatasetConfig c = captions_config(CaptionStrategy::kParquet);
    EXPECT_EQ(resolve_captions(c, storage, "/x/img2.jpg", &table),
              (std::vector<std::string>{"a dog", "a puppy"}));
    EXPECT_EQ(resolve_captions(c, storage, "/x/3.png", &table), std::vector<std::string>{"fallback text"});
    EXPECT_THROW(resolve_captions(c, storage, "/x/img9.png", &table), DataError);
    s.identifier_includes_extension = true;
    const MetadataTable strict = MetadataTable::load(storage, s, true);
    EXPECT_EQ(strict.find_for_path("/data/img1.png"), nullptr);  // identifiers lack the extension
    test::write_bytes(dir / "bad.jsonl", "{\"id\": 1}\n{oops\n");
    EXPECT_THROW(MetadataTable::parse_jsonl(storage.read((dir / "bad.jsonl").string()), "bad.jsonl"),
                 DataError);
}

TEST(Captions, DropoutRate) {
    std::mt19937_64 rng(7);
    int dropped = 0;
    for (int i = 0; i < 20000; ++i) dropped += apply_caption_dropout("x", 0.1, rng).empty();
    EXPECT_NEAR(dropped / 20000.0, 0.1, 0.01);
    EXPECT_EQ(apply_caption_dropout("x", 0.0, rng), "x");
}

TEST(Sampler, DatasetChoiceIsSeededByStepAndWeighted) {
    std::vector<DatasetWeight> ds = {{"a", 1.0, 300}, {"b", 1.0, 100}};
    int a = 0;
    for (int64_t step = 0; step < 20000; ++step) {
        const auto pick = choose_dataset(ds, step, 1, 42);
        ASSERT_TRUE(pick);
        ASSERT_EQ(pick, choose_dataset(ds, step, 1, 42));  // every rank computes the same
        a += *pick == 0;
    }
    EXPECT_NEAR(a / 20000.0, 0.75, 0.015);  // auto-weighting: 1·300/400
    ds[1].start_step = 100;                 // b is outside its window before step 100
    for (int64_t step = 0; step < 100; ++step) EXPECT_EQ(choose_dataset(ds, step, 1, 42), 0u);
    ds[0].end_epoch = 0;
    ds[1].start_step = 0;
    EXPECT_EQ(choose_dataset(ds, 5, 1, 42), 1u);
    ds[1].probability = 0;
    EXPECT_FALSE(choose_dataset(ds, 5, 1, 42));
}

std::map<std::string, std::vector<std::string>> make_buckets(int n_a, int n_b) {
    std::map<std::string, std::vector<std::string>> b;
    for (int i = 0; i < n_a; ++i) b["1.0"].push_back("a" + std::to_string(i));
    for (int i = 0; i < n_b; ++i) b["1.75"].push_back("b" + std::to_string(i));
    return b;
}

TEST(Sampler, RanksPartitionTheSameShuffledList) {
    const auto buckets = make_buckets(10, 7);
    BatchCheckInput in;
    in.train_batch_size = 1;
    in.world_size = 3;
    const EpochPlan plan = plan_epoch(in, {{"1.0", 10}, {"1.75", 7}});
    std::multiset<std::string> all;
    for (int r = 0; r < 3; ++r) {
        const auto local = rank_bucket_lists(buckets, plan, "d", 9, 3, r, false);
        for (const auto& [key, list] : local) all.insert(list.begin(), list.end());
        EXPECT_EQ(local, rank_bucket_lists(buckets, plan, "d", 9, 3, r, false));  // deterministic
    }
    EXPECT_EQ(all.size(), 17u);  // without padding: a partition, nothing lost or doubled
    EXPECT_EQ(std::set<std::string>(all.begin(), all.end()).size(), 17u);
    // With padding every rank holds ceil(n/3).
    for (int r = 0; r < 3; ++r)
        EXPECT_EQ(rank_bucket_lists(buckets, plan, "d", 9, 3, r, true).at("1.0").size(), 4u);
}

TEST(Sampler, BatchesFromOneBucketVisitingInTurn) {
    BucketSampler sampler(make_buckets(5, 4), 2, 1, 3, "d");
    EXPECT_EQ(sampler.batches_per_epoch(), (3 + 2) * 2);
    std::vector<std::string> order;
    std::map<std::string, int> seen;
    int batches = 0;
    while (auto batch = sampler.next()) {
        ASSERT_EQ(batch->samples.size(), 2u);
        for (const auto& s : batch->samples) ASSERT_EQ(s[0], batch->bucket == "1.0" ? 'a' : 'b');
        for (const auto& s : batch->samples) ++seen[s];
        order.push_back(batch->bucket);
        ++batches;
    }
    EXPECT_EQ(batches, 5);
    EXPECT_EQ((std::vector<std::string>(order.begin(), order.begin() + 4)),
              (std::vector<std::string>{"1.0", "1.75", "1.0", "1.75"}));
    EXPECT_EQ(seen.size(), 9u);  // every sample once, plus one refill in the odd bucket
    ASSERT_TRUE(sampler.next_pass());
    int second = 0;
    while (sampler.next()) ++second;
    EXPECT_EQ(second, 5);
    EXPECT_FALSE(sampler.next_pass());  // repeats = 1: two passes per epoch
}

TEST(Sampler, ResumeContinuesWithTheExactNextBatch) {
    BucketSampler a(make_buckets(23, 11), 3, 0, 5, "d");
    for (int i = 0; i < 4; ++i) a.next();
    const nlohmann::json saved = a.state().to_json();
    std::vector<std::vector<std::string>> rest_a;
    while (auto b = a.next()) rest_a.push_back(b->samples);
    BucketSampler b(make_buckets(23, 11), 3, 0, 5, "d");
    b.restore(SamplerState::from_json(nlohmann::json::parse(saved.dump())));
    std::vector<std::vector<std::string>> rest_b;
    while (auto batch = b.next()) rest_b.push_back(batch->samples);
    EXPECT_EQ(rest_a, rest_b);
    EXPECT_FALSE(rest_a.empty());
    BucketSampler other(make_buckets(23, 0), 3, 0, 5, "d");
    EXPECT_THROW(other.restore(SamplerState::from_json(saved)), UsageError);
}

}  // namespace
}  // namespace test_captions_sampler_local
}  // namespace dtune::data
