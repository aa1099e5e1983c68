// TrainConfig: SimpleTuner defaults (SIMPLETUNER.md §6, typed by hand here), "--" keys, aliases,
// command-line overrides, unknown / unimplemented keys, the resolved file.
#include <gtest/gtest.h>

#include <fstream>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "support/test_support.h"
#include "train/config.h"
#include "train/simpletuner_options.h"

namespace dtune::train {
namespace test_config_local {  // (named: unity builds merge files' anonymous namespaces)
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

// base_model_precision / text_encoder_N_precision: the implemented presets load; the others, a full
// fine-tune on a quantised base and DoRA with quanto are refused naming the key and the fix.
TEST(TrainConfig, QuantisationPresetsAndSimpleTunersRefusals) {
    test::TempDir dir;
    const auto load = [&](const std::string& keys) {
        return usage_message([&] {
            load_text(dir, R"({"model_family": "sdxl", "model_type": "lora", )" + keys + "}").validate();
        });
    };
    EXPECT_EQ(load(R"("base_model_precision": "int8-quanto", "text_encoder_1_precision": "fp8-torchao",
                      "text_encoder_2_precision": "int8-torchao")"),
              "<no UsageError>");
    EXPECT_EQ(load(R"("base_model_precision": "fp8-torchao", "use_dora": true)"), "<no UsageError>");
    EXPECT_NE(load(R"("base_model_precision": "int8-quanto", "use_dora": true)")
                  .find("use_dora cannot be combined with base_model_precision = \"int8-quanto\""),
              std::string::npos);
    EXPECT_NE(load(R"("base_model_precision": "nf4-bnb")")
                  .find("base_model_precision = \"nf4-bnb\" is not "
                        "available"),
              std::string::npos);
    EXPECT_NE(load(R"("text_encoder_2_precision": "int4-quanto")").find("text_encoder_2_precision"),
              std::string::npos);
    const std::string full = usage_message([&] {
        load_text(dir,
                  R"({"model_family": "sdxl", "model_type": "full", "base_model_precision": "fp8-quanto"})")
            .validate();
    });
    EXPECT_NE(full.find("set model_type lora"), std::string::npos) << full;
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
    const std::string m =
        usage_message([&] { load_text(dir, R"({"model_family": "sdxl", "--t5_padding": "zero"})"); });
    EXPECT_NE(m.find("option t5_padding = \"zero\" is not implemented by dtune"), std::string::npos) << m;
    EXPECT_EQ(m.find("unknown"), std::string::npos) << m;
    // SimpleTuner's default value changes nothing and is accepted.
    EXPECT_NO_THROW(load_text(dir, R"({"model_family": "sdxl", "t5_padding": "unmodified"})"));
    EXPECT_NE(usage_message([&] {
                  load_text(dir, R"({"model_family": "sdxl", "slider_lora_target": true})");
              }).find("slider_lora_target = true is not implemented"),
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
    for (const char* key :
         {"eval_epoch_interval", "fuse_optimizer", "fsdp_cpu_ram_efficient_loading", "dynamo_mode"}) {
        const std::string m = usage_message([&] {
            load_text(dir, R"({"model_family": "sdxl"})", {str("--", key), "2"});
        });
        EXPECT_NE(m.find(str("option ", key, " = 2 is not implemented by dtune")), std::string::npos) << m;
    }
}

TEST(TrainConfig, EverySimpleTunerOptionAtItsDefaultLoads) {
    // SimpleTuner's defaults for all of its options, as its own parser yields them
    // (tools/ref/simpletuner_options.py --defaults-json), written as a config.json.
    test::TempDir dir;
    nlohmann::json config =
        nlohmann::json::parse(fs::read_file(DTUNE_TEST_DATA_DIR "/ref/simpletuner_defaults.json"));
    ASSERT_GT(config.size(), 500u);
    config["--model_family"] = "sdxl";  // required, as in SimpleTuner
    const TrainConfig c = load_text(dir, config.dump());
    EXPECT_EQ(c.text("model_family"), "sdxl");
    EXPECT_EQ(c.integer("checkpoint_step_interval"), 500);
}

TEST(TrainConfig, EverySimpleTunerOptionAsNullLoads) {
    // SimpleTuner drops None-valued keys, so each takes its default; dtune's own options likewise.
    test::TempDir dir;
    nlohmann::json config =
        nlohmann::json::parse(fs::read_file(DTUNE_TEST_DATA_DIR "/ref/simpletuner_defaults.json"));
    for (auto& [key, value] : config.items()) value = nullptr;
    for (const auto& spec : option_specs()) config[spec.name] = nullptr;
    config.erase("--model_family");  // one spelling per key
    config["model_family"] = "sdxl";
    const TrainConfig c = load_text(dir, config.dump());
    const TrainConfig defaults = load_text(dir, R"({"model_family": "sdxl"})");
    EXPECT_EQ(c.resolved(), defaults.resolved());
    EXPECT_EQ(c.integer("train_batch_size"), 4);
}

TEST(TrainConfig, ExampleConfigKeysOfSimpleTunerAreAcceptedAtTheirDefault) {
    // The keys SimpleTuner's own example configs carry most often, at the values they carry.
    test::TempDir dir;
    EXPECT_NO_THROW(load_text(dir, R"({"model_family": "sdxl", "push_checkpoints_to_hub": false,
        "validation_disable_unconditional": false, "vae_enable_tiling": false, "vae_enable_slicing": false,
        "strict_epoch_limit": false, "text_encoder_batch_size": 1, "--aspect_bucket_alignment": 64,
        "fused_qkv_projections": "false", "--lr_scale": "no"})"));
    // Another value is refused as not implemented (never "unknown"), naming the key and the default.
    const std::string m =
        usage_message([&] { load_text(dir, R"({"model_family": "sdxl", "vae_enable_tiling": true})"); });
    EXPECT_NE(m.find("option vae_enable_tiling = true is not implemented by dtune"), std::string::npos) << m;
    EXPECT_NE(m.find("SimpleTuner's default false"), std::string::npos) << m;
    // Another spelling of an option resolves to its SimpleTuner name.
    EXPECT_TRUE(load_text(dir, R"({"model_family": "flux", "fused_qkv_projections": true})")
                    .flag("fuse_qkv_projections"));
    // A typo of a SimpleTuner option dtune does not implement suggests that option.
    const std::string t =
        usage_message([&] { load_text(dir, R"({"model_family": "sdxl", "vae_enable_tilling": false})"); });
    EXPECT_NE(t.find("did you mean \"vae_enable_tiling\""), std::string::npos) << t;
}

TEST(TrainConfig, EveryProblemIsReportedInOneRunModelFamilyFirst) {
    test::TempDir dir;
    const std::string m = usage_message([&] {
        load_text(dir, R"({"learning_rat": 1, "train_batch_size": "four", "vae_enable_tiling": true,
                           "lr_scheduler": "warp", "gradient_accumulation_steps": 0})",
                  {"--seed", "x", "--lora_rank=abc"});
    });
    EXPECT_EQ(m.rfind("8 configuration problems", 0), 0u) << m;
    EXPECT_NE(m.find("1. model_family is required"), std::string::npos) << m;
    for (const char* part :
         {"unknown option \"learning_rat\"", "train_batch_size = \"four\" is not an integer",
          "vae_enable_tiling = true is not implemented", "lr_scheduler = \"warp\"",
          "gradient_accumulation_steps = 0", "option seed = \"x\"", "option lora_rank = \"abc\""})
        EXPECT_NE(m.find(part), std::string::npos) << part << "\n" << m;
    // One problem keeps its plain message.
    const std::string one =
        usage_message([&] { load_text(dir, R"({"model_family": "sdxl", "learning_rat": 1})"); });
    EXPECT_EQ(one.find("configuration problems"), std::string::npos) << one;
}

TEST(TrainConfig, OptionsPageIsGeneratedFromTheTable) {
    // docs/simpletuner-options.md is `dtune train --list-options`; regenerate it when this fails:
    // build/dev/bin/dtune train --list-options > docs/simpletuner-options.md
    const std::string page = fs::read_file(DTUNE_SOURCE_DIR "/docs/simpletuner-options.md");
    EXPECT_EQ(page, options_markdown());
    EXPECT_NE(page.find("| `learning_rate` |  | `4e-07` | implemented |"), std::string::npos);
    EXPECT_NE(page.find("| `vae_enable_tiling` |  | `false` | accepted at its default only |"),
              std::string::npos);
    std::size_t rows = 0;
    for (std::size_t at = page.find("\n| `"); at != std::string::npos; at = page.find("\n| `", at + 1))
        ++rows;
    std::size_t own = 0;
    for (const auto& spec : option_specs()) own += find_simpletuner_option(spec.name) == nullptr;
    EXPECT_GT(own, 0u);
    EXPECT_EQ(rows, simpletuner_options().size() + own) << "every SimpleTuner option and dtune's own";
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

TEST(TrainConfig, LossAndTimestepBiasOptionsTakeSimpleTunersNamesAndDefaults) {
    test::TempDir dir;
    const TrainConfig d = load_text(dir, R"({"model_family": "sdxl"})");
    EXPECT_EQ(d.text("loss_type"), "l2");
    EXPECT_EQ(d.text("huber_schedule"), "snr");
    EXPECT_DOUBLE_EQ(d.real("huber_c"), 0.1);
    EXPECT_DOUBLE_EQ(d.real("snr_weight"), 1.0);
    EXPECT_TRUE(d.is_null("timestep_bias_strategy"));
    EXPECT_DOUBLE_EQ(d.real("timestep_bias_portion"), 0.25);
    EXPECT_EQ(d.integer("timestep_bias_end"), 1000);
    const TrainConfig c = load_text(dir, R"({"model_family": "sdxl", "loss_type": "smooth_l1",
        "huber_schedule": "exponential", "huber_c": 0.2, "snr_weight": 0.5, "timestep_bias_strategy": "range",
        "timestep_bias_begin": 200, "timestep_bias_end": 500, "timestep_bias_multiplier": 3,
        "use_soft_min_snr": true, "soft_min_snr_sigma_data": 1.0, "disable_segmented_timestep_sampling": true})");
    EXPECT_EQ(c.text("loss_type"), "smooth_l1");
    EXPECT_EQ(c.text("huber_schedule"), "exponential");
    EXPECT_EQ(c.text("timestep_bias_strategy"), "range");
    EXPECT_EQ(c.integer("timestep_bias_begin"), 200);
    EXPECT_TRUE(c.flag("disable_segmented_timestep_sampling"));
    // SimpleTuner's choices and its one range check (the portion); huber_c must be > 0.
    const std::string m = usage_message([&] {
        load_text(dir, R"({"model_family": "sdxl", "loss_type": "l1", "huber_schedule": "linear",
            "timestep_bias_strategy": "middle", "timestep_bias_portion": 1.5, "huber_c": 0})");
    });
    for (const char* part : {"loss_type = \"l1\" is not supported; choose one of: l2,huber,smooth_l1",
                             "huber_schedule = \"linear\"", "timestep_bias_strategy = \"middle\"",
                             "Timestep bias portion must be between 0.0 and 1.0.", "huber_c"})
        EXPECT_NE(m.find(part), std::string::npos) << part << "\n" << m;
}

