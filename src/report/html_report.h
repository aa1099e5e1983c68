// output_dir/report.html: one self-contained page a user opens in a browser — run settings,
// loss / lr / grad-norm / eval-loss charts as inline SVG, the validation images as a grid by step
// and prompt (embedded as base64 PNG), the dataset summary, throughput and memory.
//
// Invariants: the page references nothing outside itself (no scripts, no external URLs), so it can
// be mailed or archived; all text from configs and captions is HTML-escaped. Torch-free: inputs are
// metrics.jsonl rows and image files named as validation writes them.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dtune::report {

// One validation image file: output_dir/validation_images/step_<N>_<shortname>_<i>_<WxH>.png.
struct ValidationImageFile {
    int64_t step = 0;
    std::string shortname;
    int index = 0;
    std::string resolution;  // "WxH"
    std::filesystem::path path;
};

// The file name validation uses (SimpleTuner's validation_images.py naming).
std::string validation_image_name(int64_t step, const std::string& shortname, int index, int width,
                                  int height);
// Parses a name made by validation_image_name (shortnames may contain '_'); nullopt otherwise.
std::optional<ValidationImageFile> parse_validation_image_name(const std::filesystem::path& path);
// Every parsable image of `dir`, sorted by step, shortname, resolution, index.
std::vector<ValidationImageFile> list_validation_images(const std::filesystem::path& dir);

// Every JSON object line of a .jsonl file (missing file: empty; bad lines are skipped).
std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& path);

struct ReportInput {
    std::string title = "dtune training report";
    nlohmann::json settings = nlohmann::json::object();  // shown as a key/value table
    std::vector<nlohmann::json> metrics;       // metrics.jsonl rows (step, loss, lr, grad_norm, ...)
    std::vector<nlohmann::json> eval_metrics;  // eval.jsonl rows (step, eval_loss)
    std::vector<ValidationImageFile> images;
    nlohmann::json dataset = nullptr;  // optional summary object (datasets, buckets, counts)
    std::string status;                // e.g. "running (checkpoint-40)", "finished"
};

// An inline SVG line chart of (x, y) points with min/max axis labels; `id` becomes the element id.
std::string svg_line_chart(const std::string& id, const std::string& title,
                           const std::vector<std::pair<double, double>>& points, int width = 560,
                           int height = 220);
std::string base64_encode(std::string_view bytes);
std::string html_escape(std::string_view text);

std::string render_report(const ReportInput& input);

// Collects metrics.jsonl, eval.jsonl, validation_images/ and config.resolved.json from
// `output_dir` and writes output_dir/report.html atomically. Returns its path.
std::filesystem::path write_report(const std::filesystem::path& output_dir, const std::string& status,
                                   const nlohmann::json& dataset = nullptr);

}  // namespace dtune::report
