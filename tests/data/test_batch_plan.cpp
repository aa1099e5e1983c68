// The effective-batch-size check, oversubscription and the rank split (SIMPLETUNER.md §3.4, §4).
#include <gtest/gtest.h>

#include <set>

#include "core/error.h"
#include "data/batch_plan.h"
#include "data/sampler.h"

namespace dtune::data {
namespace test_batch_plan_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

TEST(BatchPlan, DocExampleOversubscription) {
    // 25 images, 8 GPUs × batch 4 = 32 → repeats 1 → 50 logical → 64 scheduled → 8 per rank.
    BatchCheckInput in;
    in.dataset_id = "tiny";
    in.train_batch_size = 4;
    in.world_size = 8;
    in.allow_oversubscription = true;
    EpochPlan plan = plan_epoch(in, {{"1.0", 25}});
    ASSERT_EQ(plan.buckets.size(), 1u);
    const auto& b = plan.buckets[0];
    EXPECT_EQ(plan.effective_batch_size, 32);
    EXPECT_TRUE(b.oversubscribed);
    EXPECT_EQ(b.repeats, 1);
    EXPECT_EQ(b.scheduled, 64);
    EXPECT_EQ(b.per_rank, std::vector<int64_t>(8, 8));
    EXPECT_EQ(b.samples_per_epoch, 64);
    EXPECT_EQ(plan.max_auto_repeat, 1);
    // Every sample is scheduled; indices wrap modulo 25.
    std::multiset<int64_t> all;
    for (int r = 0; r < 8; ++r)
        for (int64_t i : rank_indices(b, 8, r, true)) all.insert(i);
    EXPECT_EQ(all.size(), 64u);
    for (int64_t i = 0; i < 25; ++i) EXPECT_GE(all.count(i), 2u) << i;
    EXPECT_EQ(rank_indices(b, 8, 3, true).front(), 24);  // 3·8 = 24
    EXPECT_EQ(rank_indices(b, 8, 3, true)[1], 0);        // wraps
}

TEST(BatchPlan, ErrorTextListsEverything) {
    BatchCheckInput in;
    in.dataset_id = "tiny";
    in.train_batch_size = 4;
    in.world_size = 8;
    in.gradient_accumulation_steps = 2;  // EBS 64
    try {
        plan_epoch(in, {{"1.0", 25}, {"1.5", 100}, {"0.75", 10}});
        FAIL() << "expected an error";
    } catch (const UsageError& e) {
        const std::string m = e.what();
        EXPECT_EQ(m.rfind("Dataset configuration will produce zero usable batches.", 0), 0u) << m;
        for (const char* part :
             {"Dataset ID: tiny", "Total samples: 135", "Repeats: 0", "Batch size: 4", "Number of GPUs: 8",
              "Gradient accumulation steps: 2", "Effective batch size: 64", "2 bucket(s)",
              "Bucket 1.0: 25 samples × 1 (with repeats) = 25 samples", "Need at least 64 samples",
              "Minimum repeats required: 2",  // ceil(64/25) − 1
              "Bucket 0.75: 10 samples", "Minimum repeats required: 6", "Increase repeats to at least 6",
              "--allow_dataset_oversubscription"})
            EXPECT_NE(m.find(part), std::string::npos) << part << "\n" << m;
        EXPECT_EQ(m.find("Bucket 1.5"), std::string::npos);
        EXPECT_EQ(m.find("manually set repeats"), std::string::npos);
    }
    in.repeats = 1;
    in.repeats_set_by_user = true;
    in.allow_oversubscription = true;  // ignored: the user set repeats
    try {
        plan_epoch(in, {{"1.0", 25}});
        FAIL() << "expected an error";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("manually set repeats=1"), std::string::npos);
    }
}

TEST(BatchPlan, PruningPaddingAndReport) {
    BatchCheckInput in;
    in.dataset_id = "d";
    in.train_batch_size = 2;
    in.world_size = 3;
    // bucket 2.0 (1 sample) cannot fill a micro-batch → pruned and reported.
    EpochPlan plan = plan_epoch(in, {{"1.0", 10}, {"2.0", 1}});
    ASSERT_EQ(plan.buckets.size(), 2u);
    const auto& ok = plan.buckets[0];
    EXPECT_EQ(ok.per_rank, (std::vector<int64_t>{4, 4, 4}));  // 10 over 3 ranks, padded to 4 each
    EXPECT_EQ(ok.padded, 2);
    EXPECT_EQ(ok.batches_per_rank, 2);
    EXPECT_EQ(ok.samples_per_epoch, 12);
    EXPECT_EQ(plan.buckets[1].excluded, 1);
    EXPECT_NE(plan.buckets[1].excluded_reason.find("pruned"), std::string::npos);
    EXPECT_EQ(plan.excluded(), 1);
    const std::string report = plan.report();
    EXPECT_NE(report.find("bucket 2.0: 1 samples"), std::string::npos) << report;
    EXPECT_NE(report.find("excluded 1"), std::string::npos) << report;
    // Contiguous slices [r·q + min(r, rem), …): 0..3, 4..6 (+9), 7..9.
    EXPECT_EQ(rank_indices(ok, 3, 0, true), (std::vector<int64_t>{0, 1, 2, 3}));
    EXPECT_EQ(rank_indices(ok, 3, 1, true), (std::vector<int64_t>{4, 5, 6, 9}));
    EXPECT_EQ(rank_indices(ok, 3, 2, false), (std::vector<int64_t>{7, 8, 9}));
}

