// Key dialect of single-file SDXL checkpoints (the original Stability "ldm"/sgm layout that
// ComfyUI and A1111 users download) <-> diffusers/transformers component keys.
//
// Pure name and tensor mapping, no model code. Layout of an SDXL single file:
//   model.diffusion_model.*               UNet           (input_blocks/middle_block/output_blocks)
//   first_stage_model.*                   VAE            (encoder.down.N.block.M, mid.attn_1, ...)
//   conditioner.embedders.0.transformer.* text_encoder   (already transformers' CLIP layout)
//   conditioner.embedders.1.model.*       text_encoder_2 (OpenCLIP: resblocks, fused in_proj)
//
// Name maps work on component-relative keys (prefix stripped) and return "" for a key they do not
// know. Tensor maps (ldm_to_diffusers / diffusers_to_ldm) also apply the three value changes:
//   - OpenCLIP attn.in_proj_weight/bias [3D, D] <-> q/k/v_proj [D, D] each (split / concatenated);
//   - OpenCLIP text_projection [D, P] = transposed text_projection.weight [P, D];
//   - VAE mid-block attention q/k/v/proj_out: 1x1 conv [C, C, 1, 1] <-> linear [C, C].
// ldm_to_diffusers(diffusers_to_ldm(x)) == x, key for key and value for value.
//
// The UNet map needs `layers_per_block` (2 for SDXL) and the VAE map the number of resolution
// levels (4 for SDXL): those fix the ldm block numbering.
#pragma once

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "io/safetensors.h"

namespace dtune::io {

enum class LdmComponent { kUNet, kVAE, kTextEncoder, kTextEncoder2 };

struct LdmLayout {
    int unet_layers_per_block = 2;
    int vae_num_blocks = 4;
};

// "model.diffusion_model.", "first_stage_model.", "conditioner.embedders.0.transformer.",
// "conditioner.embedders.1.model.".
const char* ldm_prefix(LdmComponent component);
const char* ldm_component_name(LdmComponent component);  // "unet", "vae", "text_encoder", ...

// True when `keys` look like an SDXL single file (UNet + both conditioner embedders present).
bool is_ldm_sdxl_checkpoint(const std::vector<std::string>& keys);

// The prefix under which `keys` hold an ldm-layout VAE: "first_stage_model." (SD/SDXL single files),
// "vae." (ComfyUI's Flux and SD3 checkpoints) or "" (a VAE on its own: Black Forest Labs'
// ae.safetensors, sdxl_vae.safetensors); nullopt when there is none. ldm_to_diffusers(kVAE) reads
// the VAE from there.
std::optional<std::string> ldm_vae_prefix(const std::vector<std::string>& keys);

// Name maps, component-relative. "" = not a key of this component.
std::string ldm_unet_key_to_diffusers(const std::string& key, int layers_per_block);
// The ldm index of an up block's upsampler depends on whether that block has attentions.
std::string diffusers_unet_key_to_ldm(const std::string& key, int layers_per_block,
                                      const std::set<int>& up_blocks_with_attention);
std::string ldm_vae_key_to_diffusers(const std::string& key, int num_blocks);
std::string diffusers_vae_key_to_ldm(const std::string& key, int num_blocks);
// OpenCLIP <-> transformers for names that map one to one (not in_proj, which is split).
std::string open_clip_key_to_transformers(const std::string& key);
std::string transformers_key_to_open_clip(const std::string& key);

// The component's tensors from a single file, under diffusers/transformers names (values are
// views of the file where no change is needed). Throws DataError naming the key that cannot be
// mapped, and when the component is absent from the file.
TensorList ldm_to_diffusers(const WeightSource& file, LdmComponent component, const LdmLayout& layout = {});
// The inverse: diffusers-named tensors of one component -> full ldm keys (prefix included).
TensorList diffusers_to_ldm(const TensorList& tensors, LdmComponent component, const LdmLayout& layout = {});

}  // namespace dtune::io
