#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "core/progress.h"

namespace dtune {
namespace {

std::string slurp(std::FILE* f) {
    std::fflush(f);
    std::rewind(f);
    std::string out;
    char buf[512];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
    return out;
}

}  // namespace

TEST(Progress, FormatsDurationsAndRates) {
    EXPECT_EQ(format_duration(0), "00:00");
    EXPECT_EQ(format_duration(75), "01:15");
    EXPECT_EQ(format_duration(3723), "01:02:03");
    EXPECT_EQ(format_duration(-1), "??:??");
    EXPECT_EQ(format_rate(41.25, "img"), "41.2 img/s");
    EXPECT_EQ(format_rate(0.25, "step"), "4.00 s/step");
    EXPECT_EQ(format_rate(12.5, "prompt", "prompts"), "12.5 prompts/s");
    EXPECT_EQ(format_rate(0.5, "prompt", "prompts"), "2.00 s/prompt");
}

TEST(Progress, RenderShowsPercentCountEtaAndRate) {
    std::FILE* f = std::tmpfile();
    Progress p(1000, {.label = "caching", .unit = "img", .out = f, .tty = 0, .log_interval_s = 1e9});
    p.update(420);
    // 420 items in 10 s -> 42 img/s, 580 left -> ETA 13.8 s.
    EXPECT_EQ(p.render(10.0, true),
              "caching 42%|##########              | 420/1000 [00:10<00:14, 42.0 img/s]");
    EXPECT_EQ(p.render(10.0, false), "caching 42% 420/1000 [00:10<00:14, 42.0 img/s]");
    p.finish();
    std::fclose(f);
}

TEST(Progress, UnknownTotalShowsCountAndRate) {
    Progress p(0, {.label = "scan", .unit = "file", .out = std::tmpfile(), .tty = 0, .quiet = true});
    p.update(30);
    EXPECT_EQ(p.render(2.0, true), "scan 30 file [00:02, 15.0 file/s]");
}

TEST(Progress, NonTtyWritesPlainLinesWithoutControlCodes) {
    std::FILE* f = std::tmpfile();
    {
        Progress p(10, {.label = "steps", .out = f, .tty = 0, .log_interval_s = 0.0});
        for (int i = 0; i < 10; ++i) p.update();
    }  // destructor prints the final line
    const std::string text = slurp(f);
    std::fclose(f);
    EXPECT_EQ(text.find('\r'), std::string::npos);
    EXPECT_EQ(text.find('\033'), std::string::npos);
    EXPECT_NE(text.find("steps 100% 10/10"), std::string::npos);
    EXPECT_GE(std::count(text.begin(), text.end(), '\n'), 10);
}

TEST(Progress, TtyRedrawsInPlace) {
    std::FILE* f = std::tmpfile();
    Progress p(4, {.label = "x", .out = f, .tty = 1});
    p.update(4);
    p.finish();
    const std::string text = slurp(f);
    std::fclose(f);
    EXPECT_NE(text.find("\rx 100%|########################| 4/4"), std::string::npos);
    EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 1);
}

TEST(Progress, QuietPrintsNothing) {
    std::FILE* f = std::tmpfile();
    {
        Progress p(5, {.out = f, .tty = 0, .log_interval_s = 0.0, .quiet = true});
        p.update(5);
    }
    EXPECT_EQ(slurp(f), "");
    std::fclose(f);
}

}  // namespace dtune
