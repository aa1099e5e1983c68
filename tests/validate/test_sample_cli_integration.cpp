// `dtune sample` end to end on the CPU with the tiny SDXL fixture: runs the built binary, then
// checks that each PNG decodes at the asked size and that its JSON sidecar records the settings;
// a single file with --config_folder gives the folder's bytes; --lora at scale 0 gives the base
// image's bytes and at scale 1 other ones; --format webp/jpeg write decodable files.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "core/fs.h"
#include "io/image.h"
#include "io/safetensors.h"
#include "support/shell.h"
#include "support/test_support.h"
#include "tiny_single_file.h"

namespace dtune {
namespace test_sample_cli_integration_local {  // (named: unity builds merge files' anonymous namespaces)
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
    EXPECT_EQ(run(base + " --prompt x --format gif 2>/dev/null"), 2);
    EXPECT_EQ(run(base + " --prompt x --quality 0 2>/dev/null"), 2);
    EXPECT_EQ(run(base + " --prompt x --lora /no/such/lora.safetensors 2>/dev/null"), 2);
    // A NaN guidance used to pass and write a noise image with "guidance": null in its sidecar.
    test::TempDir tmp;
    for (const char* bad : {"--guidance nan", "--guidance inf", "--guidance_rescale nan"}) {
        EXPECT_EQ(run(base + " --prompt x --width 64 --height 64 --steps 1 " + bad + " --output_dir " +
                      (tmp / "nan").string() + " 2>/dev/null >/dev/null"),
                  2)
            << bad;
        EXPECT_FALSE(std::filesystem::exists(tmp / "nan" / "sample_0_0.png")) << bad;
    }
    // An --output_dir that cannot be made: exit 2 before sampling (before: exit 1 with a bare
    // "filesystem error" after the images were sampled).
    fs::write_file_atomic(tmp / "a_file", "x");
    const auto r = test::run_shell(base + " --prompt x --width 64 --height 64 --steps 1 --output_dir " +
                                   (tmp / "a_file" / "out").string() + " 2>&1");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("--output_dir '" + (tmp / "a_file" / "out").string() + "' cannot be created"),
              std::string::npos)
        << r.output;
    EXPECT_EQ(r.output.find("sampling"), std::string::npos) << r.output;
    // An unknown --sampler stops before the model is opened (here it does not even exist, which
    // would be exit 3), and the message lists dtune sample's own names.
    const auto s = test::run_shell(std::string(DTUNE_BIN) + " sample --model " + (tmp / "no_model").string() +
                                   " --prompt x --sampler foo 2>&1");
    EXPECT_EQ(s.exit_code, 2) << s.output;
    EXPECT_NE(s.output.find("dpmpp_2m_karras"), std::string::npos) << s.output;
    // A file that is not an SDXL base single file, without --config_folder: a data error (3).
    const auto file = test::fixtures_dir() / "tiny-sdxl" / "unet" / "diffusion_pytorch_model.safetensors";
    EXPECT_EQ(run(std::string(DTUNE_BIN) + " sample --model " + file.string() + " --prompt x 2>/dev/null"),
              3);
}

// Runs a small tiny-model sample into `out` with extra options and returns the image's bytes.
std::string sample_bytes(const std::string& model, const std::filesystem::path& out, const std::string& extra,
                         const std::string& ext = ".png") {
    const std::string cmd = std::string(DTUNE_BIN) + " sample --model " + model +
                            " --prompt 'a photo of a cat' --width 64 --height 64 --steps 2 --seed 5"
                            " --device cpu --dtype fp32 --threads 1 --output_dir " +
                            out.string() + " " + extra + " 2>/dev/null >/dev/null";
    EXPECT_EQ(run(cmd), 0) << cmd;
    return fs::read_file(out / ("sample_5_0" + ext));
}

TEST(SampleCli, SingleFileWithConfigFolderEqualsTheFolder) {
    test::TempDir tmp;
    const auto tiny = test::fixtures_dir() / "tiny-sdxl";
    const auto file = test::write_tiny_single_file(tiny, tmp / "tiny.safetensors");
    const std::string from_folder = sample_bytes(tiny.string(), tmp / "a", "");
    const std::string from_file = sample_bytes(file.string(), tmp / "b", "--config_folder " + tiny.string());
    EXPECT_FALSE(from_folder.empty());
    EXPECT_EQ(from_file, from_folder);
}

TEST(SampleCli, LoRAScaleZeroIsTheBaseImage) {
    test::TempDir tmp;
    const std::string tiny = (test::fixtures_dir() / "tiny-sdxl").string();
    const auto lora = test::fixtures_dir() / "reference" / "lora" / "pytorch_lora_weights.safetensors";
    const std::string base = sample_bytes(tiny, tmp / "base", "");
    EXPECT_EQ(sample_bytes(tiny, tmp / "zero", "--lora " + lora.string() + " --lora_scale 0"), base);
    EXPECT_NE(sample_bytes(tiny, tmp / "one", "--lora " + lora.string() + " --lora_scale 1"), base);
    const auto j = nlohmann::json::parse(std::ifstream(tmp / "one" / "sample_5_0.json"));
    EXPECT_EQ(j.at("lora"), lora.string());
    EXPECT_DOUBLE_EQ(j.at("lora_scale").get<double>(), 1.0);
}

