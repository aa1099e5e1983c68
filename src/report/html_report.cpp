// output_dir/report.html (see html_report.h).
#include "report/html_report.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "core/error.h"

namespace dtune::report {
namespace {

std::string read_binary(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

std::string fmt(double v) {
    char b[32];
    if (v != 0 && (std::fabs(v) < 1e-3 || std::fabs(v) >= 1e5))
        std::snprintf(b, sizeof(b), "%.3g", v);
    else
        std::snprintf(b, sizeof(b), "%.4g", v);
    return b;
}

std::vector<std::pair<double, double>> series(const std::vector<nlohmann::json>& rows, const char* key) {
    std::vector<std::pair<double, double>> out;
    for (const auto& r : rows) {
        if (!r.contains("step") || !r.contains(key) || !r.at(key).is_number()) continue;
        const double y = r.at(key).get<double>();
        if (std::isfinite(y)) out.emplace_back(r.at("step").get<double>(), y);
    }
    return out;
}

const char* kStyle = R"(<style>
body{font-family:system-ui,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
.charts{display:flex;flex-wrap:wrap;gap:16px}.chart{border:1px solid #ddd;background:#fafafa}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
.grid img{image-rendering:pixelated;width:160px;height:auto;display:block}
.muted{color:#777}.kv td:first-child{font-family:monospace}
</style>)";

}  // namespace

std::string validation_image_name(int64_t step, const std::string& shortname, int index, int width,
                                  int height) {
    return str("step_", step, "_", shortname, "_", index, "_", width, "x", height, ".png");
}

std::optional<ValidationImageFile> parse_validation_image_name(const std::filesystem::path& path) {
    const std::string name = path.filename().string();
    if (name.rfind("step_", 0) != 0 || path.extension() != ".png") return std::nullopt;
    std::string stem = name.substr(5, name.size() - 5 - 4);  // <N>_<shortname>_<i>_<WxH>
    const auto first = stem.find('_');
    const auto last = stem.rfind('_');
    if (first == std::string::npos || last == first) return std::nullopt;
    const auto mid = stem.rfind('_', last - 1);
    if (mid == std::string::npos || mid <= first) return std::nullopt;
    try {
        ValidationImageFile f;
        size_t used = 0;
        f.step = std::stoll(stem.substr(0, first), &used);
        if (used != first) return std::nullopt;
        f.shortname = stem.substr(first + 1, mid - first - 1);
        f.index = std::stoi(stem.substr(mid + 1, last - mid - 1));
        f.resolution = stem.substr(last + 1);
        if (f.resolution.find('x') == std::string::npos || f.shortname.empty()) return std::nullopt;
        f.path = path;
        return f;
    } catch (const std::exception&) {
        return std::nullopt;
    }
}

std::vector<ValidationImageFile> list_validation_images(const std::filesystem::path& dir) {
    std::vector<ValidationImageFile> out;
    std::error_code ec;
    if (!std::filesystem::is_directory(dir, ec)) return out;
    for (const auto& e : std::filesystem::directory_iterator(dir))
        if (auto f = parse_validation_image_name(e.path())) out.push_back(*f);
    std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
        return std::tie(a.step, a.shortname, a.resolution, a.index) <
               std::tie(b.step, b.shortname, b.resolution, b.index);
    });
    return out;
}

std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& path) {
    std::vector<nlohmann::json> rows;
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
        auto j = nlohmann::json::parse(line, nullptr, false);
        if (!j.is_discarded() && j.is_object()) rows.push_back(std::move(j));
    }
    return rows;
}

std::string base64_encode(std::string_view bytes) {
    static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    out.reserve((bytes.size() + 2) / 3 * 4);
    size_t i = 0;
    for (; i + 2 < bytes.size(); i += 3) {
        const uint32_t n = (static_cast<uint8_t>(bytes[i]) << 16) |
                           (static_cast<uint8_t>(bytes[i + 1]) << 8) | static_cast<uint8_t>(bytes[i + 2]);
        for (int k = 3; k >= 0; --k) out.push_back(kAlphabet[(n >> (6 * k)) & 63]);
    }
    if (i < bytes.size()) {
        uint32_t n = static_cast<uint8_t>(bytes[i]) << 16;
        if (i + 1 < bytes.size()) n |= static_cast<uint8_t>(bytes[i + 1]) << 8;
        out.push_back(kAlphabet[(n >> 18) & 63]);
        out.push_back(kAlphabet[(n >> 12) & 63]);
        out.push_back(i + 1 < bytes.size() ? kAlphabet[(n >> 6) & 63] : '=');
        out.push_back('=');
    }
    return out;
}

