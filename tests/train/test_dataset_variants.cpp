// DatasetBatchSource's per-draw variants with stand-in encoders (no model): random_flip (both
// orientations prebuilt, mirrored latents and time ids, resume-exact), crop_aspect random
// (re-bucketed every epoch, one cache entry per size, resume-exact, ranks agree; every epoch keeps
// to the aspect range and the upscale limit as the start-up bucketing does, and the start-up
// batch-size check judges epoch 1's own draw) and vae_cache_disable (a fresh posterior sample per
// epoch, resume-exact).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <map>
#include <memory>
#include <set>

#include "core/error.h"
#include "train/dataset_loader.h"
#include "train/dataset_source.h"
#include "train/dataset_source_test_util.h"

namespace dtune::train {
namespace test_dataset_variants_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using namespace test_util;
namespace stdfs = std::filesystem;

struct Draw {
    std::vector<std::string> paths;
    at::Tensor latents, time_ids;
};

// Draws `take` batches (after loading `resume` if given); `state_at` receives the state after
// `state_after` batches.
std::vector<Draw> draw(const DatasetSourceOptions& o, int take, const nlohmann::json* resume = nullptr,
                       nlohmann::json* state_at = nullptr, int state_after = 0,
                       std::shared_ptr<Counters> counters = nullptr) {
    DatasetBatchSource src(o, fake_encoders(counters ? counters : std::make_shared<Counters>()));
    if (resume) src.load_state(*resume);
    auto g = unused_generator();
    std::vector<Draw> out;
    for (int i = 0; i < take; ++i) {
        TrainBatch b = src.next(g);
        out.push_back({b.paths, b.latents, b.cond.at("time_ids")});
        if (state_at && i + 1 == state_after) *state_at = src.state();
    }
    return out;
}

void expect_same(const std::vector<Draw>& a, const std::vector<Draw>& b, size_t offset_a) {
    ASSERT_LE(b.size() + offset_a, a.size());
    for (size_t i = 0; i < b.size(); ++i) {
        EXPECT_EQ(a[offset_a + i].paths, b[i].paths) << i;
        EXPECT_TRUE(at::equal(a[offset_a + i].latents, b[i].latents)) << i;
        EXPECT_TRUE(at::equal(a[offset_a + i].time_ids, b[i].time_ids)) << i;
    }
}

TEST(DatasetVariants, RandomFlipMirrorsLatentsAndCropCoordinates) {
    // 256×128 → 128×64, corner crop 64×64 at left 0: a mirrored draw reports left 128 − 0 − 64.
    Workspace s(8, 0);
    s.entry["crop"] = true;
    s.entry["crop_style"] = "corner";
    s.entry["crop_aspect"] = "square";
    std::map<std::string, at::Tensor> plain;  // path → unmirrored latent [4, 8, 8]
    for (const Draw& d : draw(s.options(1, 0), 8)) plain[d.paths[0]] = d.latents[0];
    for (const Draw& d : draw(s.options(1, 0), 8)) EXPECT_EQ(d.time_ids[0][3].item<float>(), 0.f);

    s.entry["random_flip"] = true;
    auto c = std::make_shared<Counters>();
    const auto flipped_run = draw(s.options(1, 2), 32, nullptr, nullptr, 0, c);  // four epochs
    EXPECT_EQ(c->vae_images, 8);                // the mirrored variants prebuilt; the plain ones were cached
    EXPECT_EQ(count_files(s.dir / "vae"), 16);  // 8 plain + 8 "-flip" entries
    int mirrored = 0;
    for (const Draw& d : flipped_run) {
        const float left = d.time_ids[0][3].item<float>();
        ASSERT_TRUE(left == 0.f || left == 64.f) << d.time_ids;
        const at::Tensor& base = plain.at(d.paths[0]);
        if (left == 64.f) {
            ++mirrored;
            // 8×8 pooling commutes with a mirror of a crop whose width is a multiple of 8.
            EXPECT_TRUE(at::allclose(d.latents[0], at::flip(base, {2}), 1e-5, 1e-6)) << d.paths[0];
            EXPECT_FALSE(at::allclose(d.latents[0], base)) << d.paths[0];
        } else {
            EXPECT_TRUE(at::equal(d.latents[0], base)) << d.paths[0];
        }
    }
    EXPECT_GT(mirrored, 6);  // Binomial(32, 1/2)
    EXPECT_LT(mirrored, 26);

    // Resume mid-epoch (after 11 draws) continues with the exact same flips.
    nlohmann::json mid;
    const auto straight = draw(s.options(1, 3), 20, nullptr, &mid, 11);
    expect_same(flipped_run, straight, 0);  // prefetch depth does not matter
    expect_same(straight, draw(s.options(1, 3), 9, &mid), 11);
}

TEST(DatasetVariants, CropAspectRandomRebucketsEveryEpoch) {
    Workspace s(8, 8);
    s.entry["crop"] = true;
    s.entry["crop_style"] = "random";
    s.entry["crop_aspect"] = "random";
    s.entry["crop_aspect_buckets"] = {0.5, 1.0, 2.0};
    auto c = std::make_shared<Counters>();
    nlohmann::json mid;
    const auto straight = draw(s.options(1, 2), 64, nullptr, &mid, 37, c);  // four epochs of 16
    std::vector<std::map<std::string, std::vector<int64_t>>> shapes(4);     // epoch → path → shape
    for (size_t i = 0; i < straight.size(); ++i) {
        const Draw& d = straight[i];
        const auto shape = d.latents.sizes().vec();
        // The time ids' target is the latent's size × 8, whatever bucket the epoch chose.
        EXPECT_EQ(d.time_ids[0][4].item<float>(), float(shape[2] * 8));
        EXPECT_EQ(d.time_ids[0][5].item<float>(), float(shape[3] * 8));
        EXPECT_TRUE(shapes[i / 16].emplace(d.paths[0], shape).second) << "seen twice in one epoch";
    }
    // Each image draws its aspect again every epoch among the buckets its size allows (with the
    // upscale limit most of these small images only fit 1.0), seeded by its path, so which images
    // move depends on the temporary folder's name: count moves over all four epochs.
    int moved = 0;
    std::set<std::vector<int64_t>> all;
    for (const auto& [path, shape] : shapes[0]) {
        for (size_t e = 1; e < shapes.size(); ++e) {
            EXPECT_EQ(shapes[e].size(), 16u);
            moved += shapes[e].at(path) != shapes[e - 1].at(path);
        }
        for (const auto& e : shapes) all.insert(e.at(path));
    }
    EXPECT_GT(moved, 0);  // some image trained in another bucket in a later epoch
    EXPECT_GE(all.size(), 2u);
    // One entry per (image, size) met so far, each named by its size; reused on a second build.
    std::set<std::string> names;
    for (const auto& e : stdfs::recursive_directory_iterator(s.dir / "vae"))
        if (e.path().extension() == ".safetensors") names.insert(e.path().filename().string());
    EXPECT_EQ(int64_t(names.size()), c->vae_images);
    std::set<std::string> targets;  // "-<target>_<resize>.safetensors"
    for (const auto& n : names) {
        const auto dash = n.find('-'), under = n.find('_');
        ASSERT_TRUE(dash != std::string::npos && under != std::string::npos && dash < under) << n;
        targets.insert(n.substr(dash + 1, under - dash - 1));
    }
    EXPECT_EQ(targets, (std::set<std::string>{"64x128", "64x64", "128x64"}));

    // Resume in epoch 3 (after 37 draws): the same buckets, crops and latents; no re-encoding.
    auto again = std::make_shared<Counters>();
    expect_same(straight, draw(s.options(1, 0), 27, &mid, nullptr, 0, again), 37);
    EXPECT_EQ(again->vae_images, 0);

    // Two ranks re-bucket identically: their slices of each global batch share one shape (a
    // bucket of one image fails the batch check of 2, hence oversubscription).
    auto o0 = s.options(1, 2), o1 = s.options(1, 2);
    o0.world_size = o1.world_size = 2;
    o0.allow_dataset_oversubscription = o1.allow_dataset_oversubscription = true;
    o1.rank = 1;
    const auto r0 = draw(o0, 24), r1 = draw(o1, 24);
    for (size_t i = 0; i < r0.size(); ++i) EXPECT_EQ(r0[i].latents.sizes(), r1[i].latents.sizes()) << i;
}

TEST(DatasetVariants, AnEpochWhoseRandomBucketsFailTheBatchCheckIsOversubscribed) {
    detail::RebucketInputs in;
    in.settings.resolution_type = data::ResolutionType::kPixel;
    in.settings.resolution = 64;
    in.settings.crop = true;
    in.settings.crop_aspect = data::CropAspect::kRandom;
    in.settings.crop_aspect_buckets = {{0.5, {}}, {2.0, {}}};
    for (int i = 0; i < 3; ++i) in.indexed["img" + std::to_string(i)].original = {400, 400};
    in.check.dataset_id = "pics";
    in.check.train_batch_size = 1;
    in.check.world_size = in.world_size = 2;  // effective batch 2: a bucket of one image fails
    in.check.apply_padding = true;
    std::map<std::string, int64_t> sizes;
    for (in.seed = 0; in.seed < 64; ++in.seed) {  // the first seed that splits the images 2 + 1
        sizes.clear();
        for (const auto& [path, plan] :
             data::rebucket_epoch(in.settings, in.indexed, in.seed, "pics", 0, in.pins).plans)
            ++sizes[data::bucket_key(plan.aspect)];
        if (sizes.size() == 2) break;
    }
    ASSERT_EQ(sizes.size(), 2u);
    ASSERT_THROW(data::plan_epoch(in.check, sizes), UsageError);  // what a strict check says
    auto expect_full_layout = [&](const char* what) {
        const detail::EpochLayout layout = detail::layout_for_epoch(in, 0);
        for (const auto& [key, list] : layout.global) EXPECT_EQ(list.size() % 2, 0u) << what << key;
        std::set<std::string> served;
        for (const auto& [key, list] : layout.global) served.insert(list.begin(), list.end());
        EXPECT_EQ(served.size(), 3u) << what;  // nobody left out
    };
    expect_full_layout("default: ");
    // allow_dataset_oversubscription with a hand-set repeats is what makes the start-up check
    // strict; a later epoch must still not stop the run (it used to throw here).
    in.check.allow_oversubscription = true;
    in.check.repeats_set_by_user = true;
    ASSERT_THROW(data::plan_epoch(in.check, sizes), UsageError);
    EXPECT_NO_THROW(expect_full_layout("oversubscription + manual repeats: "));
}

// The settings Workspace's crop_aspect random entry buckets with (pixel 64, alignment 64).
data::BucketSettings random_settings(std::vector<data::CropAspectBucket> buckets) {
    data::BucketSettings b;
    b.resolution_type = data::ResolutionType::kPixel;
    b.resolution = 64;
    b.crop = true;
    b.crop_aspect = data::CropAspect::kRandom;
    b.crop_aspect_buckets = std::move(buckets);
    return b;
}

std::string image_path(const Workspace& s, const std::string& name) {
    return stdfs::absolute(s.dir / "images" / name).lexically_normal().string();  // as the listing has it
}

// Every batch of the first `epochs` epochs with its epoch (batch size 1).
std::vector<std::pair<int64_t, Draw>> draw_epochs(const DatasetSourceOptions& o, int64_t epochs) {
    DatasetBatchSource src(o, fake_encoders(std::make_shared<Counters>()));
    auto g = unused_generator();
    std::vector<std::pair<int64_t, Draw>> out;
    for (;;) {
        TrainBatch b = src.next(g);
        if (src.epoch() >= epochs) return out;
        out.push_back({src.epoch(), {b.paths, b.latents, b.cond.at("time_ids")}});
    }
}

TEST(DatasetVariants, CropAspectRandomEpochsKeepToTheAspectRange) {
    // Wide 256×128 images draw buckets 1.0 (aspects 0.5, 1.0) or 2.0; tall 64×128 ones 0.5 or 1.0
    // (aspects 1.0, 2.0). With the range [0.75, 1.5] only bucket 1.0 is trained, in every epoch.
    // The draws hash the image paths, which hold this process's temporary directory, so whether the
    // bucket index's own draw sets any image aside changes from run to run (none in about two runs
    // of a hundred): seeds are tried in turn (a fresh folder each) until it does.
    const int64_t epochs = 6;
    std::unique_ptr<Workspace> s;
    std::vector<std::pair<int64_t, Draw>> draws;
    std::set<std::string> set_aside;  // by the bucket index's own draw
    uint64_t seed = 42;
    for (; seed < 42 + 16; ++seed) {
        s = std::make_unique<Workspace>(8, 8);
        s->entry["crop"] = true;
        s->entry["crop_aspect"] = "random";
        s->entry["crop_aspect_buckets"] = {0.5, 1.0, 2.0};
        s->entry["minimum_aspect_ratio"] = 0.75;
        s->entry["maximum_aspect_ratio"] = 1.5;
        DatasetSourceOptions o = s->options(1, 2);
        o.seed = seed;
        draws = draw_epochs(o, epochs);
        const auto skipped =
            nlohmann::json::parse(fs::read_file(s->dir / "images" / "skipped_files_pics.json"));
        set_aside.clear();
        for (const auto& [path, reason] : skipped.items()) set_aside.insert(path);
        if (!set_aside.empty()) break;
    }
    ASSERT_FALSE(set_aside.empty()) << "no seed had the index's draw set an image aside";
    std::vector<std::set<std::string>> served(epochs);
    for (const auto& [epoch, d] : draws) {
        const float h = d.time_ids[0][4].item<float>(), w = d.time_ids[0][5].item<float>();
        EXPECT_GE(w / h, 0.75f) << d.paths[0] << " epoch " << epoch;
        EXPECT_LE(w / h, 1.5f) << d.paths[0] << " epoch " << epoch;
        EXPECT_EQ(d.latents.sizes().vec(), (std::vector<int64_t>{1, 4, 8, 8}));
        EXPECT_TRUE(served[epoch].insert(d.paths[0]).second) << "seen twice in epoch " << epoch;
    }
    // Each epoch trains exactly the images whose own draw that epoch is in range, whatever the
    // bucket index drew for them at start (an image the index set aside is drawn again).
    auto settings = random_settings({{0.5, {}}, {1.0, {}}, {2.0, {}}});
    const data::AspectResolutionMap no_pins(0);
    int set_aside_trained = 0;
    for (int64_t e = 0; e < epochs; ++e) {
        std::set<std::string> expected;
        for (const auto& [name, size] : {std::pair<std::string, data::Size>{"wide ", {256, 128}},
                                         std::pair<std::string, data::Size>{"tall ", {64, 128}}})
            for (int i = 0; i < 8; ++i) {
                const std::string path = image_path(*s, name + std::to_string(i) + ".png");
                data::SamplePlan indexed;
                indexed.original = size;
                const auto plan = data::epoch_plan(settings, indexed, seed, "pics", path, e, no_pins);
                if (plan.aspect == 1.0) expected.insert(path);
            }
        EXPECT_EQ(served[e], expected) << "epoch " << e;
        for (const auto& p : served[e]) set_aside_trained += set_aside.count(p);
    }
    EXPECT_GT(set_aside_trained, 0);  // the images the index set aside are trained by later draws
}

TEST(DatasetVariants, CropAspectRandomEpochsKeepToTheUpscaleLimit) {
    // 96×96 images with max_upscale_threshold 0.25 may not draw aspect 2.0 (a 128×64 target is
    // 1.33× their width); 0.5 and 1.0 both give 64×64. Wide 256×128 images are not limited.
    Workspace s(4, 0);
    for (int i = 0; i < 4; ++i)
        write_png(s.dir / "images" / ("mid " + std::to_string(i) + ".png"), 96, 96, 90 + i);
    s.entry["crop"] = true;
    s.entry["crop_aspect"] = "random";
    s.entry["crop_aspect_buckets"] = {0.5, 1.0, 2.0};
    s.entry["max_upscale_threshold"] = 0.25;
    std::set<std::vector<int64_t>> wide_shapes;
    for (const auto& [epoch, d] : draw_epochs(s.options(1, 2), 6)) {
        const auto shape = d.latents.sizes().vec();
        if (d.paths[0].find("mid ") != std::string::npos)
            EXPECT_EQ(shape, (std::vector<int64_t>{1, 4, 8, 8})) << d.paths[0] << " epoch " << epoch;
        else
            wide_shapes.insert(shape);
    }
    EXPECT_EQ(wide_shapes.size(), 2u);  // 64×64 and 128×64: the limit left them alone
    // The bucket index's draw follows the same limit.
    const auto meta =
        nlohmann::json::parse(fs::read_file(s.dir / "images" / "aspect_ratio_bucket_metadata_pics.json"));
    for (int i = 0; i < 4; ++i)
        EXPECT_EQ(meta.at(image_path(s, "mid " + std::to_string(i) + ".png")).at("target_size"),
                  nlohmann::json({64, 64}));
}

TEST(DatasetVariants, TheStartupBatchCheckJudgesEpochOnesDraw) {
    // Three tall images draw bucket 0.5 or 1.0; with gradient accumulation 2 a bucket of one image
    // fails the batch check (effective batch 2) without being pruned. Whether the run may start
    // must depend on the buckets epoch 1 trains on (its own draw, which changes with the seed),
    // not on the draw stored in the bucket index.
    Workspace s(0, 3);
    s.entry["crop"] = true;
    s.entry["crop_aspect"] = "random";
    s.entry["crop_aspect_buckets"] = {0.5, 2.0};
    const auto settings = random_settings({{0.5, {}}, {2.0, {}}});
    std::map<std::string, data::SamplePlan> indexed;
    for (int i = 0; i < 3; ++i)
        indexed[image_path(s, "tall " + std::to_string(i) + ".png")].original = {64, 128};
    std::set<bool> outcomes;
    // The draws hash the image paths, which hold this process's temporary directory: which seeds
    // fit changes from run to run. A seed fits with probability 1/4, so 16 seeds saw only one case
    // about once a run in a hundred; go on (up to 96 seeds) until both have been seen.
    for (uint64_t seed = 0; seed < 96 && (seed < 16 || outcomes.size() < 2); ++seed) {
        std::map<std::string, int64_t> sizes;
        for (const auto& [key, paths] :
             data::rebucket_epoch(settings, indexed, seed, "pics", 0, data::AspectResolutionMap(0)).buckets)
            sizes[key] = int64_t(paths.size());
        const bool epoch_one_fits = sizes.size() == 1;  // 3 + 0; a 2 + 1 split fails
        outcomes.insert(epoch_one_fits);
        auto o = s.options(1, 0);
        o.seed = seed;
        o.gradient_accumulation_steps = 2;
        if (epoch_one_fits) {
            EXPECT_NO_THROW({ DatasetBatchSource src(o, fake_encoders(std::make_shared<Counters>())); })
                << seed;
        } else {
            try {
                DatasetBatchSource src(o, fake_encoders(std::make_shared<Counters>()));
                ADD_FAILURE() << "seed " << seed
                              << ": epoch 1's buckets fail the batch check, yet the run started";
            } catch (const UsageError& e) {
                EXPECT_NE(std::string(e.what()).find("zero usable batches"), std::string::npos) << e.what();
            }
        }
    }
    EXPECT_EQ(outcomes.size(), 2u);  // both cases met, so the test can tell the draws apart
}

TEST(DatasetVariants, AnEpochThatDrawsNoUsableBucketSitsOut) {
    // Every draw of these tall images is bucket 0.5, outside the range: the epoch's layout is empty
    // (the dataset serves nothing that epoch) rather than an error or an out-of-range bucket.
    detail::RebucketInputs in;
    in.settings = random_settings({{0.5, {}}});
    in.settings.minimum_aspect_ratio = 0.75;
    for (int i = 0; i < 3; ++i) in.indexed["img" + std::to_string(i)].original = {64, 128};
    in.check.dataset_id = "pics";
    in.check.train_batch_size = 1;
    const detail::EpochLayout layout = detail::layout_for_epoch(in, 4);
    EXPECT_TRUE(layout.global.empty());
    EXPECT_EQ(layout.samples, 0);
    EXPECT_TRUE(layout.plans.empty());
    data::BucketSampler sampler(layout.global, 1, 0, 0, "pics");
    EXPECT_EQ(sampler.batches_per_epoch(), 0);
    EXPECT_FALSE(sampler.next().has_value());
}

TEST(DatasetVariants, VaeCacheDisableDrawsAFreshSampleEachEpoch) {
    Workspace s(4, 4);
    s.entry["vae_cache_disable"] = true;
    nlohmann::json mid;
    const auto straight = draw(s.options(1, 2), 24, nullptr, &mid, 13);  // three epochs of 8
    std::vector<std::map<std::string, at::Tensor>> by_epoch(3);
    for (size_t i = 0; i < straight.size(); ++i)
        by_epoch[i / 8][straight[i].paths[0]] = straight[i].latents[0];
    for (const auto& [path, latent] : by_epoch[0]) {
        EXPECT_FALSE(at::equal(latent, by_epoch[1].at(path))) << path;
        EXPECT_FALSE(at::equal(by_epoch[1].at(path), by_epoch[2].at(path))) << path;
        // The same image underneath: only the 0.01-scale sample noise differs.
        EXPECT_TRUE(at::allclose(latent, by_epoch[1].at(path), 0, 0.1)) << path;
    }
    expect_same(straight, draw(s.options(1, 0), 11, &mid), 13);
}

}  // namespace
}  // namespace test_dataset_variants_local
}  // namespace dtune::train
