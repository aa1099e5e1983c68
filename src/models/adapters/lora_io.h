// Reading and writing LoRA safetensors files for the UNet (SDXL).
//
// Read (load_lora, i.e. SimpleTuner's init_lora), keys per module <m> (dotted diffusers path):
//   diffusers:  unet.<m>.lora.down.weight / unet.<m>.lora.up.weight
//   PEFT:       unet.<m>.lora_A.weight / .lora_B.weight (also bare <m>..., base_model.model.<m>...,
//               and ".lora_A.default.weight"), DoRA: <m>.lora_magnitude_vector
//   old attention processors: unet.<...>.processor.to_q_lora.down.weight (to_out_lora -> to_out.0)
//   kohya/ComfyUI: lora_unet_<m with . -> _>.lora_down.weight / .lora_up.weight / .alpha
//               (/ .dora_scale); the underscored name is resolved against the adapted modules.
// alpha comes from a per-module `.alpha` tensor, else diffusers' `lora_adapter_metadata` JSON
// (r / lora_alpha / alpha_pattern, with or without the "unet." prefix), else stays as injected.
// Text-encoder keys (text_encoder*., lora_te*_) are skipped with a warning: only the UNet is
// adapted. Keys that match no adapted module, shape (rank) mismatches and adapted modules the
// file does not cover are DataErrors listing the keys.
//
// Write (save_lora): pytorch_lora_weights.safetensors in diffusers' layout (the first form above
// for SDXL's unet; PEFT's lora_A/lora_B names under "transformer." for Flux, as FluxPipeline's
// save_lora_weights writes them), plus `format: pt` and `lora_adapter_metadata` so diffusers'
// load_lora_weights gets alpha; or lora_format comfyui: for SDXL's unet kohya/ComfyUI keys with a
// float32 `.alpha` per module (DoRA magnitudes as `.dora_scale`); for a transformer (Flux) the
// diffusers layout's "transformer.<m>.lora_A/.lora_B" names plus the same `.alpha` / `.dora_scale`,
// which ComfyUI maps onto its fused weights exactly (SimpleTuner's layout; see save_lora).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "models/adapters/lora.h"

namespace dtune::models {

enum class LoRAFormat { kDiffusers, kComfyUI };

// "diffusers" / "comfyui" (SimpleTuner's lora_format); anything else is a UsageError.
LoRAFormat parse_lora_format(const std::string& value);

struct LoRALoadOptions {
    bool strict = true;  // every adapted module must be covered by the file
    // The fix named when the file's shapes do not fit the adapters. Training builds adapters from
    // lora_rank / use_dora; adapters built from the file itself (dtune sample) can only mismatch
    // when the LoRA belongs to another model.
    std::string shape_fix = "set lora_rank / use_dora to the file's values (or drop init_lora)";
};

struct LoRALoadReport {
    std::size_t modules_loaded = 0;
    std::size_t text_encoder_keys_skipped = 0;
    std::string format;  // "diffusers", "peft", "kohya"
};

// A LoRA's tensors and metadata: a file's as stored (zero-copy views of the mapping), or converted
// to one of the layouts above from another (Flux's kohya / Black Forest Labs files,
// models/flux/flux_lora.h). `origin` names the file in messages.
struct LoRATensors {
    std::string origin;
    io::TensorList tensors;
    io::Metadata metadata;
    std::string layout;  // the file's own layout when converted ("kohya/ComfyUI"), for logs; "" = as read

    static LoRATensors read(const std::filesystem::path& file);
};

// Copies the file's factors (and alphas, magnitudes) into already-injected adapters. The
// adapters must not be merged.
LoRALoadReport load_lora(LoRAAdapters& adapters, const std::filesystem::path& file,
                         const LoRALoadOptions& options = {});
LoRALoadReport load_lora(LoRAAdapters& adapters, const LoRATensors& lora,
                         const LoRALoadOptions& options = {});

// Writes the adapters to `file` (normally <dir>/pytorch_lora_weights.safetensors). `dtype`
// converts the tensors (kFloat keeps float32; the adapters' own dtype when nullopt). `prefix` is
// the diffusers component the keys and metadata name ("unet" for SDXL, "transformer" for Flux).
void save_lora(const LoRAAdapters& adapters, const std::filesystem::path& file, LoRAFormat format,
               std::optional<c10::ScalarType> dtype = std::nullopt, const std::string& prefix = "unet");

// The kohya name of a module: "lora_unet_" + dotted name with '.' -> '_'.
std::string kohya_lora_name(const std::string& module);

// What a LoRA file adapts, read from its keys (any of the layouts above): one entry per UNet module
// with its rank (rows of the down/A matrix) and whether it has a DoRA magnitude. Kohya names are
// resolved against `module_names` (the model's dotted module names). Text-encoder keys are
// skipped; keys that name no module of `module_names` are a DataError listing them.
struct LoRAFileModule {
    std::string module;
    int64_t rank = 0;
    bool dora = false;
};
std::vector<LoRAFileModule> lora_file_modules(const std::filesystem::path& file,
                                              const std::vector<std::string>& module_names);
std::vector<LoRAFileModule> lora_file_modules(const LoRATensors& lora,
                                              const std::vector<std::string>& module_names);

}  // namespace dtune::models