TEST(BatchPlan, RepeatsCountInCheckAndEpoch) {
    BatchCheckInput in;
    in.train_batch_size = 4;
    in.world_size = 2;
    in.repeats = 1;
    in.repeats_set_by_user = true;
    EpochPlan plan = plan_epoch(in, {{"1.0", 5}});  // 5·2 = 10 ≥ 8: passes
    const auto& b = plan.buckets[0];
    EXPECT_FALSE(b.oversubscribed);
    EXPECT_EQ(b.per_rank, (std::vector<int64_t>{3, 3}));
    EXPECT_EQ(b.batches_per_rank, 2);    // 2 passes × ceil(3/4)
    EXPECT_EQ(b.samples_per_epoch, 12);  // (3 + 3) × 2 passes
    EXPECT_EQ(b.filled, 4);              // 2 batches × 4 × 2 ranks − 12
    in.is_eval = true;                   // eval datasets use a world of 1
    EXPECT_EQ(plan_epoch(in, {{"1.0", 5}}).effective_batch_size, 4);
}

TEST(BatchPlan, OversubscriptionComesBeforePruningOnOneProcess) {
    // Issue #25: 3 images and train_batch_size 4 on one process were pruned ("3 samples × 1 <
    // train_batch_size 4") before oversubscription was looked at.
    BatchCheckInput in;
    in.dataset_id = "three";
    in.train_batch_size = 4;
    in.allow_oversubscription = true;
    const EpochPlan plan = plan_epoch(in, {{"1.0", 3}});
    ASSERT_EQ(plan.buckets.size(), 1u);
    const auto& b = plan.buckets[0];
    EXPECT_EQ(b.excluded, 0) << plan.report();
    EXPECT_TRUE(b.oversubscribed);
    EXPECT_EQ(b.repeats, 1);    // ceil(4/3) − 1
    EXPECT_EQ(b.scheduled, 8);  // ceil(3·2 / 4)·4
    EXPECT_EQ(b.batches_per_rank, 2);
    EXPECT_EQ(plan.max_auto_repeat, 1);
    EXPECT_EQ(rank_indices(b, 1, 0, true), (std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0, 1}));
    // Without the option, or with repeats written in the entry (even 0), the bucket is pruned.
    in.allow_oversubscription = false;
    EXPECT_EQ(plan_epoch(in, {{"1.0", 3}}).buckets[0].excluded, 3);
    in.allow_oversubscription = true;
    in.repeats_set_by_user = true;
    const EpochPlan manual = plan_epoch(in, {{"1.0", 3}});
    EXPECT_EQ(manual.buckets[0].excluded, 3);
    EXPECT_NE(manual.buckets[0].excluded_reason.find("pruned"), std::string::npos);
}

TEST(BatchPlan, ReportedEpochMatchesTheSampler) {
    // Issue #25: `repeats: 1` on 3 images logged "8 per epoch": the two fills of the short batches
    // were counted as samples. The plan's batches must be what BucketSampler serves.
    struct Case {
        int64_t samples;
        int batch, world, repeats;
    };
    for (const Case c :
         {Case{3, 4, 1, 1}, Case{5, 4, 1, 1}, Case{10, 2, 3, 0}, Case{7, 2, 2, 2}, Case{9, 4, 2, 1}}) {
        BatchCheckInput in;
        in.dataset_id = "d";
        in.train_batch_size = c.batch;
        in.world_size = c.world;
        in.repeats = c.repeats;
        in.repeats_set_by_user = c.repeats > 0;
        const EpochPlan plan = plan_epoch(in, {{"1.0", c.samples}});
        const auto& b = plan.buckets.at(0);
        std::map<std::string, std::vector<std::string>> buckets;
        for (int64_t i = 0; i < c.samples; ++i) buckets["1.0"].push_back("img" + std::to_string(i));
        std::map<std::string, std::vector<std::string>> global;  // every rank's share, as the planner
        for (int r = 0; r < c.world; ++r)
            for (auto& [key, list] : rank_bucket_lists(buckets, plan, "d", 7, c.world, r, true))
                global[key].insert(global[key].end(), list.begin(), list.end());
        BucketSampler sampler(global, c.batch * c.world, c.repeats, 7, "d");
        int64_t batches = 0;
        for (;;) {
            auto batch = sampler.next();
            while (!batch && sampler.next_pass()) batch = sampler.next();
            if (!batch) break;
            ++batches;
        }
        const std::string what =
            "samples " + std::to_string(c.samples) + ", world " + std::to_string(c.world);
        EXPECT_EQ(b.batches_per_rank, batches) << what;
        EXPECT_EQ(b.samples_per_epoch, static_cast<int64_t>(global["1.0"].size()) * (c.repeats + 1)) << what;
        EXPECT_EQ(b.samples_per_epoch + b.filled, batches * c.batch * c.world) << what;
    }
    BatchCheckInput in;
    in.dataset_id = "three";
    in.train_batch_size = 4;
    in.repeats = 1;
    in.repeats_set_by_user = true;
    const std::string report = plan_epoch(in, {{"1.0", 3}}).report();
    EXPECT_NE(report.find("6 per epoch (3 per rank, 2 batches; 2 batch slot(s) filled"), std::string::npos)
        << report;
}

}  // namespace
}  // namespace test_batch_plan_local
}  // namespace dtune::data
