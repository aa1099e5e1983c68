// End to end through `dtune train` on CPU with the tiny SDXL fixture: random_flip and
// crop_aspect random (re-bucketed per epoch) resume bit-exactly mid-epoch and across an epoch end,
// and flips change what is trained; vae_cache_disable (a fresh posterior sample per draw) resumes
// bit-exactly; a run after `dtune cache` reuses every latent entry and trains weights
// bit-identical to a run that built its own caches, and with crop_aspect random inside an aspect
// range `dtune cache` builds exactly the in-range entries training needs first.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <map>
#include <set>

#include <sys/wait.h>

#include "core/fs.h"
#include "io/image.h"
#include "io/safetensors.h"
#include "support/shell.h"
#include "support/test_support.h"

namespace dtune {
namespace test_train_variants_cli_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

namespace stdfs = std::filesystem;

using test::run_status;

// Two wide (128×64) and two tall (64×128) images with asymmetric content, 64 px buckets.
struct Workspace {
    test::TempDir dir;

    Workspace() {
        stdfs::create_directories(dir / "images");
        for (int i = 0; i < 4; ++i) {
            const bool wide = i % 2 == 0;
            io::RgbImage img(wide ? 128 : 64, wide ? 64 : 128);
            for (int y = 0; y < img.height; ++y)
                for (int x = 0; x < img.width; ++x)
                    for (int c = 0; c < 3; ++c)
                        img.at(x, y)[c] = static_cast<uint8_t>((x * (3 + i) + y * 5 + c * 70 + i * 40) % 256);
            io::write_image(dir / "images" / ("shape number " + std::to_string(i) + ".png"), img);
        }
    }

    // Writes <name>.json (config) and <name>_mdb.json with caches under <name>_vae/<name>_text.
    stdfs::path config(const std::string& name, const nlohmann::json& dataset_extra,
                       const nlohmann::json& config_extra = nlohmann::json::object()) const {
        nlohmann::json entry = {{"id", "tiny"},
                                {"type", "local"},
                                {"instance_data_dir", (dir / "images").string()},
                                {"resolution", 64},
                                {"resolution_type", "pixel"},
                                {"caption_strategy", "filename"},
                                {"cache_dir_vae", (dir / (name + "_vae")).string()}};
        entry.update(dataset_extra);
        const nlohmann::json backends =
            nlohmann::json::array({entry,
                                   {{"id", "text"},
                                    {"dataset_type", "text_embeds"},
                                    {"default", true},
                                    {"cache_dir", (dir / (name + "_text")).string()}}});
        fs::write_file_atomic(dir / (name + "_mdb.json"), backends.dump(2));
        nlohmann::json cfg = {
            {"--model_family", "sdxl"},
            {"--pretrained_model_name_or_path", (test::fixtures_dir() / "tiny-sdxl").string()},
            {"--data_backend_config", (dir / (name + "_mdb.json")).string()},
            {"--output_dir", (dir / (name + "_out")).string()},
            {"--train_batch_size", 1},
            {"--checkpointing_steps", 3},
            {"--learning_rate", 1e-3},
            {"--optimizer", "torch-adamw"},
            {"--mixed_precision", "no"},
            {"--gradient_checkpointing", false},
            {"--seed", 11},
            {"--deterministic", true},
            {"--device", "cpu"}};
        cfg.update(config_extra);
        const auto path = dir / (name + ".json");
        fs::write_file_atomic(path, cfg.dump(2));
        return path;
    }

    // `dtune train` into `out` for `steps` steps; the log goes to <out>.log (appended).
    int train(const stdfs::path& config, const std::string& out, int steps) const {
        return run_status(std::string(DTUNE_BIN) + " train --config '" + config.string() +
                          "' --output_dir '" + (dir / out).string() + "' --max_train_steps " +
                          std::to_string(steps) + " 2>>'" + (dir / (out + ".log")).string() + "'");
    }
    std::string log(const std::string& out) const { return fs::read_file(dir / (out + ".log")); }

    std::vector<std::pair<std::string, at::Tensor>> unet(const std::string& out) const {
        return io::load_safetensors(dir / out / "pipeline/unet/diffusion_pytorch_model.safetensors");
    }
};

// Number of tensors that differ between two runs' UNets (names must match).
int64_t differing(const std::vector<std::pair<std::string, at::Tensor>>& a,
                  const std::vector<std::pair<std::string, at::Tensor>>& b) {
    EXPECT_EQ(a.size(), b.size());
    int64_t n = 0;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
        EXPECT_EQ(a[i].first, b[i].first);
        n += at::equal(a[i].second, b[i].second) ? 0 : 1;
    }
    return n;
}

