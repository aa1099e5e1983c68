// Loading one diffusers component folder (`unet/`, `vae/`): config.json plus
// diffusion_pytorch_model.safetensors or its sharded index, into a requested dtype and device.
//
// Loaders build the module inside an UninitializedParameters scope (layers.h): its large tensors
// are allocated uninitialised, directly in the requested dtype and on the requested device, then
// written once from the memory-mapped checkpoint. No float32 copy, no random init.
#pragma once

#include <torch/nn/module.h>

#include <filesystem>
#include <optional>
#include <string>

#include "io/ldm_keys.h"
#include "models/common/config_json.h"

namespace dtune::models {

struct ComponentLoadOptions {
    c10::ScalarType dtype = c10::kFloat;
    c10::Device device = c10::Device(c10::kCPU);
    bool channels_last = false;  // convolution weights (and inputs) in NHWC memory order
    // Weights from a single-file SDXL checkpoint (ldm/sgm key layout) instead of the folder's own
    // safetensors; the folder still provides config.json unless `config` is set.
    std::optional<std::filesystem::path> single_file;
    // The component config instead of `<dir>/config.json` (e.g. the built-in SDXL base configs of
    // models/sdxl/sdxl_builtin.h); with single_file set the folder is then not read at all.
    std::optional<ConfigReader> config;
};

// options.config when set, else read_component_config(dir, what).
ConfigReader component_config(const std::filesystem::path& dir, const ComponentLoadOptions& options,
                              const std::string& what);

// Reads `<dir>/config.json`; DataError naming the path when the folder or file is missing.
ConfigReader read_component_config(const std::filesystem::path& dir, const std::string& what);

// Moves `module` to dtype/device, then loads the folder's weights (or options.single_file's, mapped
// from the ldm key layout as `component`) strictly: missing/unexpected keys are listed in a DataError.
void load_component_weights(torch::nn::Module& module, const std::filesystem::path& dir,
                            const ComponentLoadOptions& options, const std::string& what,
                            io::LdmComponent component, const io::LdmLayout& layout = {});

// Restrides every 4-D parameter to channels-last (NHWC) memory order, in place.
void convert_to_channels_last(torch::nn::Module& module);

}  // namespace dtune::models
