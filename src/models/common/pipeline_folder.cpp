// model_index.json parsing and component path resolution (see pipeline_folder.h).
#include "models/common/pipeline_folder.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"

namespace dtune::models {
namespace stdfs = std::filesystem;
using nlohmann::json;

PipelineFolder PipelineFolder::open(const stdfs::path& root) {
    DTUNE_CHECK_AS(DataError, stdfs::exists(root), "model folder not found: ", root.string(),
                   "; pass a diffusers pipeline folder (the one holding model_index.json)");
    DTUNE_CHECK_AS(DataError, stdfs::is_directory(root), "model path ", root.string(),
                   " is a file, not a diffusers pipeline folder; pass the folder holding model_index.json "
                   "(single-file .safetensors checkpoints go through the ldm key map)");
    const stdfs::path index = root / "model_index.json";
    DTUNE_CHECK_AS(
        DataError, stdfs::is_regular_file(index), "no model_index.json in ", root.string(),
        "; this is not a diffusers pipeline folder (for a single component, load its folder directly)");
    json j;
    try {
        j = json::parse(fs::read_file(index));
    } catch (const json::exception& e) {
        throw DataError(str(index.string(), " is not valid JSON (", e.what(), "); re-download it"));
    }
    DTUNE_CHECK_AS(DataError, j.is_object(), index.string(), " must be a JSON object; re-download it");
    PipelineFolder folder;
    folder.root_ = root;
    folder.class_name_ = j.value("_class_name", std::string());
    if (j.contains("force_zeros_for_empty_prompt") && j["force_zeros_for_empty_prompt"].is_boolean())
        folder.force_zeros_for_empty_prompt_ = j["force_zeros_for_empty_prompt"].get<bool>();
    for (const auto& [name, value] : j.items()) {
        if (name.empty() || name[0] == '_') continue;  // _class_name, _diffusers_version, ...
        if (!value.is_array()) continue;               // plain settings such as requires_aesthetics_score
        DTUNE_CHECK_AS(DataError, value.size() == 2, index.string(), ": component \"", name,
                       "\" must be [library, class], got ", value.dump(), "; fix model_index.json");
        if (value[0].is_null() || value[1].is_null()) continue;  // not part of this pipeline
        folder.components_[name] =
            PipelineComponent{name, value[0].get<std::string>(), value[1].get<std::string>(), root / name};
    }
    return folder;
}

const PipelineComponent& PipelineFolder::component(const std::string& name) const {
    const auto it = components_.find(name);
    DTUNE_CHECK_AS(DataError, it != components_.end(), root_.string(), "/model_index.json lists no \"", name,
                   "\" component (", class_name_.empty() ? "unknown pipeline" : class_name_,
                   "); use a pipeline that has one, or pass that component's folder explicitly");
    DTUNE_CHECK_AS(DataError, stdfs::is_directory(it->second.path), "model_index.json lists \"", name, "\" (",
                   it->second.library, " ", it->second.class_name, ") but the folder ",
                   it->second.path.string(), " does not exist; the download is incomplete: fetch the ", name,
                   "/ folder again");
    return it->second;
}

std::vector<std::string> PipelineFolder::component_names() const {
    std::vector<std::string> names;
    for (const auto& [name, _] : components_) names.push_back(name);
    return names;
}

void PipelineFolder::set_vae_override(const stdfs::path& path) {
    vae_override_ = resolve_vae_path(path);
}

stdfs::path PipelineFolder::vae_path() const {
    if (vae_override_) return *vae_override_;
    return component("vae").path;
}

stdfs::path resolve_vae_path(const stdfs::path& path) {
    if (stdfs::is_regular_file(path)) {
        DTUNE_CHECK_AS(DataError, path.extension() == ".safetensors", "pretrained_vae_model_name_or_path ",
                       path.string(),
                       " is a file but not .safetensors; convert it or pass a diffusers VAE folder");
        return path;
    }
    if (stdfs::is_directory(path)) {
        if (stdfs::is_regular_file(path / "config.json")) return path;  // a VAE component folder
        if (stdfs::is_regular_file(path / "vae" / "config.json")) return path / "vae";  // a pipeline
        throw DataError(
            str("pretrained_vae_model_name_or_path ", path.string(),
                " has neither config.json nor vae/config.json; pass a diffusers AutoencoderKL folder"));
    }
    const std::string s = path.string();
    // "sdxl-base/vae" is shaped like a hub id; when sdxl-base is a local folder it is a model
    // folder that lacks its vae/.
    if (path.has_parent_path() && stdfs::is_directory(path.parent_path()))
        throw DataError(str("pretrained_vae_model_name_or_path ", s, ": the folder ",
                            path.parent_path().string(), " has no ", path.filename().string(),
                            "/ folder; copy a diffusers VAE there or pass a local VAE folder or file"));
    const bool looks_like_hub_id =
        !s.empty() && s[0] != '/' && s[0] != '.' && std::count(s.begin(), s.end(), '/') == 1;
    if (looks_like_hub_id)
        throw DataError(
            str("pretrained_vae_model_name_or_path \"", s,
                "\" looks like a Hugging Face hub id; dtune reads local files only: download it (e.g. "
                "`huggingface-cli download ",
                s, " --local-dir <dir>`) and pass <dir>"));
    throw DataError(
        str("pretrained_vae_model_name_or_path ", s, " does not exist; pass a local VAE folder or file"));
}

}  // namespace dtune::models
