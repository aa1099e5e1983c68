// TrainConfig: SimpleTuner defaults (SIMPLETUNER.md §6, typed by hand here), "--" keys, aliases,
// command-line overrides, unknown / unimplemented keys, the resolved file.
#include <gtest/gtest.h>

#include <fstream>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "support/test_support.h"
#include "train/config.h"

namespace dtune::train {
namespace {

TrainConfig load_text(const test::TempDir& dir, const std::string& json_text,
                      const std::vector<std::string>& overrides = {}) {
    const auto path = dir / "config.json";
    std::ofstream(path) << json_text;
    return TrainConfig::load(path, overrides);
}

std::string usage_message(const std::function<void()>& fn) {
    try {
        fn();
    } catch (const UsageError& e) {
        return e.what();
    }
    return "<no UsageError>";
}

TEST(TrainConfig, DefaultsAreSimpleTunersTable) {
    test::TempDir dir;
    const TrainConfig c = load_text(dir, R"({"model_family": "sdxl"})");
    EXPECT_EQ(c.text("model_type"), "full");
    EXPECT_EQ(c.text("model_flavour"), "base-1.0");
    EXPECT_EQ(c.text("output_dir"), "simpletuner-results");
    EXPECT_EQ(c.integer("lora_rank"), 16);
    EXPECT_TRUE(c.is_null("lora_alpha"));
    EXPECT_DOUBLE_EQ(c.real("lora_dropout"), 0.1);
    EXPECT_DOUBLE_EQ(c.real("learning_rate"), 4e-7);
    EXPECT_EQ(c.text("lr_scheduler"), "constant_with_warmup");
    EXPECT_DOUBLE_EQ(c.real("lr_power"), 0.8);
    EXPECT_EQ(c.text("optimizer"), "adamw_bf16");
    EXPECT_DOUBLE_EQ(c.real("adam_weight_decay"), 0.01);
    EXPECT_DOUBLE_EQ(c.real("adam_epsilon"), 1e-8);
    EXPECT_DOUBLE_EQ(c.real("max_grad_norm"), 2.0);
    EXPECT_EQ(c.text("grad_clip_method"), "value");
    EXPECT_EQ(c.integer("train_batch_size"), 4);
    EXPECT_EQ(c.integer("gradient_accumulation_steps"), 1);
    EXPECT_FALSE(c.opt_integer("max_train_steps").has_value());
    EXPECT_EQ(c.integer("num_train_epochs"), 1);
    EXPECT_EQ(c.integer("checkpoint_step_interval"), 500);
    EXPECT_EQ(c.integer("checkpoints_total_limit"), 5);
    EXPECT_EQ(c.text("resume_from_checkpoint"), "latest");
    EXPECT_EQ(c.text("mixed_precision"), "bf16");
    EXPECT_TRUE(c.flag("gradient_checkpointing"));
    EXPECT_FALSE(c.flag("offset_noise"));
    EXPECT_DOUBLE_EQ(c.real("noise_offset"), 0.1);
    EXPECT_TRUE(c.is_null("snr_gamma"));
    EXPECT_DOUBLE_EQ(c.real("caption_dropout_probability"), 0.1);
    EXPECT_DOUBLE_EQ(c.real("ema_decay"), 0.995);
    EXPECT_EQ(c.text("validation_negative_prompt"), "blurry, cropped, ugly");
}

TEST(TrainConfig, DashedKeysAliasesAndStringsAreTyped) {
    test::TempDir dir;
    const TrainConfig c = load_text(dir, R"({"--model_family": "sdxl", "--learning_rate": "1e-4",
        "--checkpointing_steps": 20, "train_batch_size": "2", "--use_dora": "true", "seed": 42.0,
        "--model_type": "lora"})");
    EXPECT_DOUBLE_EQ(c.real("learning_rate"), 1e-4);
    EXPECT_EQ(c.integer("checkpoint_step_interval"), 20);
    EXPECT_EQ(c.integer("train_batch_size"), 2);
    EXPECT_TRUE(c.flag("use_dora"));
    EXPECT_EQ(c.integer("seed"), 42);
    EXPECT_EQ(c.text("model_type"), "lora");
}

TEST(TrainConfig, CommandLineOverridesWinOverTheFile) {
    test::TempDir dir;
    const TrainConfig c = load_text(dir, R"({"model_family": "sdxl", "learning_rate": 1e-5, "seed": 1})",
                                    {"--learning_rate", "1e-4", "--set", "seed=7", "--snr_gamma=5",
                                     "--offset_noise", "--output_dir", "/tmp/x"});
    EXPECT_DOUBLE_EQ(c.real("learning_rate"), 1e-4);
    EXPECT_EQ(c.integer("seed"), 7);
    EXPECT_DOUBLE_EQ(*c.opt_real("snr_gamma"), 5.0);
    EXPECT_TRUE(c.flag("offset_noise"));
    EXPECT_EQ(c.text("output_dir"), "/tmp/x");
}

TEST(TrainConfig, UnknownKeySuggestsTheClosest) {
    test::TempDir dir;
    const std::string m =
        usage_message([&] { load_text(dir, R"({"model_family": "sdxl", "learning_rat": 1})"); });
    EXPECT_NE(m.find("unknown option \"learning_rat\""), std::string::npos) << m;
    EXPECT_NE(m.find("did you mean \"learning_rate\""), std::string::npos) << m;
}

TEST(TrainConfig, UnimplementedOptionIsAnErrorUnlessDefault) {
    test::TempDir dir;
    const std::string m = usage_message(
        [&] { load_text(dir, R"({"model_family": "sdxl", "--base_model_precision": "int8-quanto"})"); });
    EXPECT_NE(m.find("option base_model_precision is not implemented by dtune yet"), std::string::npos) << m;
    // SimpleTuner's default value changes nothing and is accepted.
    EXPECT_NO_THROW(load_text(dir, R"({"model_family": "sdxl", "base_model_precision": "no_change"})"));
    EXPECT_NE(usage_message([&] {
                  load_text(dir, R"({"model_family": "sdxl", "slider_lora_target": true})");
              }).find("slider_lora_target is not implemented"),
              std::string::npos);
    // EMA and its companions are implemented now.
    EXPECT_NO_THROW(load_text(dir, R"({"model_family": "sdxl", "use_ema": true, "ema_device": "accelerator",
                                       "ema_update_interval": 2, "ema_warmup_steps": 3})"));
}

TEST(TrainConfig, SimpleTunerDatasetFallbacksAreOptions) {
    // SimpleTuner's --caption_strategy & co. are the fallbacks of multidatabackend.json entries.
    test::TempDir dir;
    const TrainConfig d = load_text(dir, R"({"model_family": "sdxl"})");
    EXPECT_EQ(d.text("caption_strategy"), "filename");
    EXPECT_FALSE(d.flag("prepend_instance_prompt"));
    EXPECT_FALSE(d.flag("only_instance_prompt"));
    EXPECT_EQ(d.text("skip_file_discovery"), "");
    EXPECT_EQ(d.text("parquet_filename_column"), "id");
    EXPECT_EQ(d.text("parquet_caption_column"), "description");
    const TrainConfig c = load_text(dir, R"({"model_family": "sdxl", "--caption_strategy": "textfile",
        "--prepend_instance_prompt": true, "--parquet_caption_column": "tags"})",
                                    {"--only_instance_prompt", "--skip_file_discovery", "vae aspect"});
    EXPECT_EQ(c.text("caption_strategy"), "textfile");
    EXPECT_TRUE(c.flag("prepend_instance_prompt"));
    EXPECT_TRUE(c.flag("only_instance_prompt"));
    EXPECT_EQ(c.text("skip_file_discovery"), "vae aspect");
    EXPECT_EQ(c.text("parquet_caption_column"), "tags");
    const std::string m =
        usage_message([&] { load_text(dir, R"({"model_family": "sdxl", "caption_strategy": "csv"})"); });
    EXPECT_NE(m.find("caption_strategy = \"csv\" is not supported"), std::string::npos) << m;
}

