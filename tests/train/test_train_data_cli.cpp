// End to end: `dtune train` on the tiny SDXL fixture (CPU) with generated images of two aspect
// ratios: the bucket index has both buckets, the latent and text caches are built by the first
// run (with the real tiny VAE and CLIP encoders) and reused untouched by a second run with another
// output_dir; a deleted latent entry is rebuilt alone.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>

#include <sys/wait.h>

#include "core/fs.h"
#include "io/image.h"
#include "support/test_support.h"

namespace dtune {
namespace {

namespace stdfs = std::filesystem;

int run(const std::string& cmd) {
    const int status = std::system(cmd.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int64_t count_entries(const stdfs::path& dir) {
    int64_t n = 0;
    if (!stdfs::exists(dir)) return 0;
    for (const auto& e : stdfs::recursive_directory_iterator(dir))
        if (e.is_regular_file() && e.path().extension() == ".safetensors") ++n;
    return n;
}

TEST(TrainDataCli, TwoAspectBucketsCachesBuiltThenReused) {
    test::TempDir dir;
    const auto images = dir / "images";
    stdfs::create_directories(images);
    for (int i = 0; i < 6; ++i) {
        for (const bool wide : {true, false}) {
            io::RgbImage img(wide ? 128 : 64, wide ? 64 : 128);
            for (size_t p = 0; p < img.pixels.size(); ++p)
                img.pixels[p] = static_cast<uint8_t>((p * 5 + i * 37 + (wide ? 3 : 0)) % 256);
            io::write_image(
                images / (std::string(wide ? "wide" : "tall") + " photo " + std::to_string(i) + ".png"), img);
        }
    }
    const nlohmann::json backends = nlohmann::json::array({{{"id", "tiny"},
                                                            {"type", "local"},
                                                            {"instance_data_dir", images.string()},
                                                            {"resolution", 64},
                                                            {"resolution_type", "pixel"},
                                                            {"caption_strategy", "filename"},
                                                            {"cache_dir_vae", (dir / "vae_cache").string()}},
                                                           {{"id", "text"},
                                                            {"dataset_type", "text_embeds"},
                                                            {"default", true},
                                                            {"cache_dir", (dir / "text_cache").string()}}});
    fs::write_file_atomic(dir / "multidatabackend.json", backends.dump(2));
    const nlohmann::json cfg = {
        {"--model_family", "sdxl"},
        {"--pretrained_model_name_or_path", (test::fixtures_dir() / "tiny-sdxl").string()},
        {"--data_backend_config", (dir / "multidatabackend.json").string()},
        {"--train_batch_size", 2},
        {"--learning_rate", 1e-4},
        {"--optimizer", "torch-adamw"},
        {"--mixed_precision", "no"},
        {"--seed", 3},
        {"--device", "cpu"}};
    fs::write_file_atomic(dir / "config.json", cfg.dump(2));
    auto train = [&](const std::string& out, const std::string& log, int steps = 1) {
        return run(std::string(DTUNE_BIN) + " train --config '" + (dir / "config.json").string() +
                   "' --output_dir '" + (dir / out).string() + "' --max_train_steps " +
                   std::to_string(steps) + " 2>'" + (dir / log).string() + "'");
    };

    ASSERT_EQ(train("first", "first.log", 2), 0) << fs::read_file(dir / "first.log");
    const std::string first = fs::read_file(dir / "first.log");
    EXPECT_NE(first.find("latents of 'tiny': 12 entries: 12 built, 0 reused"), std::string::npos) << first;
    EXPECT_EQ(count_entries(dir / "vae_cache"), 12);
    EXPECT_EQ(count_entries(dir / "text_cache"), 13);  // 12 captions + "" for caption dropout
    EXPECT_EQ(first.find("placeholder"), std::string::npos) << first;
    const auto index = nlohmann::json::parse(fs::read_file(images / "aspect_ratio_bucket_indices_tiny.json"));
    const auto& buckets = index.at("aspect_ratio_bucket_indices");
    EXPECT_EQ(buckets.size(), 2u) << buckets.dump();
    EXPECT_EQ(buckets.at("2.0").size(), 6u);
    EXPECT_EQ(buckets.at("0.5").size(), 6u);
    std::ifstream metrics(dir / "first" / "metrics.jsonl");
    int lines = 0;
    for (std::string line; std::getline(metrics, line); ++lines)
        EXPECT_TRUE(std::isfinite(nlohmann::json::parse(line).at("loss").get<double>())) << line;
    EXPECT_EQ(lines, 2);

    ASSERT_EQ(train("second", "second.log"), 0) << fs::read_file(dir / "second.log");
    const std::string second = fs::read_file(dir / "second.log");
    EXPECT_NE(second.find("12 entries: 0 built, 12 reused"), std::string::npos) << second;
    EXPECT_NE(second.find("13 entries: 0 built, 13 reused"), std::string::npos) << second;
    EXPECT_NE(second.find("0 encoder calls"), std::string::npos) << second;
    EXPECT_NE(second.find("VAE released after caching"), std::string::npos) << second;

    // One deleted latent entry: only it is rebuilt.
    for (const auto& e : stdfs::recursive_directory_iterator(dir / "vae_cache"))
        if (e.path().extension() == ".safetensors") {
            stdfs::remove(e.path());
            break;
        }
    ASSERT_EQ(train("third", "third.log"), 0) << fs::read_file(dir / "third.log");
    const std::string third = fs::read_file(dir / "third.log");
    EXPECT_NE(third.find("12 entries: 1 built, 11 reused"), std::string::npos) << third;
}

}  // namespace
}  // namespace dtune
