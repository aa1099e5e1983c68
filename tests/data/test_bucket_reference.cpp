// Crop geometry against SimpleTuner's own code: tests/data/ref/crop_geometry.json holds, for 90
// image sizes under 19 dataset settings (every resolution_type, crop on/off, every crop_aspect,
// with and without the downsample keys, size filters), what SimpleTuner bc8e6ab's TrainingSample
// decides (tools/ref/crop_geometry.py runs it). Every row is planned here from the dataset entry as
// a user writes it (so the pixel_area conversion is part of the check) and compared field by field.
// Rows where dtune deviates carry the reason and SimpleTuner's values; their expected values are
// dtune's.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>
#include <random>
#include <set>

#include "core/fs.h"
#include "data/buckets.h"
#include "data/dataset_config.h"

namespace dtune::data {
namespace test_bucket_reference_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using nlohmann::json;

Size size_of(const json& j) {
    return {j.at(0).get<int>(), j.at(1).get<int>()};
}

std::string text(Size s) {
    return std::to_string(s.width) + "x" + std::to_string(s.height);
}

json load_reference() {
    const auto path = std::filesystem::path(DTUNE_DATA_TEST_DIR) / "ref" / "crop_geometry.json";
    return json::parse(fs::read_file(path));
}

BucketSettings settings_of(const json& entry) {
    json image = entry;
    image["id"] = "ref";
    image["instance_data_dir"] = "/data/ref";
    const json list = json::array(
        {image, {{"id", "text"}, {"dataset_type", "text_embeds"}, {"default", true}, {"cache_dir", "/c"}}});
    return BucketSettings::from(parse_data_backend_config(list, {}).datasets[0]);
}

TEST(BucketReference, CropGeometryMatchesSimpleTuner) {
    const json ref = load_reference();
    ASSERT_EQ(ref.at("simpletuner_commit"), "bc8e6ab");
    int rows = 0, deviations = 0;
    for (const auto& config : ref.at("configs")) {
        const std::string name = config.at("name");
        const BucketSettings s = settings_of(config.at("dataset"));
        for (const auto& f : config.at("filtered"))
            EXPECT_FALSE(resolution_filter_reason(s, size_of(f)).empty()) << name << ": " << text(size_of(f));
        // One map per dataset, rows in the generator's order: first-seen pinning matches too.
        AspectResolutionMap map(s.resolution);
        for (const auto& row : config.at("rows")) {
            const Size original{row.at(0).get<int>(), row.at(1).get<int>()};
            const std::string where = name + ": " + text(original);
            ASSERT_TRUE(resolution_filter_reason(s, original).empty()) << where;
            std::mt19937_64 rng(1);
            const SamplePlan p = row.at(2).is_null()
                                     ? plan_sample(s, original, rng, &map)
                                     : plan_sample_for_aspect(s, original, row[2].get<double>(), rng, &map);
            EXPECT_EQ(text(p.intermediary), text(size_of(row.at(3)))) << where << " intermediary";
            EXPECT_EQ(text(p.resize_size), text(size_of(row.at(4)))) << where << " resize";
            EXPECT_EQ(text(p.target), text(size_of(row.at(5)))) << where << " target";
            EXPECT_EQ(p.crop_top, row.at(6).at(0).get<int>()) << where << " crop top";
            EXPECT_EQ(p.crop_left, row.at(6).at(1).get<int>()) << where << " crop left";
            EXPECT_DOUBLE_EQ(p.aspect, row.at(7).get<double>()) << where << " bucket";
            deviations += row.size() > 8;
            ++rows;
        }
    }
    EXPECT_GT(rows, 1700);
    // The deviations are the 0.5 MP corner only (square edge 768 past the calculator's 704).
    EXPECT_GT(deviations, 0);
    EXPECT_LT(deviations, 120);
}

// crop_aspect random: the choices an image can draw are the listed aspects whose target stays
// within max_upscale_threshold, as SimpleTuner's _trim_aspect_bucket_list keeps them.
TEST(BucketReference, RandomCropAspectChoicesMatchSimpleTuner) {
    const json ref = load_reference();
    int images = 0;
    for (const auto& config : ref.at("configs")) {
        if (config.at("dataset").value("crop_aspect", "") != "random") continue;
        const BucketSettings s = settings_of(config.at("dataset"));
        std::map<std::pair<int, int>, std::set<double>> expected;
        for (const auto& row : config.at("rows"))
            expected[{row[0].get<int>(), row[1].get<int>()}].insert(row[2].get<double>());
        for (const auto& [wh, choices] : expected) {
            std::mt19937_64 rng(7);
            std::set<double> drawn;
            for (int i = 0; i < 200; ++i) drawn.insert(choose_crop_aspect(s, {wh.first, wh.second}, rng));
            EXPECT_EQ(drawn, choices) << wh.first << "x" << wh.second;
            ++images;
        }
    }
    EXPECT_EQ(images, 90);
}

}  // namespace
}  // namespace test_bucket_reference_local
}  // namespace dtune::data
