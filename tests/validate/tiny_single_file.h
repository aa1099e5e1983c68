// The tiny SDXL fixture written as one single-file checkpoint in the original ldm/sgm key layout
// (UNet, VAE and both text encoders; fused OpenCLIP q/k/v, conv VAE attention), with our own
// diffusers -> ldm map. Shared by the pipeline parity test and the `dtune sample` CLI test.
#pragma once

#include <filesystem>
#include <string>
#include <utility>

#include "io/ldm_keys.h"
#include "io/safetensors.h"

namespace dtune::test {

inline std::filesystem::path write_tiny_single_file(const std::filesystem::path& tiny_folder,
                                                    const std::filesystem::path& out) {
    const std::pair<io::LdmComponent, std::pair<const char*, const char*>> parts[] = {
        {io::LdmComponent::kUNet, {"unet", "diffusion_pytorch_model"}},
        {io::LdmComponent::kVAE, {"vae", "diffusion_pytorch_model"}},
        {io::LdmComponent::kTextEncoder, {"text_encoder", "model"}},
        {io::LdmComponent::kTextEncoder2, {"text_encoder_2", "model"}}};
    io::TensorList single;
    for (const auto& [kind, where] : parts) {
        const auto src = io::WeightSource::open(tiny_folder / where.first, where.second);
        io::TensorList comp;
        for (const auto& k : src.keys()) {
            std::string name = k;
            if (kind == io::LdmComponent::kTextEncoder) {
                // transformers 5 saves CLIPTextModel without "text_model."; single files carry it.
                if (k.ends_with("position_ids")) continue;
                if (k.rfind("text_model.", 0) != 0) name = "text_model." + k;
            }
            comp.emplace_back(name, src.get(k));
        }
        for (auto& kv : io::diffusers_to_ldm(comp, kind)) single.push_back(std::move(kv));
    }
    io::save_safetensors(out, single);
    return out;
}

}  // namespace dtune::test