// A LoRA whose layers have other sizes than the model's (one made for another model): exit 3 with
// advice that fits `dtune sample` (before: "set lora_rank / use_dora ... or drop init_lora", which
// are training options).
TEST(SampleCli, LoRAOfAnotherModelSaysSo) {
    test::TempDir tmp;
    const auto lora = test::fixtures_dir() / "reference" / "lora" / "pytorch_lora_weights.safetensors";
    io::TensorList tensors = io::load_safetensors(lora);
    bool widened = false;
    for (auto& [name, t] : tensors)
        if (!widened && name.find("lora.down.weight") != std::string::npos) {
            t = at::zeros({t.size(0), t.size(1) + 8}, t.options());  // in_features of another model
            widened = true;
        } else {
            t = t.clone();  // the loaded views die with the mapping
        }
    ASSERT_TRUE(widened);
    io::save_safetensors(tmp / "other.safetensors", tensors);
    const auto r = test::run_shell(
        std::string(DTUNE_BIN) + " sample --model " + (test::fixtures_dir() / "tiny-sdxl").string() +
        " --prompt x --width 64 --height 64 --steps 1 --device cpu --output_dir " + (tmp / "out").string() +
        " --lora " + (tmp / "other.safetensors").string() + " 2>&1");
    EXPECT_EQ(r.exit_code, 3) << r.output;
    EXPECT_NE(r.output.find((tmp / "other.safetensors").string() + ": the LoRA does not fit"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("the LoRA was made for another model"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("init_lora"), std::string::npos) << r.output;
}

TEST(SampleCli, WebpAndJpegOutputsDecode) {
    test::TempDir tmp;
    const std::string tiny = (test::fixtures_dir() / "tiny-sdxl").string();
    const auto png = io::decode_image(sample_bytes(tiny, tmp / "png", ""), "png");
    // Lossless WebP (quality 100) decodes to the PNG's pixels exactly.
    const std::string webp = sample_bytes(tiny, tmp / "webp", "--format webp --quality 100", ".webp");
    EXPECT_EQ(webp.substr(8, 4), "WEBP");
    EXPECT_EQ(io::decode_image(webp, "webp").pixels, png.pixels);
    const auto jpeg = io::decode_image(sample_bytes(tiny, tmp / "jpg", "--format jpeg", ".jpg"), "jpg");
    EXPECT_EQ(jpeg.width, 64);
    EXPECT_EQ(jpeg.height, 64);
}

// A copy of the tiny model with one tensor of `component`'s weights changed by `edit`.
std::filesystem::path altered_model(const test::TempDir& tmp, const std::string& component,
                                    const std::string& key, const std::function<void(at::Tensor&)>& edit) {
    const auto model = tmp / "model";
    std::filesystem::copy(test::fixtures_dir() / "tiny-sdxl", model,
                          std::filesystem::copy_options::recursive);
    const auto file = model / component / "diffusion_pytorch_model.safetensors";
    io::TensorList tensors;
    bool found = false;
    for (auto& [k, v] : io::load_safetensors(file)) {
        tensors.emplace_back(k, v.clone());
        if (k == key) edit(tensors.back().second), found = true;
    }
    EXPECT_TRUE(found) << key << " is not in " << file;
    io::save_safetensors(file, tensors);
    return model;
}

// NaN weights used to give a black PNG with exit code 0: the load refuses them (exit 3 naming the
// file and the tensor), and an output that is not finite although the weights are (here a VAE
// weight so large that the decoder overflows) writes no image and exits 3 saying why.
TEST(SampleCli, NonFiniteWeightsOrOutputExit3) {
    const std::string args = " --prompt x --width 64 --height 64 --steps 1 --device cpu --dtype fp32 2>&1";
    {
        test::TempDir tmp;
        const auto model = altered_model(tmp, "unet", "conv_in.bias", [](at::Tensor& t) { t[0] = NAN; });
        const auto r = test::run_shell(std::string(DTUNE_BIN) + " sample --model " + model.string() +
                                       " --output_dir " + (tmp / "out").string() + args);
        EXPECT_EQ(r.exit_code, 3) << r.output;
        EXPECT_NE(r.output.find("tensor 'conv_in.bias'"), std::string::npos) << r.output;
        EXPECT_NE(r.output.find((model / "unet").string()), std::string::npos) << r.output;
        EXPECT_FALSE(std::filesystem::exists(tmp / "out" / "sample_0_0.png"));
    }
    {
        test::TempDir tmp;
        const auto model =
            altered_model(tmp, "vae", "post_quant_conv.weight", [](at::Tensor& t) { t.fill_(3e38); });
        const auto r = test::run_shell(std::string(DTUNE_BIN) + " sample --model " + model.string() +
                                       " --output_dir " + (tmp / "out").string() + args);
        EXPECT_EQ(r.exit_code, 3) << r.output;
        EXPECT_NE(r.output.find("the decoded image from " + model.string()), std::string::npos) << r.output;
        EXPECT_NE(r.output.find("NaN or infinite values, so no image was written"), std::string::npos)
            << r.output;
        EXPECT_FALSE(std::filesystem::exists(tmp / "out" / "sample_0_0.png"));
    }
}

}  // namespace
}  // namespace test_sample_cli_integration_local
}  // namespace dtune
