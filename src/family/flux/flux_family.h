// Flux.1 [dev]/[schnell] as a model family (family/model_family.h; notes in flux_family.cpp).
#pragma once

#include "family/model_family.h"

namespace dtune::family {

// The flux family (one instance; family_named("flux") returns it).
const ModelFamily& flux_family();

// A .safetensors file in Black Forest Labs' Flux transformer layout (bare or ComfyUI-prefixed); a
// Flux LoRA in that layout is not one.
bool is_flux_transformer_file(const std::filesystem::path& file);

}  // namespace dtune::family
