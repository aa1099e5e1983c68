// Flux.1 [dev]/[schnell] as a model family (family/model_family.h; notes in flux_family.cpp).
#pragma once

#include <string>
#include <vector>

#include "family/model_family.h"

namespace dtune::family {

// The flux family (one instance; family_named("flux") returns it).
const ModelFamily& flux_family();

// SimpleTuner's flux_lora_target values dtune trains (config.cpp lists the same choices).
inline constexpr const char* kFluxLoraTargets =
    "mmdit,context,context+ffs,all,all+ffs,all+ffs+embedder,ai-toolkit,tiny,nano";
// The LoRA target module suffixes of a flux_lora_target value (SimpleTuner's list for it, as it
// matches dtune's module names); UsageError listing the choices for another value.
std::vector<std::string> flux_lora_target_modules(const std::string& target);

// A .safetensors file in Black Forest Labs' Flux transformer layout (bare or ComfyUI-prefixed); a
// Flux LoRA in that layout is not one.
bool is_flux_transformer_file(const std::filesystem::path& file);

}  // namespace dtune::family
