// LoRA files applied for inference (see lora_apply.h).
#include "models/adapters/lora_apply.h"

#include <torch/nn/module.h>

#include <cmath>
#include <map>

#include "core/error.h"
#include "core/log.h"
#include "models/adapters/lora_io.h"

namespace dtune::models {

LoRAAdapters apply_lora_file(torch::nn::Module& unet, const std::filesystem::path& file, double strength) {
    return apply_lora(unet, LoRATensors::read(file), strength);
}

LoRAAdapters apply_lora(torch::nn::Module& unet, const LoRATensors& lora, double strength) {
    const std::string& file = lora.origin;
    DTUNE_CHECK_AS(UsageError, std::isfinite(strength), "LoRA strength ", strength, " for ", file,
                   " is not a finite number; use e.g. 1.0");
    std::map<std::string, torch::nn::Module*> layers;
    std::vector<std::string> names;
    for (const auto& item : unet.named_modules("", /*include_self=*/false)) {
        torch::nn::Module* m = item.value().get();
        if (dynamic_cast<AdaptableLinearImpl*>(m) || dynamic_cast<AdaptableConv2dImpl*>(m)) {
            layers[item.key()] = m;
            names.push_back(item.key());
        }
    }
    const std::vector<LoRAFileModule> modules = lora_file_modules(lora, names);

    LoRAConfig config;  // dropout 0, no rslora: inference
    config.target_modules.clear();
    std::vector<LoRAAdapters::Entry> entries;
    for (const LoRAFileModule& m : modules) {
        config.target_modules.push_back(m.module);
        LoRAConfig layer_config = config;
        layer_config.use_dora = m.dora;
        const double alpha = static_cast<double>(m.rank);  // scale 1 unless the file says otherwise
        torch::nn::Module* host = layers.at(m.module);
        std::shared_ptr<LoRALayer> layer;
        if (auto* linear = dynamic_cast<AdaptableLinearImpl*>(host)) {
            layer = std::make_shared<LoRALayer>(*linear, m.rank, alpha, layer_config);
            linear->set_adapter(layer);
        } else {
            auto* conv = dynamic_cast<AdaptableConv2dImpl*>(host);
            layer = std::make_shared<LoRALayer>(*conv, m.rank, alpha, layer_config);
            conv->set_adapter(layer);
        }
        entries.push_back({m.module, std::move(layer)});
    }
    LoRAAdapters adapters(config, std::move(entries));
    LoRALoadOptions load;
    load.shape_fix =
        "the adapters were built from the file's own ranks, so its layers have other sizes than this "
        "model's: the LoRA was made for another model (e.g. SD 1.5 or another UNet size); pass a LoRA "
        "trained on this model";
    load_lora(adapters, lora, load);
    for (const auto& e : adapters.entries()) e.layer->set_scale(e.layer->scale() * strength);
    log::info() << "LoRA " << file << ": " << adapters.size() << " layers at strength " << strength;
    return adapters;
}

}  // namespace dtune::models
