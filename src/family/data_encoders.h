// What every model family's data side shares (family/model_family.h): the VAE as the data layer's
// callable, the text-cache identity of a model folder's text encoders, and their quantisation.
//
// Invariants: the VAE callable is deterministic per (image, noise salt): the posterior sample's
// noise comes from a CPU generator seeded by posterior_seed (a hash of the image's pixels, mixed
// with the salt when it is not 0), so latents do not depend on batching, rank, thread timing or
// the run (a cache built by any rank or run, or by `dtune cache`, which uses this same callable,
// is the one a fresh build would write). vae_cache_disable passes a per-draw salt, so each epoch
// draws a fresh sample.
// The callables own the models: dropping them frees the memory.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <array>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "data/cache_builder.h"
#include "train/config.h"

namespace dtune::models {
class AutoencoderKLImpl;
}
namespace torch::nn {
class Module;
}

namespace dtune::family {

// text_encoder_1_precision / text_encoder_2_precision of a config, for DataEncoderOptions: `dtune
// train` and `dtune cache` must quantise alike, or their text caches get different identities.
std::array<std::string, 2> text_encoder_precision_from(const train::TrainConfig& config);

// What the text cache is keyed by: a fingerprint of the files of the model folder's
// text_encoder/, text_encoder_2/, tokenizer/ and tokenizer_2/ (relative name, size, and the
// SHA-256 of each file's first and last MiB). The same files anywhere give the same identity (a
// moved or copied model keeps its cache); another model's encoders or tokenizer give another.
// `label` names the family's encoders ("SDXLTextEncoders", "FluxTextEncoders").
std::string text_encoder_identity(const std::filesystem::path& model_dir,
                                  const std::string& label = "SDXLTextEncoders");

// text_encoder_N_precision: quantises encoders[i] in place by precisions[i] ("no_change" skips it)
// and appends each preset to `identity`.
void quantize_text_encoders(const std::vector<torch::nn::Module*>& encoders,
                            const std::array<std::string, 2>& precisions, std::string& identity);

// What quantize_text_encoders appends to the identity for the first `count` encoders, without
// loading or quantising anything (for encoders loaded only when a cache entry must be built).
// Throws like it for an unknown preset.
std::string text_precision_identity(const std::array<std::string, 2>& precisions, std::size_t count);

// The model folder's VAE (or `vae_override`) as `e.vae`, with its identity and latent channels.
void load_vae_encoder(const std::filesystem::path& model_dir, const std::filesystem::path& vae_override,
                      c10::Device device, c10::ScalarType dtype, data::DataEncoders& e);

struct VaeEncodeOptions {
    // NHWC convolutions (weights converted here, inputs per call); the latents come back in the
    // standard layout. On CUDA this also enables the fused inference kernels (GroupNorm+SiLU, bias
    // folding, wide-head attention: models/common/group_norm_act.h); load_sdxl_data_encoders turns
    // it on for CUDA (bench/bench_vae_cache.cpp measures each variant).
    bool channels_last = false;
};

// The VAE callable of training and `dtune cache`: images [B, 3, H, W] float32 (CPU; pinned memory
// makes the upload asynchronous) → scaled posterior samples [B, C, H/8, W/8] float32 on the VAE's
// device, noise seeded per image by tensor_content_hash. Nothing in it waits for the device, so
// the cache builder can queue the next batch while this one runs; callers move the result to
// the CPU. `vae` holds weights of `dtype` on `device`.
data::LatentEncodeFn make_vae_encode_fn(std::shared_ptr<models::AutoencoderKLImpl> vae, c10::Device device,
                                        c10::ScalarType dtype, VaeEncodeOptions options = {});

// 64-bit hash of a tensor's values (contiguous CPU copy), used to seed the posterior sample.
uint64_t tensor_content_hash(const at::Tensor& t);
// The generator seed of one image's posterior sample (63 bits).
uint64_t posterior_seed(const at::Tensor& image, uint64_t salt);

}  // namespace dtune::family