TEST(TrainConfig, SimpleTunerKeysAtTheirDefaultLoad) {
    // Keys of SimpleTuner's table that dtune does not implement: a config that leaves them at
    // SimpleTuner's default (as written by SimpleTuner's own examples) loads; another value is an
    // error naming the key, never "unknown option".
    test::TempDir dir;
    EXPECT_NO_THROW(
        load_text(dir, R"({"model_family": "sdxl", "--lycoris_config": "config/lycoris_config.json",
        "--timestep_bias_strategy": null, "--eval_epoch_interval": null, "--eval_dataset_id": null,
        "--validation_preview_steps": 1, "--dynamo_mode": "", "--dynamo_fullgraph": false,
        "--dynamo_dynamic": false, "--dynamo_use_regional_compilation": false,
        "--disable_bucket_pruning": false, "--enable_nsfw_check": false, "--fsdp_enable": false,
        "--fuse_optimizer": false, "--optimizer_release_gradients": false,
        "--disable_multiprocessing": false,
        "--pretrained_evaluation_model_name_or_path": "openai/clip-vit-large-patch14-336"})"));
    for (const char* key : {"eval_epoch_interval", "fuse_optimizer", "fsdp_enable", "dynamo_mode"}) {
        const std::string m = usage_message([&] {
            load_text(dir, R"({"model_family": "sdxl"})", {str("--", key), "2"});
        });
        EXPECT_NE(m.find(str("option ", key, " is not implemented by dtune yet")), std::string::npos) << m;
    }
}

