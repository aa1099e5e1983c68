// `dtune demo`'s built-in model: a tiny SDXL-shaped diffusers folder (model_index.json, unet/,
// vae/, text_encoder{,_2}/, tokenizer{,_2}/, scheduler/) with random weights, small enough to
// train on a laptop CPU in minutes, that every dtune loader reads like a real SDXL folder.
//
// Invariants: the same seed gives the same weights; the tokenizers' vocab.json / merges.txt are
// real CLIP byte-level BPE files (256 byte symbols, their "</w>" forms, merges spelling every demo
// word left to right, then <|startoftext|> and <|endoftext|>), so CLIPTokenizer loads them and
// every demo caption tokenizes into known tokens. The UNet's cross_attention_dim equals the sum of
// the two encoders' hidden sizes and its add-embedding input matches the pooled size + 6 time ids,
// as in SDXL.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace dtune::demo {

struct DemoModelOptions {
    uint64_t seed = 0;
    // Fits the autoencoder to these images first ([N, 3, H, W] in [-1, 1]); undefined: random VAE.
    at::Tensor vae_fit_images;
    int vae_fit_steps = 0;
};

// The byte-level BPE files for `words`: vocab.json text and merges.txt text.
std::pair<std::string, std::string> make_demo_tokenizer(const std::vector<std::string>& words);

// Writes the model folder; returns a one-line summary (parameter counts, VAE fit loss).
std::string write_demo_model(const std::filesystem::path& dir, const std::vector<std::string>& words,
                             const DemoModelOptions& options);

}  // namespace dtune::demo
