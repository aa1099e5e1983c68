// The model families dtune knows, by name: SimpleTuner's model_family value and the diffusers
// pipeline class (model_index.json's _class_name) of each. Torch-free, so the configuration layer
// can pick the family of a model folder before anything loads; family/registry.cpp maps each name
// to its ModelFamily. A new family adds a row here and one in the registry.
#pragma once

#include <string_view>

namespace dtune::family {

struct FamilyName {
    const char* name;            // "sdxl", "flux"
    const char* pipeline_class;  // "StableDiffusionXLPipeline", "FluxPipeline"
};

inline constexpr FamilyName kFamilyNames[] = {
    {"sdxl", "StableDiffusionXLPipeline"},
    {"flux", "FluxPipeline"},
};

// The family name of a diffusers pipeline class; empty for a class no family has.
inline std::string_view family_of_pipeline_class(std::string_view pipeline_class) {
    for (const auto& f : kFamilyNames)
        if (pipeline_class == f.pipeline_class) return f.name;
    return {};
}

}  // namespace dtune::family
