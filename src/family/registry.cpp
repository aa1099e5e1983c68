// The known model families, by SimpleTuner's model_family name and by a diffusers folder's class.
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "family/export.h"
#include "family/family_names.h"
#include "family/flux/flux_family.h"
#include "family/model_family.h"
#include "family/sdxl/sdxl_family.h"

namespace dtune::family {
namespace {

// The ModelFamily of each name in family_names.h.
const ModelFamily* family_object(std::string_view name) {
    if (name == "sdxl") return &sdxl_family();
    if (name == "flux") return &flux_family();
    return nullptr;
}

}  // namespace

const diffusion::NoiseSchedule& TrainingObjective::ddpm(const char* what) const {
    DTUNE_CHECK_AS(UsageError, schedule.has_value(), what,
                   " needs a DDPM noise schedule; this model trains with flow matching");
    return *schedule;
}

const ModelFamily& family_of_model(const std::filesystem::path& model) {
    if (std::filesystem::is_directory(model)) {
        if (const ModelFamily* f = family_of_model_folder(model)) return *f;
        return sdxl_family();  // another pipeline class: the SDXL loader says what it holds and lacks
    }
    return is_flux_transformer_file(model) ? flux_family() : sdxl_family();
}

void ModelFamily::export_pipeline(const std::filesystem::path& base_model_dir,
                                  const torch::nn::Module& network, const std::filesystem::path& out_dir,
                                  const std::optional<std::filesystem::path>& vae_dir) const {
    family::export_pipeline(base_model_dir, network, denoiser_folder(), out_dir, vae_dir);
}

std::string family_names() {
    std::string out;
    for (const auto& k : kFamilyNames) out += (out.empty() ? "" : ", ") + std::string(k.name);
    return out;
}

const ModelFamily& family_named(const std::string& name) {
    if (const ModelFamily* f = family_object(name)) return *f;
    throw UsageError(str("model_family \"", name, "\" is not supported; dtune knows ", family_names()));
}

const ModelFamily* family_of_model_folder(const std::filesystem::path& model_dir) {
    const auto index = model_dir / "model_index.json";
    if (!std::filesystem::is_regular_file(index)) return nullptr;
    const auto j = nlohmann::json::parse(fs::read_file(index), nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) return nullptr;
    return family_object(family_of_pipeline_class(j.value("_class_name", "")));
}

}  // namespace dtune::family
