// End to end: `dtune train` on the tiny SDXL fixture (CPU) with generated images of two aspect
// ratios: the bucket index has both buckets, the latent and text caches are built by the first
// run (with the real tiny VAE and CLIP encoders) and reused untouched by a second run with another
// output_dir; a deleted latent entry is rebuilt alone. A LoRA run whose regularisation dataset is a
// `type: csv` list of URLs on a loopback HTTP server trains and logs regularisation_loss.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>

#include <sys/wait.h>

#include "core/fs.h"
#include "io/image.h"
#include "support/http_listener.h"
#include "support/test_support.h"

namespace dtune {
namespace test_train_data_cli_local {  // (named: unity builds merge files' anonymous namespaces)
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

TEST(TrainDataCli, LoRAWithACsvRegularisationDataset) {
    test::TempDir dir;
    test::HttpListener server;
    const auto images = dir / "images";
    stdfs::create_directories(images);
    std::string csv = "url,caption\n";
    for (int i = 0; i < 4; ++i) {
        io::RgbImage img(64, 64);
        for (size_t p = 0; p < img.pixels.size(); ++p)
            img.pixels[p] = static_cast<uint8_t>((p * 3 + i * 41) % 256);
        io::write_image(images / ("subject " + std::to_string(i) + ".png"), img);
        for (auto& v : img.pixels) v = static_cast<uint8_t>(255 - v);
        const std::string path = "/reg/" + std::to_string(i) + ".png";
        server.set_route(path, {200, io::encode_png(img)});
        csv += server.url(path) + ",a photo number " + std::to_string(i) + "\n";
    }
    fs::write_file_atomic(dir / "reg.csv", csv);
    const nlohmann::json backends =
        nlohmann::json::array({{{"id", "subject"},
                                {"instance_data_dir", images.string()},
                                {"resolution", 64},
                                {"resolution_type", "pixel"},
                                {"cache_dir_vae", (dir / "vae_subject").string()}},
                               {{"id", "reg"},
                                {"type", "csv"},
                                {"csv_file", (dir / "reg.csv").string()},
                                {"csv_cache_dir", (dir / "reg_images").string()},
                                {"csv_caption_column", "caption"},
                                {"caption_strategy", "csv"},
                                {"is_regularisation_data", true},
                                {"resolution", 64},
                                {"resolution_type", "pixel"},
                                {"cache_dir_vae", (dir / "vae_reg").string()}},
                               {{"id", "text"},
                                {"dataset_type", "text_embeds"},
                                {"default", true},
                                {"cache_dir", (dir / "text").string()}}});
    fs::write_file_atomic(dir / "multidatabackend.json", backends.dump(2));
    const nlohmann::json cfg = {
        {"--model_family", "sdxl"},
        {"--model_type", "lora"},
        {"--lora_rank", 4},
        {"--pretrained_model_name_or_path", (test::fixtures_dir() / "tiny-sdxl").string()},
        {"--data_backend_config", (dir / "multidatabackend.json").string()},
        {"--output_dir", (dir / "out").string()},
        {"--train_batch_size", 2},
        {"--max_train_steps", 4},
        {"--learning_rate", 1e-3},
        {"--optimizer", "torch-adamw"},
        {"--mixed_precision", "no"},
        {"--seed", 3},
        {"--device", "cpu"}};
    fs::write_file_atomic(dir / "config.json", cfg.dump(2));
    const std::string log = (dir / "train.log").string();
    ASSERT_EQ(run(std::string(DTUNE_BIN) + " train --config '" + (dir / "config.json").string() + "' 2>'" +
                  log + "'"),
              0)
        << fs::read_file(log);
    const std::string text = fs::read_file(log);
    EXPECT_NE(text.find("dataset 'reg': 4 image(s) listed in"), std::string::npos) << text;
    EXPECT_EQ(server.requests().size(), 4u);  // each URL fetched once
    EXPECT_TRUE(stdfs::exists(dir / "out" / "pytorch_lora_weights.safetensors"));
    std::ifstream metrics(dir / "out" / "metrics.jsonl");
    int rows = 0, regularisation = 0;
    for (std::string line; std::getline(metrics, line); ++rows) {
        const auto row = nlohmann::json::parse(line);
        if (!row.contains("regularisation_loss")) continue;
        ++regularisation;
        EXPECT_TRUE(std::isfinite(row.at("regularisation_loss").get<double>())) << line;
        EXPECT_EQ(row.at("regularisation_loss"), row.at("loss")) << line;  // one micro-batch per step
        EXPECT_TRUE(row.contains("regularisation_grad_norm")) << line;
    }
    EXPECT_EQ(rows, 4);
    // One epoch of two datasets of two batches each: both were drawn.
    EXPECT_EQ(regularisation, 2);
}

}  // namespace
}  // namespace test_train_data_cli_local
}  // namespace dtune
