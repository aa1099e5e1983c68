// `dtune demo`'s built-in models: a tiny SDXL-shaped diffusers folder (model_index.json, unet/,
// vae/, text_encoder{,_2}/, tokenizer{,_2}/, scheduler/) and a tiny Flux.1 [dev]-shaped one
// (model_index.json, transformer/, vae/ with 16 latent channels, text_encoder/ (CLIP-L's place),
// text_encoder_2/ (T5), tokenizer{,_2}/, scheduler/), with random weights, small enough to train on
// a laptop CPU in minutes, that every dtune loader reads like a real folder of that family.
//
// Invariants: the same seed gives the same weights; the CLIP tokenizers' vocab.json / merges.txt
// are real CLIP byte-level BPE files (256 byte symbols, their "</w>" forms, merges spelling every
// demo word left to right, then <|startoftext|> and <|endoftext|>), so CLIPTokenizer loads them and
// every demo caption tokenizes into known tokens; Flux's T5 tokenizer is a real `tokenizers`
// Unigram tokenizer.json (make_demo_t5_tokenizer). SDXL: the UNet's cross_attention_dim equals the
// sum of the two encoders' hidden sizes and its add-embedding input matches the pooled size + 6 time
// ids. Flux: the transformer's joint_attention_dim is T5's d_model and its pooled_projection_dim
// CLIP's hidden size, as in Flux.1.
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

// Writes the SDXL-shaped model folder; returns a one-line summary (parameter counts, VAE fit loss).
std::string write_demo_model(const std::filesystem::path& dir, const std::vector<std::string>& words,
                             const DemoModelOptions& options);

// T5's tokenizer for the Flux demo (tokenizer_2): the text of a `tokenizers` tokenizer.json with a
// Unigram model (T5's <pad>, </s>, <unk> at ids 0-2, then "▁" + each of `words`, then single
// characters for anything else) and T5's Metaspace pre-tokenizer and "</s>" post-processor, so
// each demo word is one piece. No normalizer: the demo's captions are lower-case ASCII.
std::string make_demo_t5_tokenizer(const std::vector<std::string>& words);

// Writes the Flux.1 [dev]-shaped model folder; returns a one-line summary as write_demo_model does.
std::string write_demo_flux_model(const std::filesystem::path& dir, const std::vector<std::string>& words,
                                  const DemoModelOptions& options);

}  // namespace dtune::demo
