// multidatabackend.json parsing: SimpleTuner defaults, conversions, warnings and errors.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "data/dataset_config.h"
#include "support/test_support.h"

namespace dtune::data {
namespace test_dataset_config_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using nlohmann::json;

json minimal(json image_extra = json::object()) {
    json image = {{"id", "pics"}, {"instance_data_dir", "/data/pics"}};
    image.update(image_extra);
    return json::array({image,
                        {{"id", "text"},
                         {"dataset_type", "text_embeds"},
                         {"default", true},
                         {"cache_dir", "{output_dir}/cache/text"}}});
}

std::string usage_error(const json& j, GlobalDataArgs args = {}) {
    try {
        parse_data_backend_config(j, args);
    } catch (const UsageError& e) {
        return e.what();
    }
    return "";
}

TEST(DatasetConfig, DefaultsFollowSimpleTuner) {
    GlobalDataArgs args;
    args.output_dir = "/out";
    auto cfg = parse_data_backend_config(minimal(), args);
    ASSERT_EQ(cfg.datasets.size(), 2u);
    const DatasetConfig& d = cfg.datasets[0];
    EXPECT_EQ(d.type, StorageType::kLocal);
    EXPECT_EQ(d.dataset_type, DatasetType::kImage);
    // pixel_area 1024 becomes area 1.048576 MP (edge²/1e6).
    EXPECT_EQ(d.resolution_type, ResolutionType::kArea);
    EXPECT_DOUBLE_EQ(d.resolution, 1.048576);
    EXPECT_EQ(d.resolution_type_as_written, ResolutionType::kPixelArea);
    EXPECT_FALSE(d.crop);
    EXPECT_EQ(d.crop_style, CropStyle::kRandom);
    EXPECT_EQ(d.crop_aspect, CropAspect::kSquare);
    EXPECT_EQ(d.caption_strategy, CaptionStrategy::kFilename);
    EXPECT_EQ(d.metadata_backend, MetadataBackendKind::kDiscovery);
    EXPECT_EQ(d.repeats, 0);
    EXPECT_FALSE(d.repeats_set);
    EXPECT_DOUBLE_EQ(d.probability, 1.0);
    EXPECT_EQ(d.train_batch_size, 4);
    EXPECT_EQ(d.start_epoch, 1);
    EXPECT_EQ(d.start_step, 0);
    EXPECT_FALSE(d.end_epoch.has_value());
    EXPECT_TRUE(d.compress_cache);  // compress_disk_cache defaults to true in code (§13)
    EXPECT_EQ(d.write_batch_size, 128);
    EXPECT_DOUBLE_EQ(d.caption_dropout_probability, 0.1);
    EXPECT_EQ(d.cache_dir_vae, "/out/cache/vae/sdxl/pics");
    EXPECT_EQ(d.text_embeds, "text");  // the default text cache is attached
    EXPECT_EQ(d.cache_file_suffix, "pics");
    EXPECT_EQ(cfg.datasets[1].cache_dir, "/out/cache/text");  // {output_dir} substituted
    EXPECT_TRUE(cfg.warnings.empty());
}

TEST(DatasetConfig, PixelAreaConvertsSizeLimits) {
    auto cfg = parse_data_backend_config(minimal({{"minimum_image_size", 768},
                                                  {"maximum_image_size", 2048},
                                                  {"target_downsample_size", 1536},
                                                  {"crop", true}}),
                                         {});
    const auto& d = cfg.datasets[0];
    EXPECT_DOUBLE_EQ(*d.minimum_image_size, 0.589824);
    EXPECT_DOUBLE_EQ(*d.maximum_image_size, 4.194304);
    EXPECT_DOUBLE_EQ(*d.target_downsample_size, 2.359296);
    EXPECT_TRUE(cfg.warnings.empty());
}

TEST(DatasetConfig, PixelAreaSmallMinimumIsAnEdgeAsInSimpleTuner) {
    // SimpleTuner's _handle_resolution_conversion squares every positive value: 0.5 is a 0.5 px
    // edge (2.5e-7 MP), a filter that keeps every image. We read it the same way and say so.
    auto cfg = parse_data_backend_config(minimal({{"minimum_image_size", 0.5}}), {});
    EXPECT_DOUBLE_EQ(*cfg.datasets[0].minimum_image_size, pixel_edge_to_megapixels(0.5));
    ASSERT_EQ(cfg.warnings.size(), 1u);
    EXPECT_NE(cfg.warnings[0].find("minimum_image_size"), std::string::npos) << cfg.warnings[0];
    EXPECT_NE(cfg.warnings[0].find("512"), std::string::npos) << cfg.warnings[0];
}

TEST(DatasetConfig, LoneTargetDownsampleSizeIsAcceptedWithAWarning) {
    // SimpleTuner refuses maximum_image_size alone but accepts target_downsample_size alone.
    auto cfg = parse_data_backend_config(minimal({{"target_downsample_size", 1536}, {"crop", true}}), {});
    EXPECT_DOUBLE_EQ(*cfg.datasets[0].target_downsample_size, pixel_edge_to_megapixels(1536));
    EXPECT_FALSE(cfg.datasets[0].maximum_image_size.has_value());
    ASSERT_EQ(cfg.warnings.size(), 1u);
    EXPECT_NE(cfg.warnings[0].find("maximum_image_size"), std::string::npos) << cfg.warnings[0];
}

TEST(DatasetConfig, PixelResolutionKeepsValues) {
    auto cfg = parse_data_backend_config(minimal({{"resolution", 768}, {"resolution_type", "pixel"}}), {});
    EXPECT_EQ(cfg.datasets[0].resolution_type, ResolutionType::kPixel);
    EXPECT_DOUBLE_EQ(cfg.datasets[0].resolution, 768);
}

TEST(DatasetConfig, UnknownKeysWarnByName) {
    auto cfg = parse_data_backend_config(minimal({{"resolutoin", 512}, {"crop_styel", "center"}}), {});
    ASSERT_EQ(cfg.warnings.size(), 1u);
    EXPECT_NE(cfg.warnings[0].find("'resolutoin'"), std::string::npos);
    EXPECT_NE(cfg.warnings[0].find("'crop_styel'"), std::string::npos);
    EXPECT_NE(cfg.warnings[0].find("pics"), std::string::npos);
}

TEST(DatasetConfig, WrongTypesNameIdAndKey) {
    std::string e = usage_error(minimal({{"repeats", "two"}}));
    EXPECT_NE(e.find("'pics'"), std::string::npos) << e;
    EXPECT_NE(e.find("'repeats'"), std::string::npos) << e;
    EXPECT_TRUE(parse_data_backend_config(minimal({{"repeats", 0}}), {}).datasets[0].repeats_set);
    e = usage_error(minimal({{"repeats", 1.5}}));
    EXPECT_NE(e.find("integer"), std::string::npos) << e;
    e = usage_error(minimal({{"crop", 3}}));
    EXPECT_NE(e.find("'crop'"), std::string::npos) << e;
    e = usage_error(minimal({{"crop_style", "diagonal"}}));
    EXPECT_NE(e.find("random, center, centre, corner"), std::string::npos) << e;
    e = usage_error(minimal({{"train_batch_size", 0}}));
    EXPECT_NE(e.find("'train_batch_size'"), std::string::npos) << e;
}

// A dataset's resolution outside its resolution_type's range is refused naming the dataset, the key,
// the value and the range. Before: 1e9 gave a C++ backtrace from the bucket maths, 7 an error that
// blamed the first image.
TEST(DatasetConfig, ResolutionOutsideItsTypesRangeNamesDatasetKeyAndRange) {
    std::string e = usage_error(minimal({{"resolution", 1e9}}));
    EXPECT_NE(e.find("dataset 'pics', key 'resolution': 1000000000.0 is outside the range "
                     "resolution_type=pixel_area allows: 64 to 8192 pixels"),
              std::string::npos)
        << e;
    e = usage_error(minimal({{"resolution", 7}, {"resolution_type", "pixel"}}));
    EXPECT_NE(e.find("dataset 'pics', key 'resolution': 7 is outside the range resolution_type=pixel allows"),
              std::string::npos)
        << e;
    e = usage_error(minimal({{"resolution", 0}, {"resolution_type", "area"}}));
    EXPECT_NE(e.find("resolution_type=area allows: 0.004096 to 67.108864 megapixels"), std::string::npos)
        << e;
    // A value inherited from config.json is named as the dataset's value too.
    GlobalDataArgs args;
    args.resolution = 7;
    e = usage_error(minimal(), args);
    EXPECT_NE(e.find("dataset 'pics', key 'resolution': 7 is outside"), std::string::npos) << e;
    EXPECT_EQ(usage_error(minimal({{"resolution", 7}, {"resolution_type", "area"}})), "");
    EXPECT_EQ(usage_error(minimal({{"resolution", 64}, {"resolution_type", "pixel"}})), "");
}

// A syntax error in multidatabackend.json is a configuration error (exit 2) naming the file, line
// and column, as for config.json. Before: DataError (exit 3) with a byte offset.
TEST(DatasetConfig, MalformedJsonIsAUsageErrorNamingLineAndColumn) {
    test::TempDir dir;
    const auto path = dir / "multidatabackend.json";
    fs::write_file_atomic(path, "[\n  {\"id\": \"pics\", \"instance_data_dir\": \"/data\"},\n]\n");
    try {
        load_data_backend_config(path, {});
        FAIL() << "a malformed multidatabackend.json loaded";
    } catch (const UsageError& e) {
        // The trailing comma leaves "]" (line 3, column 1) where an entry should be.
        EXPECT_EQ(std::string(e.what()).rfind(path.string() + ":3:1: not valid JSON (", 0), 0u) << e.what();
    } catch (const std::exception& e) {
        FAIL() << "not a UsageError: " << e.what();
    }
}

TEST(DatasetConfig, ContradictionsAreErrors) {
    EXPECT_NE(usage_error(minimal({{"maximum_image_size", 2048}})).find("target_downsample_size"),
              std::string::npos);
    EXPECT_NE(
        usage_error(minimal({{"resolution_type", "area"}, {"resolution", 1.0}, {"minimum_image_size", 6}}))
            .find("< 5"),
        std::string::npos);
    EXPECT_NE(usage_error(minimal({{"resolution_type", "pixel"},
                                   {"maximum_image_size", 256},
                                   {"target_downsample_size", 256}}))
                  .find(">= 512"),
              std::string::npos);
    EXPECT_NE(usage_error(minimal({{"crop", true}, {"crop_aspect", "closest"}})).find("crop_aspect_buckets"),
              std::string::npos);
    EXPECT_NE(usage_error(minimal({{"caption_strategy", "parquet"}})).find("metadata_backend"),
              std::string::npos);
    EXPECT_NE(usage_error(minimal({{"crop_aspect_buckets", {{{"aspect", 1.0}, {"weight", 0.3}}}}}))
                  .find("must add up to 1"),
              std::string::npos);
    EXPECT_NE(usage_error(minimal({{"disable_vae_cache", true}})).find("vae_cache_disable"),
              std::string::npos);
    EXPECT_NE(usage_error(minimal({{"text_embeds", "nope"}})).find("'nope'"), std::string::npos);
    EXPECT_NE(usage_error(minimal({{"crop_style", "face"}})).find("face"), std::string::npos);
}

TEST(DatasetConfig, CrossEntryChecks) {
    json j = minimal();
    j.push_back({{"id", "pics"}, {"instance_data_dir", "/x"}});
    EXPECT_NE(usage_error(j).find("used twice"), std::string::npos);
    j = minimal();
    j.push_back({{"id", "text2"}, {"dataset_type", "text_embeds"}, {"default", true}});
    EXPECT_NE(usage_error(j).find("both have \"default\": true"), std::string::npos);
    j = json::array({{{"id", "pics"}, {"instance_data_dir", "/x"}}});
    EXPECT_NE(usage_error(j).find("no text_embeds"), std::string::npos);
    j = minimal();
    j.push_back({{"id", "more"}, {"instance_data_dir", "/y"}, {"cache_dir_vae", "/out/cache/vae/sdxl/pics"}});
    GlobalDataArgs args;
    args.output_dir = "/out";
    EXPECT_NE(usage_error(j, args).find("also used by dataset 'pics'"), std::string::npos);
}

TEST(DatasetConfig, DisabledEntriesAreDropped) {
    json j = minimal();
    j.push_back({{"id", "off"}, {"disabled", true}, {"instance_data_dir", 5}});  // not even validated
    auto cfg = parse_data_backend_config(j, {});
    EXPECT_EQ(cfg.datasets.size(), 2u);
    EXPECT_EQ(cfg.find("off"), nullptr);
}

TEST(DatasetConfig, DisabledWrittenAsTextIsHonoured) {
    // "true"/"false" strings are booleans everywhere else in an entry; "disabled": "true" must not
    // train the entry (nor fail on its missing folder).
    json j = minimal();
    j.push_back({{"id", "off"}, {"disabled", "true"}, {"instance_data_dir", "/missing"}});
    j.push_back({{"id", "off2"}, {"disable", "True"}, {"instance_data_dir", "/missing"}});
    j.push_back({{"id", "on"}, {"disabled", "false"}, {"instance_data_dir", "/y"}});
    auto cfg = parse_data_backend_config(j, {});
    EXPECT_EQ(cfg.find("off"), nullptr);
    EXPECT_EQ(cfg.find("off2"), nullptr);
    EXPECT_NE(cfg.find("on"), nullptr);
    EXPECT_TRUE(parse_data_backend_config(minimal({{"crop", "True"}}), {}).datasets[0].crop);
    j = minimal();
    j.push_back({{"id", "odd"}, {"disabled", "yes"}, {"instance_data_dir", "/y"}});
    const std::string e = usage_error(j);
    EXPECT_NE(e.find("\"odd\""), std::string::npos) << e;
    EXPECT_NE(e.find("'disabled'"), std::string::npos) << e;
}

TEST(DatasetConfig, RegularisationDataEitherSpelling) {
    // SimpleTuner reads each spelling with the other as its fallback: either one switches it on.
    for (const char* key : {"is_regularisation_data", "is_regularization_data"}) {
        for (const json& value : {json(true), json("True")}) {
            const auto cfg = parse_data_backend_config(minimal({{key, value}}), {});
            EXPECT_TRUE(cfg.datasets[0].is_regularisation_data) << key;
            EXPECT_TRUE(cfg.warnings.empty()) << key;  // a known key, not "unknown"
        }
        EXPECT_FALSE(
            parse_data_backend_config(minimal({{key, false}}), {}).datasets[0].is_regularisation_data);
    }
    EXPECT_FALSE(parse_data_backend_config(minimal(), {}).datasets[0].is_regularisation_data);
    const std::string e = usage_error(minimal({{"is_regularisation_data", 3}}));
    EXPECT_NE(e.find("'is_regularisation_data'"), std::string::npos) << e;
}

TEST(DatasetConfig, KeysThatWouldChangeTrainingAreRefused) {
    // Read but not implemented: training without them would silently differ from SimpleTuner.
    json j = minimal();
    j[1]["text_cache_disable"] = true;  // storage only: a warning, not an error
    const auto cfg = parse_data_backend_config(j, {});
    ASSERT_EQ(cfg.warnings.size(), 1u);
    EXPECT_NE(cfg.warnings[0].find("'text_cache_disable' is not implemented"), std::string::npos);
    j = minimal();
    j[1]["caption_filter_list"] = "config/caption_filter_list.txt";
    const std::string e = usage_error(j);
    EXPECT_NE(e.find("dataset 'text', key 'caption_filter_list'"), std::string::npos) << e;
}

TEST(DatasetConfig, PassthroughKeysThatChangeTrainingAreRefusedWhenOn) {
    // These used to be read, warned about and ignored: the run then trained without them.
    const std::vector<std::pair<std::string, json>> on = {
        {"vae_cache_clear_each_epoch", true},
        {"caption_shuffle", {{"enable", true}, {"count", 3}}},
        {"conditioning", json::array({{{"type", "canny"}}})},
        {"conditioning_data", "pics-canny"},
        {"conditioning_type", "controlnet"},
        {"source_dataset_id", "pics"},
        {"slider_strength", 0.5},
    };
    for (const auto& [key, value] : on) {
        const std::string e = usage_error(minimal({{key, value}}));
        EXPECT_NE(e.find(str("dataset 'pics', key '", key, "'")), std::string::npos) << key << ": " << e;
        EXPECT_NE(e.find("refused rather than ignored"), std::string::npos) << e;
    }
    // Off values are SimpleTuner's defaults: accepted, and nothing to warn about.
    const json off = {{"vae_cache_clear_each_epoch", false}, {"caption_shuffle", {{"enable", false}}},
                      {"conditioning", json::array()},       {"conditioning_data", ""},
                      {"source_dataset_id", nullptr},        {"slider_strength", 0}};
    const auto cfg = parse_data_backend_config(minimal(off), {});
    EXPECT_TRUE(cfg.warnings.empty()) << cfg.warnings[0];
    // Keys with no effect on what is trained still only warn.
    const auto warned = parse_data_backend_config(minimal({{"scan_for_errors", true}}), {});
    ASSERT_EQ(warned.warnings.size(), 1u);
    EXPECT_NE(warned.warnings[0].find("'scan_for_errors'"), std::string::npos);
}

TEST(DatasetConfig, ParquetBlockAndVariables) {
    json extra = {{"metadata_backend", "parquet"},
                  {"caption_strategy", "parquet"},
                  {"parquet",
                   {{"path", "{output_dir}/{id}.jsonl"},
                    {"width_column", "w"},
                    {"height_column", "h"},
                    {"caption_column", "text"}}},
                  {"cache_dir_vae", "{output_dir}/vae/{model_family}/{id}"},
                  {"crop_aspect_buckets", {0.75, 1.0, 1.33}},
                  {"skip_file_discovery", "vae, text"},
                  {"vae_cache_disable", true}};
    GlobalDataArgs args;
    args.output_dir = "/o";
    auto cfg = parse_data_backend_config(minimal(extra), args);
    const auto& d = cfg.datasets[0];
    ASSERT_TRUE(d.parquet);
    EXPECT_EQ(d.parquet->path, "/o/pics.jsonl");
    EXPECT_EQ(d.parquet->filename_column, "id");
    EXPECT_EQ(d.parquet->caption_column, "text");
    EXPECT_FALSE(d.parquet->identifier_includes_extension);
    EXPECT_EQ(d.cache_dir_vae, "/o/vae/sdxl/pics");
    ASSERT_EQ(d.crop_aspect_buckets.size(), 3u);
    EXPECT_DOUBLE_EQ(d.crop_aspect_buckets[2].aspect, 1.33);
    EXPECT_TRUE(d.skip_vae_discovery && d.skip_text_discovery);
    EXPECT_FALSE(d.skip_aspect_discovery);
    EXPECT_TRUE(d.vae_cache_ondemand);  // disable implies on-demand
}

}  // namespace
}  // namespace test_dataset_config_local
}  // namespace dtune::data