TEST(TrainConfig, PythonSpellingsOfBooleansAndNone) {
    // SimpleTuner users write Python's True/False/None on command lines and in configs.
    test::TempDir dir;
    const TrainConfig c = load_text(dir, R"({"model_family": "sdxl", "use_ema": "True",
        "gradient_checkpointing": "False", "seed": "None", "--use_soft_min_snr": "False",
        "--timestep_bias_strategy": "None", "--lora_target_modules": "None"})",
                                    {"--offset_noise", "TRUE", "--validation_on_startup", "False"});
    EXPECT_TRUE(c.flag("use_ema"));
    EXPECT_FALSE(c.flag("gradient_checkpointing"));
    EXPECT_TRUE(c.flag("offset_noise"));
    EXPECT_TRUE(c.is_null("seed"));
    const TrainConfig n = load_text(dir, R"({"model_family": "sdxl", "prediction_type": "None"})",
                                    {"--validation_noise_scheduler", "None"});
    EXPECT_TRUE(n.is_null("prediction_type"));
    EXPECT_TRUE(n.is_null("validation_noise_scheduler"));
    EXPECT_NE(usage_message([&] {
                  load_text(dir, R"({"model_family": "sdxl", "use_ema": "Yes"})");
              }).find("use_ema"),
              std::string::npos);
}

TEST(TrainConfig, BadValuesNameTheKey) {
    test::TempDir dir;
    EXPECT_NE(usage_message([&] {
                  load_text(dir, R"({"model_family": "sdxl", "lora_rank": "x"})");
              }).find("lora_rank"),
              std::string::npos);
    EXPECT_NE(
        usage_message([&] { load_text(dir, R"({"model_family": "flux"})"); }).find("choose one of: sdxl"),
        std::string::npos);
    EXPECT_NE(
        usage_message([&] { load_text(dir, R"({"learning_rate": 1})"); }).find("model_family is required"),
        std::string::npos);
    EXPECT_NE(usage_message([&] {
                  load_text(dir, R"({"model_family": "sdxl", "train_batch_size": 0})");
              }).find("train_batch_size"),
              std::string::npos);
    // Nothing to train, or a negative step count, is an error rather than a run that "succeeds".
    EXPECT_NE(usage_message([&] {
                  load_text(dir, R"({"model_family": "sdxl", "max_train_steps": 0, "num_train_epochs": 0})");
              }).find("leaves nothing to train"),
              std::string::npos);
    EXPECT_NE(usage_message([&] {
                  load_text(dir, R"({"model_family": "sdxl"})", {"--max_train_steps", "-5"});
              }).find("max_train_steps = -5"),
              std::string::npos);
    EXPECT_NO_THROW(
        load_text(dir, R"({"model_family": "sdxl", "max_train_steps": 10, "num_train_epochs": 0})"));
}

