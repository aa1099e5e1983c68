// `dtune sample` end to end on the CPU with the tiny SDXL fixture: runs the built binary, then
// checks that each PNG decodes at the asked size and that its JSON sidecar records the settings.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include <nlohmann/json.hpp>

#include "io/image.h"
#include "support/test_support.h"

namespace dtune {
namespace {

int run(const std::string& cmd) {
    const int rc = std::system(cmd.c_str());
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

TEST(SampleCli, WritesPngsAndSidecars) {
    test::TempDir tmp;
    const auto out = tmp / "out";
    const std::string cmd = std::string(DTUNE_BIN) + " sample --model " +
                            (test::fixtures_dir() / "tiny-sdxl").string() +
                            " --prompt 'a photo of a cat' --negative_prompt blurry --width 80 --height 48"
                            " --steps 3 --guidance 4.5 --guidance_rescale 0.3 --seed 11 --sampler dpmpp_2m"
                            " --batch 2 --device cpu --dtype fp32 --grid --output_dir " +
                            out.string();
    ASSERT_EQ(run(cmd), 0) << cmd;
    for (int i = 0; i < 2; ++i) {
        const auto stem = out / ("sample_11_" + std::to_string(i));
        const auto img = io::read_image(stem.string() + ".png");
        EXPECT_EQ(img.width, 80);
        EXPECT_EQ(img.height, 48);
        const auto j = nlohmann::json::parse(std::ifstream(stem.string() + ".json"));
        EXPECT_EQ(j.at("prompt"), "a photo of a cat");
        EXPECT_EQ(j.at("negative_prompt"), "blurry");
        EXPECT_EQ(j.at("width"), 80);
        EXPECT_EQ(j.at("height"), 48);
        EXPECT_EQ(j.at("steps"), 3);
        EXPECT_DOUBLE_EQ(j.at("guidance").get<double>(), 4.5);
        EXPECT_DOUBLE_EQ(j.at("guidance_rescale").get<double>(), 0.3);
        EXPECT_EQ(j.at("seed"), 11);
        EXPECT_EQ(j.at("sampler"), "dpmpp_2m");
        EXPECT_EQ(j.at("batch"), 2);
        EXPECT_EQ(j.at("index_in_batch"), i);
        EXPECT_EQ(j.at("device"), "cpu");
        EXPECT_EQ(j.at("dtype"), "fp32");
    }
    const auto grid = io::read_image(out / "grid_11.png");
    EXPECT_EQ(grid.width, 2 * 80 + 4);
    EXPECT_EQ(grid.height, 48);
}

TEST(SampleCli, BadOptionsExitWithUsageCode) {
    const std::string base = std::string(DTUNE_BIN) + " sample --model " +
                             (test::fixtures_dir() / "tiny-sdxl").string() + " --device cpu";
    EXPECT_EQ(run(base + " --prompt x --width 63 --output_dir /tmp/dtune_never 2>/dev/null"), 2);
    EXPECT_EQ(run(base + " --prompt x --bogus 1 2>/dev/null"), 2);
    EXPECT_EQ(run(base + " 2>/dev/null"), 2);  // no prompt
    // A single file needs --config_folder.
    const auto file = test::fixtures_dir() / "tiny-sdxl" / "unet" / "diffusion_pytorch_model.safetensors";
    EXPECT_EQ(run(std::string(DTUNE_BIN) + " sample --model " + file.string() + " --prompt x 2>/dev/null"),
              2);
}

}  // namespace
}  // namespace dtune
