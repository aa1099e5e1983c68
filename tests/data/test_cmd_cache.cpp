// `dtune cache` end to end on the tiny SDXL fixture: a dozen generated PNG/JPEG images plus one
// truncated PNG (its header reads, its pixels do not). Build → reuse (no encoder call) → a
// rewritten image rebuilds only its entry → damaged entries are detected and rebuilt → another
// resolution rebuilds everything. The run's own JSON report is checked against counts the test
// derives from what it did to the files.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include <sys/wait.h>

#include "core/error.h"
#include "core/fs.h"
#include "data/cache_codec.h"
#include "io/image.h"
#include "support/test_support.h"

namespace dtune {
namespace test_cmd_cache_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

namespace stdfs = std::filesystem;

class CmdCache : public ::testing::Test {
  protected:
    void SetUp() override {
        data_ = dir_ / "images";
        stdfs::create_directories(data_);
        for (int i = 0; i < 12; ++i) write_image(i, 48 + 8 * (i % 4), 48 + 8 * ((i + 1) % 3));
        io::RgbImage img(64, 64);
        const std::string png = io::encode_png(img);
        test::write_bytes(data_ / "truncated.png", png.substr(0, png.size() / 2));
        write_config(64);
    }

    void write_image(int i, int w, int h, int salt = 0) {
        io::RgbImage img(w, h);
        for (size_t k = 0; k < img.pixels.size(); ++k) img.pixels[k] = uint8_t((k * (i + 3) + salt) % 251);
        io::write_image(data_ / (std::string(i % 2 ? "photo_" : "drawing_") + std::to_string(i) +
                                 (i % 3 ? ".png" : ".jpg")),
                        img, 92);
    }

    void write_config(int resolution) {
        const nlohmann::json backends = nlohmann::json::array({{{"id", "imgs"},
                                                                {"type", "local"},
                                                                {"instance_data_dir", data_.string()},
                                                                {"resolution", resolution},
                                                                {"resolution_type", "pixel"},
                                                                {"crop", true},
                                                                {"crop_style", "center"},
                                                                {"crop_aspect", "square"},
                                                                {"cache_dir_vae", (dir_ / "vae").string()},
                                                                {"caption_strategy", "filename"},
                                                                {"vae_batch_size", 4}},
                                                               {{"id", "text"},
                                                                {"dataset_type", "text_embeds"},
                                                                {"default", true},
                                                                {"cache_dir", (dir_ / "text").string()},
                                                                {"compress_cache", false}}});
        fs::write_file_atomic(dir_ / "multidatabackend.json", backends.dump(2));
        const nlohmann::json config = {
            {"--model_family", "sdxl"},
            {"--pretrained_model_name_or_path", (test::fixtures_dir() / "tiny-sdxl").string()},
            {"--data_backend_config", (dir_ / "multidatabackend.json").string()},
            {"--output_dir", (dir_ / "out").string()},
            {"--seed", "42"},
            {"--resolution", resolution},
            {"--resolution_type", "pixel"}};
        fs::write_file_atomic(dir_ / "config.json", config.dump(2));
    }

    // Runs `dtune cache` and returns the latent and text parts of its report.
    std::pair<nlohmann::json, nlohmann::json> run() {
        const std::string cmd = std::string(DTUNE_BIN) + " cache --config " +
                                (dir_ / "config.json").string() + " > " + (dir_ / "log.txt").string() +
                                " 2>&1";
        const int rc = std::system(cmd.c_str());
        EXPECT_EQ(rc, 0) << fs::read_file(dir_ / "log.txt");
        const auto report = nlohmann::json::parse(fs::read_file(dir_ / "out" / "cache_report_rank0.json"));
        std::printf("dtune cache report: %s\n", report.dump().c_str());  // timings, for the record
        return {report.at("imgs").at("latents"), report.at("imgs").at("text")};
    }

    std::vector<stdfs::path> entries(const stdfs::path& dir) const {
        std::vector<stdfs::path> out;
        for (const auto& e : stdfs::recursive_directory_iterator(dir))
            if (e.path().extension() == ".safetensors") out.push_back(e.path());
        std::sort(out.begin(), out.end());
        return out;
    }

