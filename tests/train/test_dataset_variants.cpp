// DatasetBatchSource's per-draw variants with stand-in encoders (no model): random_flip (both
// orientations prebuilt, mirrored latents and time ids, resume-exact), crop_aspect random
// (re-bucketed every epoch, one cache entry per size, resume-exact, ranks agree) and
// vae_cache_disable (a fresh posterior sample per epoch, resume-exact).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <map>
#include <set>

#include "core/error.h"
#include "train/dataset_loader.h"
#include "train/dataset_source.h"
#include "train/dataset_source_test_util.h"

namespace dtune::train {
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
        out.push_back({b.paths, b.latents, b.time_ids});
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
    int moved = 0;
    std::set<std::vector<int64_t>> all;
    for (const auto& [path, shape] : shapes[0]) {
        EXPECT_EQ(shapes[1].size(), 16u);
        moved += shapes[1].at(path) != shape;
        for (const auto& e : shapes) all.insert(e.at(path));
    }
    EXPECT_GT(moved, 3);  // 16 images, each moves with probability 2/3
    EXPECT_EQ(all.size(), 3u);
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
    const detail::EpochLayout layout = detail::layout_for_epoch(in, 0);
    for (const auto& [key, list] : layout.global) EXPECT_EQ(list.size() % 2, 0u) << key;  // full batches
    std::set<std::string> served;
    for (const auto& [key, list] : layout.global) served.insert(list.begin(), list.end());
    EXPECT_EQ(served.size(), 3u);  // nobody left out
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
}  // namespace dtune::train