std::vector<std::string> entry_names(const stdfs::path& dir) {
    std::vector<std::string> out;
    if (!stdfs::exists(dir)) return out;
    for (const auto& e : stdfs::recursive_directory_iterator(dir))
        if (e.path().extension() == ".safetensors") out.push_back(e.path().filename().string());
    return out;
}

TEST(TrainVariantsCli, FlipsAndRandomAspectResumeExactlyAcrossEpochs) {
    Workspace w;
    const nlohmann::json random_aspect = {{"crop", true},
                                          {"crop_style", "random"},
                                          {"crop_aspect", "random"},
                                          {"crop_aspect_buckets", {0.5, 1.0, 2.0}}};
    const auto flips = w.config("flips", random_aspect, {{"--random_flip", true}});
    // 4 images, batch 1: 4 steps per epoch. Straight 12 steps; split at 3 (mid epoch 1), resumed to
    // 12 (through epochs 2 and 3, whose buckets are drawn after the resume). Three epochs, not two:
    // the aspect draw is seeded by the (temporary) image paths, and with two epochs all four images
    // kept one geometry in about one run in a hundred (the check at the end).
    ASSERT_EQ(w.train(flips, "straight", 12), 0) << w.log("straight");
    ASSERT_EQ(w.train(flips, "split", 3), 0) << w.log("split");

    // The same 3 steps without flips train on other latents and time ids: other weights.
    const auto plain = w.config("plain", random_aspect);
    ASSERT_EQ(w.train(plain, "no_flips", 3), 0) << w.log("no_flips");
    EXPECT_GT(differing(w.unet("split"), w.unet("no_flips")), 0);
    for (const auto& n : entry_names(w.dir / "plain_vae")) EXPECT_EQ(n.find("-flip"), std::string::npos) << n;

    ASSERT_EQ(w.train(flips, "split", 12), 0) << w.log("split");
    EXPECT_NE(w.log("split").find("resumed from"), std::string::npos) << w.log("split");
    EXPECT_EQ(differing(w.unet("straight"), w.unet("split")), 0);

    // The cache holds mirrored entries and, per image, entries of several sizes.
    const auto names = entry_names(w.dir / "flips_vae");
    std::map<std::string, std::set<std::string>> sizes;  // image hash → sizes met
    int flipped = 0;
    for (const auto& n : names) {
        flipped += n.find("-flip.") != std::string::npos;
        const auto dash = n.find('-');
        ASSERT_NE(dash, std::string::npos) << n;
        sizes[n.substr(0, dash)].insert(n.substr(dash + 1, n.find_first_of("-.", dash + 1) - dash - 1));
    }
    EXPECT_GT(flipped, 0);
    EXPECT_EQ(sizes.size(), 4u);
    size_t most = 0;
    for (const auto& [image, s] : sizes) most = std::max(most, s.size());
    EXPECT_GE(most, 2u);  // some image trained in two geometries over three epochs
}

TEST(TrainVariantsCli, VaeCacheDisableResumesExactly) {
    Workspace w;
    const auto cfg = w.config("disabled", {{"vae_cache_disable", true}, {"random_flip", true}});
    ASSERT_EQ(w.train(cfg, "straight", 6), 0) << w.log("straight");
    ASSERT_EQ(w.train(cfg, "split", 3), 0) << w.log("split");
    ASSERT_EQ(w.train(cfg, "split", 6), 0) << w.log("split");
    EXPECT_NE(w.log("split").find("resumed from"), std::string::npos);
    EXPECT_EQ(differing(w.unet("straight"), w.unet("split")), 0);
    EXPECT_TRUE(entry_names(w.dir / "disabled_vae").empty());  // nothing cached
}

TEST(TrainVariantsCli, TrainingAfterDtuneCacheReusesItAndTrainsIdentically) {
    Workspace w;
    const nlohmann::json dataset = {{"crop", true}, {"crop_style", "random"}, {"crop_aspect", "square"}};
    const auto cached = w.config("cached", dataset, {{"--random_flip", true}});
    const auto own = w.config("own", dataset, {{"--random_flip", true}});
    ASSERT_EQ(run_status(std::string(DTUNE_BIN) + " cache --config '" + cached.string() + "' >'" +
                         (w.dir / "cache.log").string() + "' 2>&1"),
              0)
        << fs::read_file(w.dir / "cache.log");
    EXPECT_EQ(entry_names(w.dir / "cached_vae").size(), 8u);  // 4 images × (plain, mirrored)
    ASSERT_EQ(w.train(cached, "after_cache", 2), 0) << w.log("after_cache");
    EXPECT_NE(w.log("after_cache").find("latents of 'tiny': 8 entries: 0 built, 8 reused"), std::string::npos)
        << w.log("after_cache");
    ASSERT_EQ(w.train(own, "own_caches", 2), 0) << w.log("own_caches");
    EXPECT_NE(w.log("own_caches").find("latents of 'tiny': 8 entries: 8 built, 0 reused"), std::string::npos)
        << w.log("own_caches");
    EXPECT_EQ(differing(w.unet("after_cache"), w.unet("own_caches")), 0);
    // The entries themselves are byte-identical, file for file.
    for (const auto& n : entry_names(w.dir / "cached_vae"))
        EXPECT_EQ(fs::read_file(w.dir / "cached_vae" / n), fs::read_file(w.dir / "own_vae" / n)) << n;
}

