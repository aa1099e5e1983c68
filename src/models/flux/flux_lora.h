// Flux.1 transformer LoRA files in the three key layouts people share, read into diffusers' layout
// (what models/adapters/lora_apply.h applies):
//
//   diffusers / PEFT  (FluxPipeline.save_lora_weights, SimpleTuner, ai-toolkit; with a `.alpha` per
//                      layer, SimpleTuner's and dtune's lora_format comfyui files):
//       transformer.transformer_blocks.0.attn.to_q.lora_A.weight / .lora_B.weight   (read as they are)
//   kohya / ComfyUI   (sd-scripts, ComfyUI):
//       lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight / .lora_up.weight / .alpha
//   Black Forest Labs (bare or under ComfyUI's "diffusion_model." prefix; lora_down / lora_up /
//                      .alpha spellings are read too):
//       diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight / .lora_B.weight
//
// The last two name the Linear layers of BFL's checkpoint (flux_bfl_linear_layers). A LoRA on a
// fused layer becomes one LoRA per diffusers layer: every part shares the down (A) matrix and the
// alpha, and takes its rows of the up (B) matrix (q, k, v; and the MLP input for linear1); the final
// AdaLN's up rows are swapped to diffusers' (scale, shift). The result equals the LoRA merged into
// the fused weight, W += alpha / rank · up · down, which is how ComfyUI applies these files
// (tests/validate/test_flux_pipeline.cpp against tools/ref/gen_flux_lora_layouts_ref.py).
// sd-scripts' split_qkv form (down [3r, in], block-diagonal up) needs nothing special: the zero
// blocks add nothing. alpha is the layer's `.alpha` tensor, else the rank (scale 1).
//
// Text-encoder tensors (lora_te*, text_encoders.*, text_encoder.*) are skipped with a warning: only
// the transformer is adapted. DoRA magnitudes (dora_scale), full-weight diffs (.diff, .diff_b),
// bias LoRAs and keys naming no layer of this transformer are DataErrors that list the keys.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "models/adapters/lora_io.h"
#include "models/flux/flux_transformer.h"

namespace dtune::models {

enum class FluxLoRALayout { kDiffusers, kKohya, kBlackForestLabs };

// "diffusers/PEFT", "kohya/ComfyUI", "Black Forest Labs".
const char* flux_lora_layout_name(FluxLoRALayout layout);

// The layout of a Flux transformer LoRA from its keys; nullopt when they are none of the three
// (e.g. an SDXL LoRA, or no LoRA at all).
std::optional<FluxLoRALayout> flux_lora_layout(const std::vector<std::string>& keys);

struct FluxLoRA {
    FluxLoRALayout layout = FluxLoRALayout::kDiffusers;
    LoRATensors tensors;  // diffusers' layout: transformer.<layer>.lora_A.weight / .lora_B.weight / .alpha
};

// Reads `file` in any of the three layouts for a transformer of `config`. DataError naming the file
// and an example key when the layout is none of them, and naming the key for a layer this
// transformer lacks, a shape that does not fit it, a bad alpha or NaN/infinite values.
FluxLoRA read_flux_lora(const std::filesystem::path& file, const FluxTransformerConfig& config);

}  // namespace dtune::models