TEST(TrainConfig, NullMeansTheDefaultForEveryKey) {
    // SimpleTuner's loader drops keys whose value is None before parsing, so they keep their
    // defaults: implemented options, options dtune does not implement, and keys it does not know.
    test::TempDir dir;
    const TrainConfig c = load_text(dir, R"({"model_family": "sdxl", "loss_type": null,
        "train_batch_size": null, "learning_rate": null, "resume_from_checkpoint": null,
        "--huber_c": null, "base_model_precision": null, "some_future_key": null})",
                                    {"--lora_rank", "null"});
    EXPECT_EQ(c.integer("train_batch_size"), 4);
    EXPECT_DOUBLE_EQ(c.real("learning_rate"), 4e-7);
    EXPECT_EQ(c.text("resume_from_checkpoint"), "latest");
    EXPECT_EQ(c.integer("lora_rank"), 16);
    // null after a value (a later file or the command line) restores the default too.
    const TrainConfig o =
        load_text(dir, R"({"model_family": "sdxl", "train_batch_size": 2})", {"--train_batch_size", "null"});
    EXPECT_EQ(o.integer("train_batch_size"), 4);
}

TEST(TrainConfig, KeysThatOnlyLabelAreAccepted) {
    // Without publishing (push_to_hub is refused unless false) hub_model_id does nothing; tracker
    // names only label tracker runs.
    test::TempDir dir;
    EXPECT_NO_THROW(load_text(dir, R"({"model_family": "sdxl", "hub_model_id": "me/my-lora",
        "push_to_hub": false, "push_checkpoints_to_hub": false, "tracker_project_name": "portraits",
        "tracker_run_name": "run-7"})"));
    EXPECT_NE(usage_message([&] {
                  load_text(dir, R"({"model_family": "sdxl", "push_to_hub": true})");
              }).find("push_to_hub = true is not implemented"),
              std::string::npos);
    EXPECT_NE(usage_message([&] {
                  load_text(dir, R"({"model_family": "sdxl", "push_checkpoints_to_hub": true})");
              }).find("push_checkpoints_to_hub = true is not implemented"),
              std::string::npos);
}

