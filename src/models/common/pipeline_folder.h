// A diffusers pipeline folder (`model_index.json` + one sub-folder per component), resolved to
// component paths. Torch-free: it only reads JSON and checks paths; the model loaders take the
// component folders it returns.
//
// model_index.json maps a component name to [library, class] ("unet": ["diffusers",
// "UNet2DConditionModel"]); [null, null] means "not part of this pipeline". A listed component
// whose folder is missing is an error that names the folder and the fix.
//
// The VAE can be overridden (SimpleTuner's `pretrained_vae_model_name_or_path`, e.g. the fp16-fix
// VAE): set_vae_override() accepts a VAE folder (config.json + weights), a pipeline folder (its
// vae/ is used) or a single .safetensors file; vae_path() then returns it instead of <root>/vae.
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dtune::models {

struct PipelineComponent {
    std::string name;        // "text_encoder_2"
    std::string library;     // "transformers"
    std::string class_name;  // "CLIPTextModelWithProjection"
    std::filesystem::path path;
};

class PipelineFolder {
  public:
    // Throws DataError when the folder or model_index.json is missing or malformed.
    static PipelineFolder open(const std::filesystem::path& root);

    const std::filesystem::path& root() const { return root_; }
    const std::string& class_name() const { return class_name_; }  // "StableDiffusionXLPipeline"
    // Listed with a class (not [null, null]).
    bool has(const std::string& name) const { return components_.count(name) != 0; }
    // The component's entry; throws DataError when it is not listed or its folder is missing.
    const PipelineComponent& component(const std::string& name) const;
    std::vector<std::string> component_names() const;
    // model_index.json's force_zeros_for_empty_prompt; SDXL pipelines default to true.
    bool force_zeros_for_empty_prompt() const { return force_zeros_for_empty_prompt_; }

    // pretrained_vae_model_name_or_path: throws DataError when `path` is none of the accepted forms.
    void set_vae_override(const std::filesystem::path& path);
    const std::optional<std::filesystem::path>& vae_override() const { return vae_override_; }
    // The VAE to load: the override if set, else component("vae").path.
    std::filesystem::path vae_path() const;

  private:
    std::filesystem::path root_;
    std::string class_name_;
    bool force_zeros_for_empty_prompt_ = true;
    std::map<std::string, PipelineComponent> components_;
    std::optional<std::filesystem::path> vae_override_;
};

// Resolves a pretrained_vae_model_name_or_path value to a VAE folder or .safetensors file (see
// the file comment). Hub ids ("madebyollin/sdxl-vae-fp16-fix") are rejected with a message that
// says to download them: dtune reads local paths only.
std::filesystem::path resolve_vae_path(const std::filesystem::path& path);

}  // namespace dtune::models