// Integer and float options are checked against their range when they are read, wherever they
// come from. Before: 99999999999999999999 steps became a negative count, seed -5 wrapped around to
// a huge unsigned seed, and a negative learning rate trained.
TEST(TrainConfig, OutOfRangeNumbersNameTheKeyAndTheAllowedRange) {
    test::TempDir dir;
    const std::string base = R"({"model_family": "sdxl"})";
    const auto with = [&](std::vector<std::string> overrides) {
        return usage_message([&] { load_text(dir, base, overrides); });
    };
    std::string m = with({"--max_train_steps", "99999999999999999999"});
    EXPECT_NE(m.find("option max_train_steps = 1e+20 is out of range; allowed: at least 0"),
              std::string::npos)
        << m;
    m = with({"--max_train_steps", "9223372036854775808"});  // 2**63, parsed as an unsigned integer
    EXPECT_NE(m.find("option max_train_steps = 9223372036854775808 is out of range"), std::string::npos) << m;
    m = with({"--seed", "-5"});
    EXPECT_NE(m.find("option seed = -5 is out of range; allowed: -1 to 4294967295"), std::string::npos) << m;
    m = with({"--seed", "4294967296"});
    EXPECT_NE(m.find("option seed = 4294967296 is out of range"), std::string::npos) << m;
    m = usage_message([&] { load_text(dir, R"({"model_family": "sdxl", "learning_rate": -1})"); });
    EXPECT_NE(m.find("option learning_rate = -1.0 is out of range; allowed: greater than 0"),
              std::string::npos)
        << m;
    m = with({"--adam_beta2", "1"});
    EXPECT_NE(m.find("option adam_beta2 = 1.0 is out of range; allowed: [0, 1)"), std::string::npos) << m;
    m = with({"--lr_warmup_steps", "-1"});
    EXPECT_NE(m.find("option lr_warmup_steps = -1 is out of range; allowed: at least 0"), std::string::npos)
        << m;
    m = with({"--lora_rank", "0"});
    EXPECT_NE(m.find("option lora_rank = 0 is out of range; allowed: at least 1"), std::string::npos) << m;
    m = with({"--zero_stage", "3"});
    EXPECT_NE(m.find("option zero_stage = 3 is out of range; allowed: 0 to 2"), std::string::npos) << m;
    // The edges of a range, and null (SimpleTuner's None), are accepted.
    for (const auto& ok :
         std::vector<std::vector<std::string>>{{"--seed", "-1"},
                                               {"--seed", "4294967295"},
                                               {"--seed", "None"},
                                               {"--max_train_steps", "0", "--num_train_epochs", "1"},
                                               {"--learning_rate", "1e-6"},
                                               {"--caption_dropout_probability", "1"},
                                               {"--validation_seed", "0"}})
        EXPECT_NO_THROW(load_text(dir, base, ok)) << ok[0] << " " << ok[1];
    // The file is checked as the command line is, and a config.toml too.
    m = usage_message([&] { load_text(dir, R"({"model_family": "sdxl", "--train_batch_size": -2})"); });
    EXPECT_NE(m.find("config.json: option train_batch_size = -2 is out of range"), std::string::npos) << m;
}

// The global `resolution` fallback is checked against its resolution_type's range when the config
// is read. Before: 1e9 ended in a C++ backtrace deep in bucketing, and 7 in an error blaming the
// first image.
TEST(TrainConfig, ResolutionOutsideItsTypesRangeIsRefused) {
    test::TempDir dir;
    const auto message = [&](const std::string& resolution, const std::string& type) {
        return usage_message([&] {
            load_text(dir, R"({"model_family": "sdxl"})",
                      {"--resolution", resolution, "--resolution_type", type});
        });
    };
    std::string m = message("1e9", "pixel_area");
    EXPECT_NE(
        m.find("option resolution = 1000000000.0 is outside the range resolution_type=pixel_area allows: "
               "64 to 8192 pixels"),
        std::string::npos)
        << m;
    m = message("7", "pixel");
    EXPECT_NE(m.find("option resolution = 7.0 is outside the range resolution_type=pixel allows: 64 to 8192"),
              std::string::npos)
        << m;
    m = message("100", "area");
    EXPECT_NE(m.find("resolution_type=area allows: 0.004096 to 67.108864 megapixels"), std::string::npos)
        << m;
    EXPECT_EQ(message("7", "area"), "<no UsageError>");  // 7 megapixels
    EXPECT_EQ(message("1024", "pixel_area"), "<no UsageError>");
    EXPECT_EQ(message("64", "pixel"), "<no UsageError>");
}