// text_encoder_N_precision: `dtune cache` quantises the text encoders as training does, so the
// training run reuses every text embedding it wrote.
TEST(TrainVariantsCli, DtuneCacheQuantisesTextEncodersAsTrainingDoes) {
    Workspace w;
    const auto cfg =
        w.config("quantised", nlohmann::json::object(), {{"--text_encoder_2_precision", "int8-torchao"}});
    ASSERT_EQ(run_status(std::string(DTUNE_BIN) + " cache --config '" + cfg.string() + "' >'" +
                         (w.dir / "cache.log").string() + "' 2>&1"),
              0)
        << fs::read_file(w.dir / "cache.log");
    EXPECT_NE(fs::read_file(w.dir / "cache.log").find("quantised text encoder 2 (int8-torchao"),
              std::string::npos);
    ASSERT_EQ(w.train(cfg, "after_cache", 1), 0) << w.log("after_cache");
    const std::string log = w.log("after_cache");
    const auto at = log.find("text embeddings in ");
    ASSERT_NE(at, std::string::npos) << log;
    EXPECT_NE(log.find(" 0 built", at), std::string::npos) << log.substr(at, 200);
    EXPECT_NE(log.find(" 0 rebuilt (inputs changed)", at), std::string::npos) << log.substr(at, 200);
}

TEST(TrainVariantsCli, DtuneCacheBuildsWhatRandomAspectTrainsWithinTheAspectRange) {
    // Wide images draw bucket 1.0 or 2.0, tall ones 0.5 or 1.0; [0.75, 1.5] keeps bucket 1.0 only.
    // `dtune cache` must build exactly epoch 1's in-range entries, whichever images the bucket
    // index's own draw set aside, and training must reuse all of them.
    Workspace w;
    // Each image draws its bucket from a seed that depends on the temporary folder's path: with the
    // workspace's four images all four land out of range about one run in sixteen (no samples at
    // all). Twelve images make that one in four thousand.
    for (int copy = 1; copy <= 2; ++copy)
        for (int i = 0; i < 4; ++i)
            std::filesystem::copy_file(
                w.dir / "images" / ("shape number " + std::to_string(i) + ".png"),
                w.dir / "images" /
                    ("shape copy " + std::to_string(copy) + " number " + std::to_string(i) + ".png"));
    const auto cfg = w.config("ranged", {{"crop", true},
                                         {"crop_style", "random"},
                                         {"crop_aspect", "random"},
                                         {"crop_aspect_buckets", {0.5, 1.0, 2.0}},
                                         {"minimum_aspect_ratio", 0.75},
                                         {"maximum_aspect_ratio", 1.5}});
    ASSERT_EQ(run_status(std::string(DTUNE_BIN) + " cache --config '" + cfg.string() + "' >'" +
                         (w.dir / "cache.log").string() + "' 2>&1"),
              0)
        << fs::read_file(w.dir / "cache.log");
    const auto cached = entry_names(w.dir / "ranged_vae");
    EXPECT_FALSE(cached.empty());
    for (const auto& n : cached) EXPECT_NE(n.find("-64x64_"), std::string::npos) << n;  // bucket 1.0 only
    ASSERT_EQ(w.train(cfg, "after_cache", 2), 0) << w.log("after_cache");
    const std::string log = w.log("after_cache");
    const auto at = log.find("latents of 'tiny': ");
    ASSERT_NE(at, std::string::npos) << log;
    int entries = -1, built = -1, reused = -1;
    ASSERT_EQ(std::sscanf(log.c_str() + at, "latents of 'tiny': %d entries: %d built, %d reused", &entries,
                          &built, &reused),
              3)
        << log;
    EXPECT_EQ(entries, int(cached.size()));
    EXPECT_EQ(built, 0) << log;
    EXPECT_EQ(reused, entries);
}

}  // namespace
}  // namespace test_train_variants_cli_local
}  // namespace dtune
