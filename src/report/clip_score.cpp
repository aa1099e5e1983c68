// CLIP score (see clip_score.h).
#include "report/clip_score.h"

#include <c10/core/InferenceMode.h>

#include <cmath>
#include <cstdlib>
#include <vector>

#include "core/error.h"

namespace dtune::report {

std::optional<std::filesystem::path> find_hub_folder(const std::string& name_or_path) {
    namespace fsys = std::filesystem;
    if (name_or_path.empty()) return std::nullopt;
    if (fsys::is_directory(name_or_path)) return fsys::path(name_or_path);
    const auto slash = name_or_path.find('/');
    if (slash == std::string::npos || name_or_path.find('/', slash + 1) != std::string::npos)
        return std::nullopt;
    const std::string repo =
        "models--" + name_or_path.substr(0, slash) + "--" + name_or_path.substr(slash + 1);
    std::vector<fsys::path> caches;
    if (const char* c = std::getenv("HF_HUB_CACHE"); c && *c) caches.emplace_back(c);
    if (const char* h = std::getenv("HF_HOME"); h && *h) caches.push_back(fsys::path(h) / "hub");
    if (const char* home = std::getenv("HOME"); home && *home)
        caches.push_back(fsys::path(home) / ".cache" / "huggingface" / "hub");
    for (const auto& cache : caches) {
        std::error_code ec;
        const fsys::path snapshots = cache / repo / "snapshots";
        if (!fsys::is_directory(snapshots, ec)) continue;
        for (const auto& e : fsys::directory_iterator(snapshots, ec))
            if (fsys::is_regular_file(e.path() / "config.json")) return e.path();
    }
    return std::nullopt;
}

CLIPScorer::CLIPScorer(const std::filesystem::path& dir, c10::Device device)
    : model_(models::load_clip_model(dir, device)),
      tokenizer_(models::CLIPTokenizer::from_folder(dir)),
      device_(device) {}

double CLIPScorer::score(const io::RgbImage& image, const std::string& prompt) {
    c10::InferenceMode guard;
    // The 8-bit pixels as floats in [0, 255] ([3, H, W]), what SimpleTuner hands to clip_score.
    const at::Tensor hwc =
        at::from_blob(const_cast<uint8_t*>(image.pixels.data()), {image.height, image.width, 3}, at::kByte);
    const at::Tensor chw = hwc.permute({2, 0, 1}).to(at::kFloat);
    const at::Tensor pixels =
        models::clip_preprocess(chw, model_->config().vision.image_size).unsqueeze(0).to(device_);
    const auto ids_vec = tokenizer_.encode(prompt, 77);
    const at::Tensor ids = at::tensor(ids_vec, at::kLong).unsqueeze(0).to(device_);
    const at::Tensor img = model_->image_features(pixels);
    const at::Tensor txt = model_->text_features(ids);
    const at::Tensor cos = (img / img.norm(2, -1, true) * (txt / txt.norm(2, -1, true))).sum(-1);
    return std::max(100.0 * cos.item<double>(), 0.0);
}

nlohmann::json clip_stats(const std::map<std::string, double>& scores) {
    if (scores.empty()) return nullptr;
    double lo = INFINITY, hi = -INFINITY, sum = 0;
    for (const auto& [_, s] : scores) lo = std::min(lo, s), hi = std::max(hi, s), sum += s;
    const double n = static_cast<double>(scores.size()), mean = sum / n;
    double var = 0;
    for (const auto& [_, s] : scores) var += (s - mean) * (s - mean);
    return {{"clip/min", lo}, {"clip/max", hi}, {"clip/mean", mean}, {"clip/std", std::sqrt(var / n)}};
}

}  // namespace dtune::report