// A syntax error in config.json names the file, line and column (exit 2 like every configuration
// problem). Before: "not valid JSON; check for trailing commas or comments", no position.
TEST(TrainConfig, MalformedJsonNamesTheLineAndColumn) {
    test::TempDir dir;
    const std::string m = usage_message(
        [&] { load_text(dir, "{\n  \"model_family\": \"sdxl\",\n  \"learning_rate\": 1e-4,\n}\n"); });
    EXPECT_EQ(m.rfind((dir / "config.json").string() + ":4:1: not valid JSON (", 0), 0u) << m;
}

// The same option written twice in one file ("learning_rate" and "--learning_rate", or an alias
// and its name): two values are refused naming both spellings; one value twice is a warning.
// Before: whichever spelling sorted last silently won.
TEST(TrainConfig, AKeyGivenTwiceWithDifferentSpellingsIsRefused) {
    test::TempDir dir;
    std::string m = usage_message([&] {
        load_text(dir, R"({"model_family": "sdxl", "learning_rate": 1e-4, "--learning_rate": 2e-4})");
    });
    EXPECT_NE(m.find("option learning_rate is given twice, as \"--learning_rate\" = 0.0002 and as "
                     "\"learning_rate\" = 0.0001; keep one of them"),
              std::string::npos)
        << m;
    m = usage_message([&] {
        load_text(dir,
                  R"({"model_family": "sdxl", "checkpointing_steps": 10, "checkpoint_step_interval": 20})");
    });
    EXPECT_NE(m.find("option checkpoint_step_interval is given twice"), std::string::npos) << m;
    const auto log_file = dir / "log.txt";
    log::set_file(log_file);
    TrainConfig c;
    EXPECT_NO_THROW(c = load_text(dir, R"({"model_family": "sdxl", "seed": 3, "--seed": "3"})"));
    log::set_file({});
    EXPECT_EQ(c.integer("seed"), 3);
    EXPECT_NE(fs::read_file(log_file).find("option seed is given twice, as \"--seed\" and as \"seed\", with "
                                           "the same value"),
              std::string::npos)
        << fs::read_file(log_file);
}

TEST(TrainConfig, TomlReadsLikeTheSameJson) {
    test::TempDir dir;
    fs::write_file_atomic(dir / "config.toml", R"(# SimpleTuner-style config.toml
"--model_family" = "sdxl"
model_type = "lora"
learning_rate = 1e-4
lora_rank = 8
"--train_batch_size" = 2
use_ema = true
validation_resolution = "1024x1024,1280x768"
peft_lora_target_modules = ["to_q", "to_k"]
)");
    const TrainConfig from_toml = TrainConfig::load(dir / "config.toml", {"--lora_alpha", "4"});
    const TrainConfig from_json = load_text(dir, R"({"--model_family": "sdxl", "model_type": "lora",
        "learning_rate": 1e-4, "lora_rank": 8, "--train_batch_size": 2, "use_ema": true,
        "validation_resolution": "1024x1024,1280x768", "peft_lora_target_modules": ["to_q", "to_k"],
        "lora_alpha": 4})");
    EXPECT_EQ(from_toml.resolved(), from_json.resolved());
    EXPECT_EQ(from_toml.integer("lora_rank"), 8);
    EXPECT_EQ(from_toml.real("lora_alpha"), 4.0);  // the command line still overrides the file

    fs::write_file_atomic(dir / "bad.toml", "model_family = \"sdxl\"\nlearning_rate = = 1\n");
    const std::string message = usage_message([&] { TrainConfig::load(dir / "bad.toml", {}); });
    EXPECT_NE(message.find("bad.toml:2:"), std::string::npos) << message;
    EXPECT_NE(message.find("not valid TOML"), std::string::npos) << message;
}

TEST(TrainConfig, ResolvedFileRoundTrips) {
    test::TempDir dir;
    const TrainConfig c = load_text(dir, R"({"model_family": "sdxl", "lora_rank": 4})");
    c.write_resolved(dir / "config.resolved.json");
    const auto back = nlohmann::json::parse(fs::read_file(dir / "config.resolved.json"));
    EXPECT_EQ(back.at("lora_rank"), 4);
    EXPECT_EQ(back.at("train_batch_size"), 4);
    EXPECT_EQ(TrainConfig::from_resolved(back).resolved(), c.resolved());
}

TEST(TrainConfig, EditDistance) {
    EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
    EXPECT_EQ(edit_distance("", "abc"), 3u);
    EXPECT_EQ(edit_distance("seed", "seed"), 0u);
}

}  // namespace
}  // namespace dtune::train