std::string html_escape(std::string_view text) {
    std::string out;
    for (const char c : text) {
        switch (c) {
            case '&': out += "&amp;"; break;
            case '<': out += "&lt;"; break;
            case '>': out += "&gt;"; break;
            case '"': out += "&quot;"; break;
            default: out.push_back(c);
        }
    }
    return out;
}

std::string svg_line_chart(const std::string& id, const std::string& title,
                           const std::vector<std::pair<double, double>>& points, int width, int height) {
    const int left = 60, right = 12, top = 24, bottom = 28;
    std::ostringstream s;
    s << "<svg class=\"chart\" id=\"" << html_escape(id) << "\" xmlns=\"http://www.w3.org/2000/svg\" width=\""
      << width << "\" height=\"" << height << "\" viewBox=\"0 0 " << width << " " << height << "\">"
      << "<text x=\"" << left << "\" y=\"16\" font-size=\"13\" font-weight=\"bold\">" << html_escape(title)
      << "</text>";
    if (points.empty()) {
        s << "<text x=\"" << left << "\" y=\"" << height / 2
          << "\" font-size=\"12\" fill=\"#777\">no data yet</text></svg>";
        return s.str();
    }
    double x0 = points.front().first, x1 = x0, y0 = points.front().second, y1 = y0;
    for (const auto& [x, y] : points) {
        x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
    if (x1 == x0) x1 = x0 + 1;
    if (y1 == y0) y1 = y0 + (y0 == 0 ? 1 : std::fabs(y0) * 0.1);
    const double pw = width - left - right, ph = height - top - bottom;
    auto px = [&](double x) { return left + (x - x0) / (x1 - x0) * pw; };
    auto py = [&](double y) { return top + (1 - (y - y0) / (y1 - y0)) * ph; };
    s << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << pw << "\" height=\"" << ph
      << "\" fill=\"#fff\" stroke=\"#bbb\"/>";
    s << "<text x=\"" << left - 4 << "\" y=\"" << top + 10 << "\" font-size=\"11\" text-anchor=\"end\">"
      << fmt(y1) << "</text><text x=\"" << left - 4 << "\" y=\"" << top + ph
      << "\" font-size=\"11\" text-anchor=\"end\">" << fmt(y0) << "</text>";
    s << "<text x=\"" << left << "\" y=\"" << height - 8 << "\" font-size=\"11\">step " << fmt(x0)
      << "</text><text x=\"" << left + pw << "\" y=\"" << height - 8
      << "\" font-size=\"11\" text-anchor=\"end\">step " << fmt(x1) << "</text>";
    s << "<polyline fill=\"none\" stroke=\"#1f6feb\" stroke-width=\"2\" points=\"";
    for (const auto& [x, y] : points) s << fmt(px(x)) << "," << fmt(py(y)) << " ";
    s << "\"/>";
    if (points.size() == 1)
        s << "<circle cx=\"" << px(points[0].first) << "\" cy=\"" << py(points[0].second)
          << "\" r=\"3\" fill=\"#1f6feb\"/>";
    s << "</svg>";
    return s.str();
}

namespace {

std::string kv_table(const nlohmann::json& obj) {
    std::ostringstream s;
    s << "<table class=\"kv\">";
    for (const auto& [k, v] : obj.items())
        s << "<tr><td>" << html_escape(k) << "</td><td>"
          << html_escape(v.is_string() ? v.get<std::string>() : v.dump()) << "</td></tr>";
    s << "</table>";
    return s.str();
}

// Rows = steps, columns = (shortname, resolution, index); each cell an embedded PNG.
std::string image_grid(const std::vector<ValidationImageFile>& images) {
    if (images.empty()) return "<p class=\"muted\">no validation images yet</p>";
    std::set<std::tuple<std::string, std::string, int>> columns;
    std::map<int64_t, std::map<std::tuple<std::string, std::string, int>, const ValidationImageFile*>> rows;
    for (const auto& im : images) {
        const auto col = std::make_tuple(im.shortname, im.resolution, im.index);
        columns.insert(col);
        rows[im.step][col] = &im;
    }
    std::ostringstream s;
    s << "<table class=\"grid\" id=\"validation-grid\"><tr><th>step</th>";
    for (const auto& [name, res, idx] : columns)
        s << "<th>" << html_escape(name) << "<br><span class=\"muted\">" << html_escape(res) << " #" << idx
          << "</span></th>";
    s << "</tr>";
    for (const auto& [step, cells] : rows) {
        s << "<tr><td>" << step << (step == 0 ? "<br><span class=\"muted\">base model</span>" : "")
          << "</td>";
        for (const auto& col : columns) {
            auto it = cells.find(col);
            s << "<td>";
            if (it != cells.end())
                s << "<img alt=\"" << html_escape(it->second->path.filename().string())
                  << "\" src=\"data:image/png;base64," << base64_encode(read_binary(it->second->path))
                  << "\">";
            s << "</td>";
        }
        s << "</tr>";
    }
    s << "</table>";
    return s.str();
}

std::string throughput_table(const std::vector<nlohmann::json>& metrics) {
    if (metrics.empty()) return "<p class=\"muted\">no steps yet</p>";
    double rate_sum = 0, mem = -1;
    int64_t n = 0;
    for (const auto& r : metrics) {
        if (r.contains("img_per_s") && r.at("img_per_s").is_number())
            rate_sum += r.at("img_per_s").get<double>(), ++n;
        if (r.contains("gpu_memory_gib") && r.at("gpu_memory_gib").is_number())
            mem = std::max(mem, r.at("gpu_memory_gib").get<double>());
    }
    const auto& last = metrics.back();
    nlohmann::json t = nlohmann::json::object();
    t["last step"] = last.value("step", 0);
    t["epoch"] = last.value("epoch", 0);
    if (last.contains("samples_seen")) t["samples seen"] = last.at("samples_seen");
    t["mean images/s"] = n ? fmt(rate_sum / static_cast<double>(n)) : "-";
    t["peak GPU memory (GiB)"] = mem >= 0 ? fmt(mem) : "- (CPU run)";
    // cuda_graph (metrics.jsonl's graph_replays / eager_steps / cuda_graph_fallback): how the steps
    // ran, and why not as graphs when they could not.
    if (last.contains("graph_replays") && last.contains("eager_steps"))
        t["CUDA graph"] = str(last.at("graph_replays").dump(), " steps replayed, ",
                              last.at("eager_steps").dump(), " eager (this run)");
    for (const auto& r : metrics)
        if (r.contains("cuda_graph_fallback") && r.at("cuda_graph_fallback").is_string())
            t["CUDA graph off because"] = r.at("cuda_graph_fallback").get<std::string>();
    return kv_table(t);
}

}  // namespace

std::string render_report(const ReportInput& in) {
    std::ostringstream s;
    s << "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>" << html_escape(in.title)
      << "</title>" << kStyle << "</head><body>";
    s << "<h1>" << html_escape(in.title) << "</h1>";
    if (!in.status.empty()) s << "<p>status: " << html_escape(in.status) << "</p>";
    s << "<h2>Training curves</h2><div class=\"charts\">"
      << svg_line_chart("loss-chart", "loss", series(in.metrics, "loss"))
      << svg_line_chart("lr-chart", "learning rate", series(in.metrics, "lr"))
      << svg_line_chart("grad-norm-chart", "grad norm", series(in.metrics, "grad_norm"));
    if (!in.eval_metrics.empty())
        s << svg_line_chart("eval-loss-chart", "eval loss", series(in.eval_metrics, "eval_loss"));
    // evaluation_type clip: rows of their own in metrics.jsonl, one per validation run.
    if (const auto clip = series(in.metrics, "clip/mean"); !clip.empty())
        s << svg_line_chart("clip-chart", "CLIP score (mean over prompts)", clip);
    s << "</div>";
    s << "<h2>Validation images</h2>" << image_grid(in.images);
    s << "<h2>Throughput and memory</h2>" << throughput_table(in.metrics);
    if (!in.dataset.is_null()) s << "<h2>Dataset</h2>" << kv_table(in.dataset);
    s << "<h2>Settings</h2>" << kv_table(in.settings);
    s << "</body></html>\n";
    return s.str();
}

std::filesystem::path write_report(const std::filesystem::path& output_dir, const std::string& status,
                                   const nlohmann::json& dataset) {
    ReportInput in;
    in.status = status;
    in.metrics = read_jsonl(output_dir / "metrics.jsonl");
    in.eval_metrics = read_jsonl(output_dir / "eval.jsonl");
    in.images = list_validation_images(output_dir / "validation_images");
    in.dataset = dataset;
    const auto cfg = output_dir / "config.resolved.json";
    if (std::filesystem::exists(cfg)) {
        auto j = nlohmann::json::parse(read_binary(cfg), nullptr, false);
        if (!j.is_discarded()) in.settings = j;
    }
    const auto path = output_dir / "report.html";
    const auto tmp = output_dir / "report.html.tmp";
    {
        std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
        out << render_report(in);
        if (!out) throw DataError(str("cannot write ", tmp.string(), "; check that output_dir is writable"));
    }
    std::filesystem::rename(tmp, path);
    return path;
}

}  // namespace dtune::report
