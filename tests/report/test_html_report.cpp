// report.html pieces: base64 against RFC 4648's vectors, escaping, SimpleTuner's validation file
// names, and a page built from an output_dir layout (charts, embedded images, no external refs).
#include <gtest/gtest.h>

#include <fstream>

#include "report/html_report.h"
#include "support/test_support.h"

namespace dtune::report {
namespace test_html_report_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

TEST(HtmlReport, Base64Rfc4648Vectors) {
    EXPECT_EQ(base64_encode(""), "");
    EXPECT_EQ(base64_encode("f"), "Zg==");
    EXPECT_EQ(base64_encode("fo"), "Zm8=");
    EXPECT_EQ(base64_encode("foo"), "Zm9v");
    EXPECT_EQ(base64_encode("foob"), "Zm9vYg==");
    EXPECT_EQ(base64_encode("fooba"), "Zm9vYmE=");
    EXPECT_EQ(base64_encode("foobar"), "Zm9vYmFy");
}

TEST(HtmlReport, EscapesMarkup) {
    EXPECT_EQ(html_escape("a<b>&\"c\""), "a&lt;b&gt;&amp;&quot;c&quot;");
}

TEST(HtmlReport, ValidationImageNamesRoundTrip) {
    // SimpleTuner: step_<global_step>_<shortname>_<idx>_<WxH>.png
    EXPECT_EQ(validation_image_name(40, "validation", 0, 1024, 768), "step_40_validation_0_1024x768.png");
    const auto f = parse_validation_image_name("/x/step_40_red_circle_2_64x64.png");
    ASSERT_TRUE(f.has_value());
    EXPECT_EQ(f->step, 40);
    EXPECT_EQ(f->shortname, "red_circle");
    EXPECT_EQ(f->index, 2);
    EXPECT_EQ(f->resolution, "64x64");
    EXPECT_FALSE(parse_validation_image_name("/x/step_x_a_0_64x64.png").has_value());
    EXPECT_FALSE(parse_validation_image_name("/x/sample_1_0.png").has_value());
    EXPECT_FALSE(parse_validation_image_name("/x/step_4_a_0_64x64.jpg").has_value());
}

TEST(HtmlReport, PageFromOutputDir) {
    test::TempDir dir;
    {
        std::ofstream m(dir / "metrics.jsonl");
        for (int s = 1; s <= 4; ++s)
            m << nlohmann::json{{"step", s},        {"loss", 1.0 / s},  {"lr", 1e-4},
                                {"grad_norm", 2.0}, {"img_per_s", 8.0}, {"samples_seen", 4 * s}}
                     .dump()
              << "\n";
        m << "not json\n";
    }
    std::filesystem::create_directories(dir / "validation_images");
    std::ofstream(dir / "validation_images" / "step_0_validation_0_64x64.png") << "PNGDATA0";
    std::ofstream(dir / "validation_images" / "step_4_validation_0_64x64.png") << "PNGDATA4";
    std::ofstream(dir / "config.resolved.json")
        << R"({"learning_rate": 0.0001, "validation_prompt": "<b>x</b>"})";
    const auto path = write_report(dir.path(), "finished", nlohmann::json{{"images", 12}});
    std::ifstream in(path);
    const std::string html((std::istreambuf_iterator<char>(in)), {});
    EXPECT_NE(html.find("id=\"loss-chart\""), std::string::npos);
    EXPECT_NE(html.find("<polyline"), std::string::npos);
    // The two images, embedded: base64("PNGDATA0") and base64("PNGDATA4").
    EXPECT_NE(html.find("data:image/png;base64,UE5HREFUQTA="), std::string::npos);
    EXPECT_NE(html.find("data:image/png;base64,UE5HREFUQTQ="), std::string::npos);
    EXPECT_NE(html.find("base model"), std::string::npos);
    EXPECT_NE(html.find("&lt;b&gt;x&lt;/b&gt;"), std::string::npos);
    EXPECT_EQ(html.find("<b>x</b>"), std::string::npos);
    EXPECT_EQ(html.find("<script"), std::string::npos);
    EXPECT_EQ(html.find("http://www.w3.org/2000/svg") == std::string::npos, false);  // the SVG namespace only
    EXPECT_EQ(html.find("src=\"http"), std::string::npos);
    EXPECT_NE(html.find("samples seen"), std::string::npos);
}

// cuda_graph's metrics.jsonl fields: the replay / eager counts of the last row, and the reason a run
// that could have used graphs trained eagerly (written once, on the first row).
TEST(HtmlReport, ShowsHowTheStepsRanOnTheGpu) {
    ReportInput in;
    in.metrics = {nlohmann::json{{"step", 1},
                                 {"img_per_s", 2.0},
                                 {"graph_replays", 0},
                                 {"eager_steps", 1},
                                 {"cuda_graph_fallback", "optimizer is optimi-lion (only fused AdamW...)"}},
                  nlohmann::json{{"step", 2}, {"img_per_s", 2.0}, {"graph_replays", 0}, {"eager_steps", 2}}};
    const std::string page = render_report(in);
    EXPECT_NE(page.find("0 steps replayed, 2 eager"), std::string::npos);
    EXPECT_NE(page.find("CUDA graph off because"), std::string::npos);
    EXPECT_NE(page.find("optimizer is optimi-lion"), std::string::npos);
    in.metrics = {nlohmann::json{{"step", 1}, {"img_per_s", 2.0}}};  // a CPU run: no such rows
    EXPECT_EQ(render_report(in).find("CUDA graph"), std::string::npos);
}

TEST(HtmlReport, ChartScalesPointsIntoThePlotArea) {
    const std::string svg = svg_line_chart("c", "t", {{0, 0}, {10, 1}}, 560, 220);
    // left 60, right 12, top 24, bottom 28: (0,0) -> (60, 192), (10,1) -> (548, 24).
    EXPECT_NE(svg.find("points=\"60,192 548,24 \""), std::string::npos) << svg;
    EXPECT_NE(svg_line_chart("c", "t", {}).find("no data yet"), std::string::npos);
}

}  // namespace
}  // namespace test_html_report_local
}  // namespace dtune::report
