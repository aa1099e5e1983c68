// report.html in headless Chromium (Debian's `chromium`; skipped when absent): the page loads with
// no console errors and the screenshot shows the loss curve and the embedded validation images.
// A control page with a script error proves the console check can fail.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include "io/image.h"
#include "report/html_report.h"
#include "support/test_support.h"

namespace dtune::report {
namespace test_report_browser_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

std::string chromium_binary() {
    for (const char* name : {"chromium", "chromium-browser", "google-chrome"})
        if (std::system((std::string("command -v ") + name + " >/dev/null 2>&1").c_str()) == 0) return name;
    return "";
}

struct Shot {
    int rc = 0;
    std::string log;
    io::RgbImage image;
};

Shot screenshot(const std::string& chromium, const std::filesystem::path& html,
                const std::filesystem::path& dir) {
    const auto png = dir / "shot.png";
    const auto log = dir / "chromium.log";
    const std::string cmd = chromium +
                            " --headless --no-sandbox --disable-gpu --hide-scrollbars --no-first-run"
                            " --window-size=1280,1400 --enable-logging=stderr --v=0 --screenshot=" +
                            png.string() + " file://" + html.string() + " > " + log.string() + " 2>&1";
    Shot s;
    s.rc = std::system(cmd.c_str());
    std::ifstream in(log);
    s.log.assign(std::istreambuf_iterator<char>(in), {});
    if (std::filesystem::exists(png)) s.image = io::read_image(png);
    return s;
}

// Lines Chromium logs for the page's console errors and uncaught exceptions.
bool has_console_error(const std::string& log) {
    return log.find("CONSOLE") != std::string::npos || log.find("Uncaught") != std::string::npos;
}

int64_t count_pixels(const io::RgbImage& im, int r, int g, int b, int tol) {
    int64_t n = 0;
    for (int y = 0; y < im.height; ++y)
        for (int x = 0; x < im.width; ++x) {
            const uint8_t* p = im.row(y) + 3 * x;
            if (std::abs(p[0] - r) <= tol && std::abs(p[1] - g) <= tol && std::abs(p[2] - b) <= tol) ++n;
        }
    return n;
}

TEST(ReportBrowser, LoadsWithoutErrorsAndRendersChartsAndImages) {
    const std::string chromium = chromium_binary();
    if (chromium.empty()) GTEST_SKIP() << "chromium not installed (apt-get install chromium)";
    test::TempDir dir;
    {
        std::ofstream m(dir / "metrics.jsonl");
        for (int s = 1; s <= 50; ++s)
            m << nlohmann::json{{"step", s},
                                {"loss", 1.0 / s},
                                {"lr", 1e-4 * s},
                                {"grad_norm", 1.0 + (s % 5)}}
                     .dump()
              << "\n";
    }
    // A pure magenta validation image: its pixels in the screenshot prove the image rendered.
    io::RgbImage im(64, 64);
    for (size_t i = 0; i < im.pixels.size(); i += 3)
        im.pixels[i] = 255, im.pixels[i + 1] = 0, im.pixels[i + 2] = 255;
    std::filesystem::create_directories(dir / "validation_images");
    io::write_image(dir / "validation_images" / validation_image_name(50, "validation", 0, 64, 64), im);
    const auto html = write_report(dir.path(), "finished");

    const Shot s = screenshot(chromium, html, dir.path());
    ASSERT_EQ(s.rc, 0) << s.log;
    ASSERT_GT(s.image.width, 0) << "no screenshot; chromium log:\n" << s.log;
    EXPECT_FALSE(has_console_error(s.log)) << s.log;
    // The charts' stroke colour #1f6feb and the magenta image both appear.
    EXPECT_GT(count_pixels(s.image, 0x1f, 0x6f, 0xeb, 40), 300);
    EXPECT_GT(count_pixels(s.image, 255, 0, 255, 10), 64 * 64);

    // Control: a page with a script error is caught, and a page without charts has no curve.
    const auto bad = dir / "bad.html";
    std::ofstream(bad)
        << "<!DOCTYPE html><html><body><p>x</p><script>undefined_function();</script></body></html>";
    const Shot b = screenshot(chromium, bad, dir.path());
    EXPECT_TRUE(has_console_error(b.log)) << b.log;
    EXPECT_LT(count_pixels(b.image, 0x1f, 0x6f, 0xeb, 40), 10);
}

}  // namespace
}  // namespace test_report_browser_local
}  // namespace dtune::report