TEST(TrainConfig, LegacyKeysAsSimpleTunerTranslatesThem) {
    test::TempDir dir;
    const TrainConfig c = load_text(dir, R"({"model_family": "sdxl", "save_total_limit": 3,
        "vae_cache_preprocess": false, "repeats": 2, "aspect_ratio_bucketing": true,
        "aspect_ratio_bucket_min": 0.5, "aspect_ratio_bucket_max": 2.0})");
    EXPECT_EQ(c.integer("checkpoints_total_limit"), 3);
    EXPECT_TRUE(c.flag("vae_cache_ondemand"));  // "don't pre-process" is on-demand encoding
    const TrainConfig d = load_text(dir, R"({"model_family": "sdxl", "vae_cache_preprocess": true})");
    EXPECT_FALSE(d.flag("vae_cache_ondemand"));
    EXPECT_EQ(d.integer("checkpoints_total_limit"), 5);
}

TEST(TrainConfig, ReportToTakesWandbAndLists) {
    test::TempDir dir;
    const TrainConfig c = load_text(dir, R"({"model_family": "sdxl", "report_to": "wandb, TensorBoard"})");
    EXPECT_EQ(c.report_to_list(), (std::vector<std::string>{"wandb", "tensorboard"}));
    EXPECT_NE(usage_message([&] {
                  load_text(dir, R"({"model_family": "sdxl", "report_to": "mlflow"})");
              }).find("report_to"),
              std::string::npos);
}

TEST(TrainConfig, BadValuesNameTheKey) {
    test::TempDir dir;
    EXPECT_NE(usage_message([&] {
                  load_text(dir, R"({"model_family": "sdxl", "lora_rank": "x"})");
              }).find("lora_rank"),
              std::string::npos);
    EXPECT_NE(
        usage_message([&] { load_text(dir, R"({"model_family": "sd3"})"); }).find("choose one of: sdxl,flux"),
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
    m = with({"--zero_stage", "4"});
    EXPECT_NE(m.find("option zero_stage = 4 is out of range; allowed: 0 to 3"), std::string::npos) << m;
    m = with({"--fsdp_version", "3"});
    EXPECT_NE(m.find("option fsdp_version = 3 is out of range; allowed: 1 to 2"), std::string::npos) << m;
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
}  // namespace test_config_local
}  // namespace dtune::train
