#include <gtest/gtest.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "support/test_support.h"

namespace dtune {

TEST(Log, ParsesLevels) {
    EXPECT_EQ(log::parse_level("DEBUG"), log::Level::kDebug);
    EXPECT_EQ(log::parse_level("warning"), log::Level::kWarn);
    EXPECT_EQ(log::parse_level("Error"), log::Level::kError);
    EXPECT_FALSE(log::parse_level("loud").has_value());
}

TEST(Log, RankPrefixOnlyWhenDistributed) {
    log::set_rank(0, 1);
    EXPECT_EQ(log::format_line(log::Level::kInfo, "hi").find("rank"), std::string::npos);
    log::set_rank(3, 8);
    EXPECT_NE(log::format_line(log::Level::kWarn, "hi").find("warn [rank 3/8]: hi"), std::string::npos);
    log::set_rank(0, 1);
}

TEST(Log, WritesFileAndFiltersByLevel) {
    test::TempDir dir;
    const auto file = dir / "sub/train.log";
    log::set_stderr(false);
    log::set_file(file);
    log::set_level(log::Level::kInfo);
    log::debug() << "hidden " << 1;
    log::info() << "cached " << 42 << " latents";
    log::set_file({});
    log::set_stderr(true);
    const std::string text = fs::read_file(file);
    EXPECT_NE(text.find("info: cached 42 latents\n"), std::string::npos);
    EXPECT_EQ(text.find("hidden"), std::string::npos);
}

TEST(Log, UnwritableFileIsAClearError) {
    EXPECT_THROW(log::set_file("/proc/definitely/not/here.log"), Error);
}

}  // namespace dtune
