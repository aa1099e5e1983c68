// Applying a LoRA file to a model for inference (`dtune sample --lora`, validation with a trained
// LoRA): the adapters are built from what the file holds, not from a training config.
//
// apply_lora_file() attaches one adapter to every UNet layer the file names (any layout that
// lora_io.h reads: diffusers, PEFT, kohya/ComfyUI), each with the file's own rank and DoRA
// magnitude when it has one, loads the factors and alphas (kohya `.alpha`, diffusers metadata, else
// alpha = rank, i.e. scale 1, as diffusers does without alphas), then multiplies every layer's
// scale by `strength` (diffusers' lora_scale / ComfyUI's strength_model). The adapters run
// unmerged, like diffusers' load_lora_weights: for plain LoRA, strength 0 gives exactly the base
// model's output (base + 0·BA). Text-encoder LoRA tensors are skipped with a warning.
#pragma once

#include <filesystem>

#include "models/adapters/lora.h"
#include "models/adapters/lora_io.h"

namespace torch::nn {
class Module;
}

namespace dtune::models {

// Throws DataError for a file with no UNet LoRA weights, keys that name no layer, or shapes that
// do not fit; UsageError when a named layer already carries an adapter.
LoRAAdapters apply_lora_file(torch::nn::Module& unet, const std::filesystem::path& file,
                             double strength = 1.0);
// The same for tensors already read (or converted from another key layout, models/flux/flux_lora.h).
LoRAAdapters apply_lora(torch::nn::Module& model, const LoRATensors& lora, double strength = 1.0);

}  // namespace dtune::models
