// Component folder loading: config + weights with path-naming errors.
#include "models/common/component.h"

#include <torch/autograd.h>

#include "core/error.h"
#include "models/common/weights.h"

namespace dtune::models {

ConfigReader read_component_config(const std::filesystem::path& dir, const std::string& what) {
    DTUNE_CHECK_AS(DataError, std::filesystem::is_directory(dir), what, ": folder '", dir.string(),
                   "' does not exist; pass the component folder of a diffusers model (e.g. <model>/unet)");
    const auto config = dir / "config.json";
    DTUNE_CHECK_AS(DataError, std::filesystem::is_regular_file(config), what, ": '", config.string(),
                   "' is missing; the folder must be a diffusers component folder with config.json");
    return ConfigReader::from_file(config);
}

ConfigReader component_config(const std::filesystem::path& dir, const ComponentLoadOptions& options,
                              const std::string& what) {
    return options.config ? *options.config : read_component_config(dir, what);
}

void load_component_weights(torch::nn::Module& module, const std::filesystem::path& dir,
                            const ComponentLoadOptions& options, const std::string& what,
                            io::LdmComponent component, const io::LdmLayout& layout) {
    module.to(options.device, options.dtype);
    LoadOptions load;
    load.dtype = options.dtype;
    load.device = options.device;
    if (options.single_file) {
        const io::WeightSource file = io::WeightSource::open(*options.single_file);
        load_weights(module, io::ldm_to_diffusers(file, component, layout), load,
                     str(what, " from ", options.single_file->string()), options.single_file->string(),
                     &file);
    } else {
        const io::WeightSource source = io::WeightSource::open(dir, "diffusion_pytorch_model");
        load_weights(module, source, load, str(what, " from ", dir.string()));
    }
    if (options.channels_last) convert_to_channels_last(module);
}

void convert_to_channels_last(torch::nn::Module& module) {
    torch::NoGradGuard no_grad;
    for (auto& p : module.parameters(true)) {
        if (p.dim() == 4) p.set_data(p.contiguous(at::MemoryFormat::ChannelsLast));
    }
}

}  // namespace dtune::models
