// evaluation_type clip against transformers and torchmetrics: tools/ref/gen_clip_ref.py built a tiny
// CLIPModel (the fixture's tiny-sdxl text encoder as its text tower, a random vision tower saved in
// tests/data/ref/tiny-clip-vision.safetensors) and recorded the preprocessing, both towers'
// projected features and torchmetrics' clip_score for two images and two prompts
// (clip_score_io.safetensors). Here the same folder is assembled and dtune must give the same
// numbers; plus SimpleTuner's statistics over prompts and the refusal of a hub id with no local copy.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>

#include "core/error.h"
#include "core/fs.h"
#include "io/safetensors.h"
#include "notify/webhooks.h"
#include "observer_test_util.h"
#include "report/clip_score.h"
#include "report/html_report.h"
#include "report/observers.h"
#include "report/validation.h"
#include "support/http_listener.h"
#include "support/test_support.h"

namespace dtune::report {
namespace test_clip_score_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

const std::filesystem::path kRef = std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref";

double max_diff(const at::Tensor& a, const at::Tensor& b) {
    return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// The tiny CLIPModel folder: config, weights (text tower from the fixture), tokenizer files.
std::filesystem::path assemble_tiny_clip(const test::TempDir& dir) {
    const auto out = dir / "tiny-clip";
    std::filesystem::create_directories(out);
    const auto fixture = test::fixtures_dir() / "tiny-sdxl";
    io::TensorList tensors;
    const io::SafetensorsFile text(fixture / "text_encoder" / "model.safetensors");
    for (const auto& k : text.keys()) {
        if (k.ends_with("position_ids")) continue;
        tensors.emplace_back(k.rfind("text_model.", 0) == 0 ? k : "text_model." + k, text.get(k).clone());
    }
    const io::SafetensorsFile vision(kRef / "tiny-clip-vision.safetensors");
    for (const auto& k : vision.keys()) tensors.emplace_back(k, vision.get(k).clone());
    io::save_safetensors(out / "model.safetensors", tensors);
    std::filesystem::copy_file(kRef / "tiny-clip-config.json", out / "config.json");
    for (const auto& e : std::filesystem::directory_iterator(fixture / "tokenizer"))
        std::filesystem::copy_file(e.path(), out / e.path().filename());
    return out;
}

io::RgbImage to_rgb(const at::Tensor& chw) {  // [3, H, W] float with integer values
    const at::Tensor hwc = chw.permute({1, 2, 0}).to(at::kByte).contiguous();
    io::RgbImage img(static_cast<int>(hwc.size(1)), static_cast<int>(hwc.size(0)));
    std::memcpy(img.pixels.data(), hwc.data_ptr<uint8_t>(), img.pixels.size());
    return img;
}

TEST(ClipScore, PreprocessingFeaturesAndScoresMatchTransformersAndTorchmetrics) {
    test::TempDir dir;
    const auto folder = assemble_tiny_clip(dir);
    const io::SafetensorsFile ref(kRef / "clip_score_io.safetensors");
    const at::Tensor pixels = ref.get("pixel_values").clone();
    for (int i = 0; i < 2; ++i)
        EXPECT_LE(max_diff(models::clip_preprocess(ref.get(str("image_", i)).clone(), 32), pixels[i]), 1e-4)
            << "image " << i;
    models::CLIPModel model = models::load_clip_model(folder);
    torch::NoGradGuard no_grad;
    const at::Tensor img = model->image_features(pixels);
    const at::Tensor want_img = ref.get("image_features").clone();
    EXPECT_LE(max_diff(img, want_img), 1e-4 * std::max(1.0, want_img.abs().max().item<double>()));
    const at::Tensor ids = ref.get("input_ids").clone();
    const at::Tensor txt = model->text_features(ids);
    const at::Tensor want_txt = ref.get("text_features").clone();
    EXPECT_LE(max_diff(txt, want_txt), 1e-4 * std::max(1.0, want_txt.abs().max().item<double>()));

    CLIPScorer scorer(folder, c10::Device(c10::kCPU));
    const at::Tensor scores = ref.get("scores").clone();
    const std::vector<std::string> prompts = {"a photo of a cat", "a red circle on a blue background"};
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j)
            EXPECT_NEAR(scorer.score(to_rgb(ref.get(str("image_", i)).clone()), prompts[j]),
                        scores[i][j].item<double>(), 1e-3)
                << "image " << i << " prompt " << j;
}

TEST(ClipScore, StatisticsOverPromptsAreSimpleTunersAndAMissingModelIsRefused) {
    const nlohmann::json s = clip_stats({{"a", 20.0}, {"b", 30.0}, {"c", 31.0}});
    EXPECT_DOUBLE_EQ(s.at("clip/min").get<double>(), 20.0);
    EXPECT_DOUBLE_EQ(s.at("clip/max").get<double>(), 31.0);
    EXPECT_DOUBLE_EQ(s.at("clip/mean").get<double>(), 27.0);
    EXPECT_NEAR(s.at("clip/std").get<double>(), std::sqrt((49.0 + 9.0 + 16.0) / 3.0), 1e-12);  // population
    EXPECT_TRUE(clip_stats({}).is_null());

    test::TempDir home;
    setenv("HOME", home.path().c_str(), 1);
    unsetenv("HF_HOME");
    unsetenv("HF_HUB_CACHE");
    train::TrainConfig c;
    c.merge_json(
        {{"model_family", "sdxl"}, {"validation_prompt", "a cat"}, {"evaluation_type", "clip"}, {"seed", 1}},
        "test");
    try {
        validation_settings(c);
        FAIL() << "a hub id with no local copy was accepted";
    } catch (const UsageError& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("openai/clip-vit-large-patch14-336"), std::string::npos) << m;
        EXPECT_NE(m.find("huggingface-cli download"), std::string::npos) << m;
    }
    // The same id in the Hugging Face cache is found.
    const auto snap = home / ".cache" / "huggingface" / "hub" / "models--openai--clip-vit-large-patch14-336" /
                      "snapshots" / "abc123";
    std::filesystem::create_directories(snap);
    fs::write_file_atomic(snap / "config.json", "{}");
    EXPECT_EQ(validation_settings(c).clip_model, snap);
}

