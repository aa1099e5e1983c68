// Exports of a full fine-tune: a complete diffusers pipeline folder (every family) and, optionally,
// an SDXL single-file checkpoint (the ldm/sgm layout ComfyUI and A1111 load from models/checkpoints).
//
// export_pipeline(base, network, folder, dir) writes
//     dir/<folder>/{config.json, diffusion_pytorch_model.safetensors}   the trained network
//                                                                  (folder: "unet", "transformer")
//     dir/<every other component of base/model_index.json>          hard links where the filesystem
//                                                                  allows, else copies
//     dir/model_index.json                                          base's
// into `dir.tmp` and renames it over `dir`, so a crash never leaves a half-written pipeline.
// The VAE comes from `vae_dir` when given (pretrained_vae_model_name_or_path as a local folder).
//
// export_single_file(base, unet, file) writes the trained UNet plus base's VAE and both text
// encoders under the single-file key names (io/ldm_keys.h's diffusers_to_ldm), atomically.
//
// Invariants: what is written loads back with PipelineFolder / SDXLPipeline::load (folder) and
// SDXLPipeline::load_single_file (file, with base as the config folder) to exactly the trained
// tensors; base is only read.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

namespace torch::nn {
class Module;
}

namespace dtune::family {

void export_pipeline(const std::filesystem::path& base_model_dir, const torch::nn::Module& network,
                     const std::string& network_folder, const std::filesystem::path& out_dir,
                     const std::optional<std::filesystem::path>& vae_dir = std::nullopt);

void export_single_file(const std::filesystem::path& base_model_dir, const torch::nn::Module& unet,
                        const std::filesystem::path& file,
                        const std::optional<std::filesystem::path>& vae_dir = std::nullopt);

// Copies a directory tree, hard-linking files where possible (same filesystem, permitted).
// Returns the number of files copied rather than linked.
std::size_t link_or_copy_tree(const std::filesystem::path& from, const std::filesystem::path& to);

}  // namespace dtune::family