    test::TempDir dir_;
    stdfs::path data_;
};

TEST_F(CmdCache, BuildsReusesAndRepairsTheCaches) {
    auto [latents, text] = run();
    EXPECT_EQ(latents["total"], 13);
    EXPECT_EQ(latents["built"], 12);
    EXPECT_EQ(latents["skipped"], 1);
    // 13 filename captions (the unreadable image is bucketed; only its pixels fail) + dropout's "".
    EXPECT_EQ(text["built"], 14);
    const auto vae = entries(dir_ / "vae"), txt = entries(dir_ / "text");
    ASSERT_EQ(vae.size(), 12u);
    ASSERT_EQ(txt.size(), 14u);
    EXPECT_EQ(data::detect_compression(fs::read_file(vae[0])), data::CacheCompression::kZstd);
    EXPECT_EQ(data::detect_compression(fs::read_file(txt[0])), data::CacheCompression::kNone);
    const auto skipped = nlohmann::json::parse(fs::read_file(dir_ / "vae" / "skipped_images_rank0.json"));
    EXPECT_TRUE(skipped.contains((data_ / "truncated.png").string()));

    std::tie(latents, text) = run();
    EXPECT_EQ(latents["reused"], 12);
    EXPECT_EQ(latents["encoder_calls"], 0);
    EXPECT_EQ(text["reused"], 14);
    EXPECT_EQ(text["encoder_calls"], 0);

    write_image(5, 48 + 8 * (5 % 4), 48 + 8 * ((5 + 1) % 3), 1);  // same size, new pixels
    // Damage two entries other than photo_5's (entries are named by sha256 of the stem).
    std::vector<stdfs::path> others;
    for (const auto& p : vae)
        if (p.filename() != data::sha256_hex("photo_5") + ".safetensors") others.push_back(p);
    std::string a = fs::read_file(others[3]), b = fs::read_file(others[7]);
    test::write_bytes(others[3], a.substr(0, a.size() - 7));
    b[b.size() / 2] ^= 0x10;
    test::write_bytes(others[7], b);
    std::tie(latents, text) = run();
    EXPECT_EQ(latents["rebuilt_stale"], 1);
    EXPECT_EQ(latents["rebuilt_corrupt"], 2);
    EXPECT_EQ(latents["reused"], 9);

    write_config(128);
    std::tie(latents, text) = run();
    EXPECT_EQ(latents["rebuilt_stale"], 12);
    EXPECT_EQ(text["reused"], 14);
}

TEST_F(CmdCache, ReadsConfigAndOverridesLikeTrain) {
    // config.toml, command-line overrides and config.json's dataset fallbacks (here
    // minimum_image_size, which `dtune train` applies to every dataset) as `dtune train` reads them;
    // a cache built from other settings than training's would not be reused.
    fs::write_file_atomic(dir_ / "config.toml",
                          str("\"--model_family\" = \"sdxl\"\n", "pretrained_model_name_or_path = \"",
                              (test::fixtures_dir() / "tiny-sdxl").string(), "\"\n",
                              "data_backend_config = \"", (dir_ / "multidatabackend.json").string(), "\"\n",
                              "output_dir = \"", (dir_ / "out").string(), "\"\nseed = 42\n"));
    const std::string cmd = std::string(DTUNE_BIN) + " cache --config " + (dir_ / "config.toml").string() +
                            " --output_dir " + (dir_ / "other").string() + " --minimum_image_size 56 > " +
                            (dir_ / "log.txt").string() + " 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << fs::read_file(dir_ / "log.txt");
    ASSERT_TRUE(stdfs::exists(dir_ / "other" / "cache_report_rank0.json")) << fs::read_file(dir_ / "log.txt");
    EXPECT_FALSE(stdfs::exists(dir_ / "out" / "cache_report_rank0.json"));
    const auto report = nlohmann::json::parse(fs::read_file(dir_ / "other" / "cache_report_rank0.json"));
    // Both edges >= 56: 6 of the 12 images, plus the truncated 64x64 one (its header passes).
    EXPECT_EQ(report.at("imgs").at("latents").at("total"), 7);
    EXPECT_EQ(report.at("imgs").at("latents").at("built"), 6);
    // An unknown key is the same error as in `dtune train`.
    const std::string bad = std::string(DTUNE_BIN) + " cache --config " + (dir_ / "config.toml").string() +
                            " --learning_rat 1 > " + (dir_ / "log.txt").string() + " 2>&1";
    EXPECT_EQ(WEXITSTATUS(std::system(bad.c_str())), 2);
    EXPECT_NE(fs::read_file(dir_ / "log.txt").find("did you mean \"learning_rate\""), std::string::npos);
}

// Bad --rank / --world-size values: exit 2 naming them, before any model loads (before: exit 1
// with "rank 5 is outside world size 2", or std::stoi's bare "stoi" for a non-number).
TEST_F(CmdCache, BadRankOrWorldSizeIsAUsageError) {
    for (const char* bad : {"--world-size 2 --rank 5", "--rank abc", "--world-size 0", "--rank -1"}) {
        const std::string cmd = std::string(DTUNE_BIN) + " cache --config " +
                                (dir_ / "config.json").string() + " " + bad + " > " +
                                (dir_ / "log.txt").string() + " 2>&1";
        const int rc = std::system(cmd.c_str());
        EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 2) << bad << ": " << fs::read_file(dir_ / "log.txt");
        const std::string log = fs::read_file(dir_ / "log.txt");
        EXPECT_TRUE(log.find("--rank") != std::string::npos || log.find("--world-size") != std::string::npos)
            << bad << ": " << log;
        EXPECT_FALSE(stdfs::exists(dir_ / "out" / "cache")) << bad;
    }
}

}  // namespace
}  // namespace test_cmd_cache_local
}  // namespace dtune
