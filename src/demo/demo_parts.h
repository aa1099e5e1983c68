// Pieces the demo's two built-in models share (demo_model.cpp: SDXL-shaped, demo_flux_model.cpp:
// Flux.1-shaped): JSON files, CLIP tokenizer folders, CLIP text-encoder configs and the fit of a
// random autoencoder to the demo images.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "models/vae/autoencoder_kl.h"

namespace dtune::demo {

// Writes `j` (indented) to `path`, creating its folder.
void write_json(const std::filesystem::path& path, const nlohmann::json& j);

// A CLIPTokenizer folder (vocab.json, merges.txt, special_tokens_map.json, tokenizer_config.json)
// padding with `pad`.
void write_clip_tokenizer(const std::filesystem::path& dir, const std::string& vocab,
                          const std::string& merges, const std::string& pad);

// A tiny CLIP text tower's config.json (32 wide, 3 layers, 77 positions).
nlohmann::json clip_config(bool projection, int64_t vocab, int64_t bos, int64_t eos, int64_t pad,
                           const char* act);

// Reconstruction (+ a small KL term keeping latents near unit scale) on `images` ([N, 3, H, W] in
// [-1, 1]), so that decoded validation latents look like coloured shapes rather than noise. Leaves
// the VAE in eval mode; returns the final reconstruction MSE.
// The demo autoencoder's config.json: 4 levels of 16/16/32/32 channels, one layer each. SDXL's (4
// latent channels, quant convs) without `shift_factor`; Flux's (16 channels, no quant convs,
// latents (z - shift) · scaling) with it.
nlohmann::json demo_vae_config(int64_t latent_channels, double scaling_factor,
                               std::optional<double> shift_factor = std::nullopt);

double fit_vae(models::AutoencoderKL& vae, const at::Tensor& images, int steps, uint64_t seed);

}  // namespace dtune::demo
