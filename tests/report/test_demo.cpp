// `dtune demo`'s pieces: the shapes dataset is deterministic and drawn where the caption says; the
// generated tokenizers load in dtune's CLIP tokenizer with whole-word merges and in dtune's T5
// tokenizer with whole-word pieces; and (integration) `dtune demo --steps 8` runs end to end:
// checkpoint + resume, validation, eval, TensorBoard, export and report.html — for SDXL and, with
// `--model_family flux`, for the tiny Flux.1 model's LoRA.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <set>

#include "core/fs.h"
#include "demo/demo_data.h"
#include "demo/demo_model.h"
#include "io/safetensors.h"
#include "models/clip/clip_tokenizer.h"
#include "models/t5/t5_tokenizer.h"
#include "report/html_report.h"
#include "support/test_support.h"

namespace dtune::demo {
namespace test_demo_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

TEST(DemoData, CaptionsMatchPixels) {
    const DemoSample s{"circle", "red", "blue"};
    EXPECT_EQ(s.caption(), "a red circle on a blue background");
    const io::RgbImage im = draw_sample(s, 64);
    const uint8_t* centre = im.row(32) + 3 * 32;
    const uint8_t* corner = im.row(1) + 3 * 1;
    EXPECT_GT(centre[0], 200);  // red shape in the middle
    EXPECT_LT(centre[2], 60);
    EXPECT_GT(corner[2], 200);  // blue background in the corner
    EXPECT_LT(corner[0], 60);
    // A square fills its corners' neighbourhood, a circle does not.
    const io::RgbImage sq = draw_sample({"square", "red", "blue"}, 64);
    const int off = 32 - 14;  // inside the square (half-width 0.28*64*0.85 = 15.2), outside the circle
    EXPECT_GT(sq.row(off)[3 * off], 200);
    EXPECT_LT(im.row(off)[3 * off], 60);
    std::set<std::string> shapes, colors, backgrounds;
    for (int i = 0; i < 12; ++i) {
        const auto d = demo_sample(i);
        EXPECT_NE(d.color, d.background);
        shapes.insert(d.shape), colors.insert(d.color), backgrounds.insert(d.background);
    }
    EXPECT_EQ(shapes.size(), 3u);
    EXPECT_GE(colors.size(), 4u);
    EXPECT_GE(backgrounds.size(), 4u);
}

TEST(DemoModel, TokenizerLoadsAndMergesWholeWords) {
    test::TempDir dir;
    const auto [vocab, merges] = make_demo_tokenizer(demo_vocabulary());
    fs::write_file_atomic(dir / "vocab.json", vocab);
    fs::write_file_atomic(dir / "merges.txt", merges);
    const auto tok = models::CLIPTokenizer::from_files(dir / "vocab.json", dir / "merges.txt");
    const auto v = nlohmann::json::parse(vocab);
    EXPECT_EQ(v.at("!").get<int>(), 0);  // 256 byte symbols first, then their "</w>" forms
    EXPECT_EQ(v.at("!</w>").get<int>(), 256);
    // "circle" and "background" are spelled by their merge chains into one token each.
    EXPECT_EQ(tok.encode_raw("circle"), (models::CLIPTokenizer::Ids{v.at("circle</w>").get<int64_t>()}));
    EXPECT_EQ(tok.encode_raw("background"),
              (models::CLIPTokenizer::Ids{v.at("background</w>").get<int64_t>()}));
    const auto ids = tok.encode_raw("a red circle on a blue background");
    EXPECT_GE(ids.size(), 7u);
    for (const auto id : ids) EXPECT_LT(id, static_cast<int64_t>(v.size()) - 2);  // no special tokens
}

TEST(DemoModel, T5TokenizerGivesOnePiecePerWord) {
    test::TempDir dir;
    fs::write_file_atomic(dir / "tokenizer.json", make_demo_t5_tokenizer(demo_vocabulary()));
    const auto tok = models::T5Tokenizer::load(dir / "tokenizer.json");
    EXPECT_EQ(tok.pad_id(), 0);
    EXPECT_EQ(tok.eos_id(), 1);
    EXPECT_EQ(tok.unk_id(), 2);
    const std::string space = "\xe2\x96\x81";  // "▁"
    models::T5Tokenizer::Ids want;
    for (const char* w : {"a", "red", "circle", "on", "a", "blue", "background"})
        want.push_back(tok.piece_id(space + w));
    want.push_back(tok.eos_id());
    EXPECT_EQ(tok.encode("a red  circle on a blue background"), want);
    for (const auto& w : demo_vocabulary()) EXPECT_EQ(tok.encode(w).size(), 2u) << w;  // the word, eos
    // A word outside the vocabulary is spelled letter by letter, never unknown.
    const auto zebra = tok.encode("zebra 42");
    EXPECT_EQ(zebra.size(), 10u);  // "▁", z, e, b, r, a, "▁", 4, 2, </s>
    for (const auto id : zebra) EXPECT_NE(id, tok.unk_id());
    EXPECT_EQ(tok.encode("a red circle", 6), (models::T5Tokenizer::Ids{want[0], want[1], want[2], 1, 0, 0}));
}

#ifdef DTUNE_BIN
TEST(DemoCli, RunsEndToEnd) {
    test::TempDir dir;
    const auto out = dir / "demo";
    const auto log = dir / "demo.log";
    const std::string cmd = std::string(DTUNE_BIN) + " demo --steps 8 --vae_fit_steps 4 --output_dir " +
                            out.string() + " > " + log.string() + " 2>&1";
    const int rc = std::system(cmd.c_str());
    std::ifstream in(log);
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    ASSERT_EQ(rc, 0) << text;
    const auto run = out / "run";
    EXPECT_NE(text.find("resumed from"), std::string::npos) << text;
    EXPECT_NE(text.find((run / "report.html").string()), std::string::npos) << text;
    EXPECT_TRUE(std::filesystem::exists(run / "checkpoint-4" / ".guard"));
    EXPECT_TRUE(std::filesystem::exists(run / "checkpoint-8" / ".guard"));
    EXPECT_EQ(report::read_jsonl(run / "metrics.jsonl").size(), 8u);
    EXPECT_GE(report::read_jsonl(run / "eval.jsonl").size(), 2u);
    const auto images = report::list_validation_images(run / "validation_images");
    std::set<int64_t> steps;
    std::set<std::string> names;
    for (const auto& im : images) steps.insert(im.step), names.insert(im.shortname);
    EXPECT_EQ(steps, (std::set<int64_t>{0, 2, 4, 6, 8}));
    EXPECT_EQ(names, (std::set<std::string>{"validation", "green_square", "yellow_triangle"}));
    for (const char* f : {"model_index.json", "unet/diffusion_pytorch_model.safetensors", "vae/config.json",
                          "tokenizer_2/vocab.json", "text_encoder_2/model.safetensors"})
        EXPECT_TRUE(std::filesystem::exists(run / "pipeline" / f)) << f;
    bool events = false;
    for (const auto& e : std::filesystem::directory_iterator(run / "logs" / "dtune"))
        events |= e.path().filename().string().find("tfevents") != std::string::npos;
    EXPECT_TRUE(events);
    std::ifstream html(run / "report.html");
    const std::string page((std::istreambuf_iterator<char>(html)), {});
    EXPECT_NE(page.find("finished at step 8"), std::string::npos);
    EXPECT_NE(page.find("eval-loss-chart"), std::string::npos);
    EXPECT_NE(page.find("36 images"), std::string::npos);  // the dataset summary
}

// The Flux.1 variant: a LoRA on the tiny Flux transformer trained with flow matching, eval loss,
// validation images through the Flux pipeline, the LoRA file with diffusers' Flux keys.
TEST(DemoCli, FluxRunsEndToEnd) {
    test::TempDir dir;
    const auto out = dir / "demo";
    const auto log = dir / "demo.log";
    const std::string cmd = std::string(DTUNE_BIN) +
                            " demo --model_family flux --steps 8 --vae_fit_steps 4 " + "--output_dir " +
                            out.string() + " > " + log.string() + " 2>&1";
    const int rc = std::system(cmd.c_str());
    std::ifstream in(log);
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    ASSERT_EQ(rc, 0) << text;
    const auto run = out / "run";
    EXPECT_NE(text.find("resumed from"), std::string::npos) << text;
    EXPECT_NE(text.find((run / "report.html").string()), std::string::npos) << text;
    EXPECT_NE(text.find("--guidance 1.0"), std::string::npos) << text;  // the sample command
    const auto index = nlohmann::json::parse(fs::read_file(out / "model" / "model_index.json"));
    EXPECT_EQ(index.at("_class_name"), "FluxPipeline");
    const auto resolved = nlohmann::json::parse(fs::read_file(out / "config" / "config.json"));
    EXPECT_EQ(resolved.at("model_family"), "flux");
    EXPECT_EQ(resolved.at("model_type"), "lora");
    EXPECT_TRUE(std::filesystem::exists(run / "checkpoint-4" / ".guard"));
    EXPECT_TRUE(std::filesystem::exists(run / "checkpoint-8" / ".guard"));
    const auto rows = report::read_jsonl(run / "metrics.jsonl");
    ASSERT_EQ(rows.size(), 8u);
    for (const auto& row : rows) EXPECT_TRUE(std::isfinite(row.at("loss").get<double>())) << row.dump();
    const auto eval = report::read_jsonl(run / "eval.jsonl");
    ASSERT_GE(eval.size(), 2u);
    for (const auto& row : eval) EXPECT_TRUE(std::isfinite(row.at("eval_loss").get<double>())) << row.dump();
    const auto images = report::list_validation_images(run / "validation_images");
    std::set<int64_t> steps;
    std::set<std::string> names;
    for (const auto& im : images) steps.insert(im.step), names.insert(im.shortname);
    EXPECT_EQ(steps, (std::set<int64_t>{0, 2, 4, 6, 8}));
    EXPECT_EQ(names, (std::set<std::string>{"validation", "green_square", "yellow_triangle"}));
    // The LoRA in diffusers' Flux layout: "transformer."-prefixed PEFT keys on the attention projections.
    const io::SafetensorsFile lora(run / "pytorch_lora_weights.safetensors");
    size_t keys = 0;
    for (const auto& name : lora.keys()) {
        EXPECT_EQ(name.rfind("transformer.", 0), 0u) << name;
        ++keys;
    }
    EXPECT_TRUE(lora.contains("transformer.single_transformer_blocks.1.attn.to_q.lora_A.weight"));
    EXPECT_TRUE(lora.contains("transformer.transformer_blocks.0.attn.to_add_out.lora_B.weight"));
    EXPECT_EQ(keys, 2u * (2 * 8 + 2 * 3));  // A and B; 8 targets per double block, 3 per single block
    std::ifstream html(run / "report.html");
    const std::string page((std::istreambuf_iterator<char>(html)), {});
    EXPECT_NE(page.find("finished at step 8"), std::string::npos);
    EXPECT_NE(page.find("eval-loss-chart"), std::string::npos);
}
#endif

}  // namespace
}  // namespace test_demo_local
}  // namespace dtune::demo
