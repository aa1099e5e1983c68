// SDXL's VAE and two CLIP text encoders wrapped as the data layer's callables (DatasetEncoders),
// for `dtune train`'s caches and on-the-fly encoding.
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

#include "train/config.h"
#include "train/dataset_source.h"

namespace dtune::models {
class AutoencoderKLImpl;
}

namespace dtune::train {

struct SdxlEncoderOptions {
    std::filesystem::path model_dir;     // diffusers SDXL folder (tokenizers, text encoders, vae)
    std::filesystem::path vae_override;  // pretrained_vae_model_name_or_path when a local folder
    c10::Device device = c10::Device(c10::kCPU);
    c10::ScalarType vae_dtype = c10::kFloat;  // bf16 on CUDA (SimpleTuner's default), fp32 on CPU
    // text_encoder_1_precision / text_encoder_2_precision (core/quant_preset.h); "no_change" keeps
    // the encoder dense. A quantised encoder gives other embeddings, so its caches get another identity.
    std::array<std::string, 2> text_encoder_precision{"no_change", "no_change"};
};

DatasetEncoders load_sdxl_data_encoders(const SdxlEncoderOptions& options);

// text_encoder_1_precision / text_encoder_2_precision of a config, for SdxlEncoderOptions: `dtune
// train` and `dtune cache` must quantise alike, or their text caches get different identities.
std::array<std::string, 2> text_encoder_precision_from(const TrainConfig& config);

// What the text cache is keyed by: a fingerprint of the files of the model folder's
// text_encoder/, text_encoder_2/, tokenizer/ and tokenizer_2/ (relative name, size, and the
// SHA-256 of each file's first and last MiB). The same files anywhere give the same identity (a
// moved or copied model keeps its cache); another model's encoders or tokenizer give another.
std::string text_encoder_identity(const std::filesystem::path& model_dir);

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

}  // namespace dtune::train
