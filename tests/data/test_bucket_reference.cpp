// The size calculators against tools/ref/bucket_sizes.py: 400 sizes recomputed in Python, where
// round-half-even and int truncation are native, so this checks our emulation of both.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>

#include "core/fs.h"
#include "data/buckets.h"

namespace dtune::data {
namespace {

Size size_of(const nlohmann::json& j) {
    return {j.at(0).get<int>(), j.at(1).get<int>()};
}

TEST(BucketReference, MatchesPythonRecomputation) {
    const auto path = std::filesystem::path(DTUNE_DATA_TEST_DIR) / "ref" / "bucket_sizes.json";
    const auto ref = nlohmann::json::parse(fs::read_file(path));
    AspectResolutionMap map(ref.at("megapixels").get<double>());
    int n = 0;
    for (const auto& c : ref.at("cases")) {
        const Size original = size_of(c.at("original"));
        const double aspect = aspect_of(original);
        ASSERT_DOUBLE_EQ(aspect, c.at("aspect").get<double>()) << original.width << "x" << original.height;
        const SizeResult area = size_by_pixel_area(aspect, 1.048576, original, {}, &map);
        EXPECT_EQ(area.target, size_of(c["area"]["target"])) << original.width << "x" << original.height;
        EXPECT_EQ(area.intermediary, size_of(c["area"]["intermediary"]))
            << original.width << "x" << original.height;
        EXPECT_DOUBLE_EQ(area.aspect, c["area"]["bucket"].get<double>());
        const SizeResult pixel = size_by_pixel_edge(aspect, 1024, original);
        EXPECT_EQ(pixel.target, size_of(c["pixel"]["target"])) << original.width << "x" << original.height;
        EXPECT_EQ(pixel.intermediary, size_of(c["pixel"]["intermediary"]));
        EXPECT_DOUBLE_EQ(pixel.aspect, c["pixel"]["bucket"].get<double>());
        ++n;
    }
    EXPECT_EQ(n, 400);
}

}  // namespace
}  // namespace dtune::data