// In a training run: each validation (steps 0, 2, 4) appends a metrics.jsonl row with
// clip/min, clip/max, clip/mean and clip/std, and report.html charts clip/mean.
TEST(ClipScore, ValidationRunsLogTheirScores) {
    test::TempDir dir;
    const auto folder = assemble_tiny_clip(dir);
    const auto c =
        testutil::config(dir.path() / "out", {{"validation_prompt", "a red circle"},
                                              {"evaluation_type", "clip"},
                                              {"pretrained_evaluation_model_name_or_path", folder.string()}});
    auto trainer = testutil::make_trainer(c);
    test::HttpListener listener;
    notify::WebhookTarget target;
    target.type = notify::WebhookType::kRaw;
    target.url = listener.url("/hook");
    auto notifier =
        std::make_shared<notify::Notifier>(std::vector<notify::WebhookTarget>{target}, "job", true);
    add_observers(*trainer, notifier);
    trainer->run();
    ASSERT_TRUE(notifier->flush(std::chrono::seconds(20)));
    // Webhooks: one SimpleTuner notification per validation run, with the scores in `data`.
    std::vector<int64_t> notified;
    for (const auto& r : listener.requests()) {
        const auto body = nlohmann::json::parse(r.body);
        if (body.at("type") != "notification") continue;
        notified.push_back(body.at("data").at("step").get<int64_t>());
        EXPECT_TRUE(body.at("data").contains("clip/mean")) << body.dump();
        EXPECT_NE(body.at("message").get<std::string>().find("CLIP score"), std::string::npos);
    }
    EXPECT_EQ(notified, (std::vector<int64_t>{0, 2, 4}));
    notifier->close(std::chrono::seconds(5));
    std::vector<int64_t> steps;
    for (const auto& row : read_jsonl(dir / "out" / "metrics.jsonl")) {
        if (!row.contains("clip/mean")) continue;
        steps.push_back(row.at("step").get<int64_t>());
        for (const char* k : {"clip/min", "clip/max", "clip/mean", "clip/std"})
            EXPECT_TRUE(row.contains(k)) << k;
        EXPECT_GE(row.at("clip/mean").get<double>(), 0.0);
        EXPECT_DOUBLE_EQ(row.at("clip/std").get<double>(), 0.0);  // one prompt
    }
    EXPECT_EQ(steps, (std::vector<int64_t>{0, 2, 4}));
    EXPECT_NE(fs::read_file(dir / "out" / "report.html").find("clip-chart"), std::string::npos);
}

}  // namespace
}  // namespace test_clip_score_local
}  // namespace dtune::report
