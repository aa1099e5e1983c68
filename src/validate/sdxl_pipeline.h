// SDXL text-to-image generation, equal to diffusers' StableDiffusionXLPipeline.__call__ for the
// options below:
//
//   prompts --encode_prompt--> embeds (+ negatives with CFG, i.e. guidance_scale > 1)
//   latents = N(0, 1) from a CPU generator seeded with `seed` (or the given `latents`)
//             * sampler.init_noise_sigma()                            [B*N, 4, H/8, W/8]
//   for each step: unet(scale_model_input(cat[uncond, cond])) -> CFG (+ rescale) -> sampler.step
//   images = (vae.decode(unscale(latents)) / 2 + 0.5).clamp(0, 1)     [B*N, 3, H, W]
//
// Invariants: the latents and the guidance arithmetic stay float32 whatever the model dtype (the
// UNet output is upcast before CFG), so bf16 runs differ from fp32 only by the model's rounding.
// Initial noise is drawn on the CPU, so a seed gives the same latents on every device. Images are
// returned on the CPU in float32. SDXL micro-conditioning defaults to original = target = (H, W),
// crop (0, 0); the negative time ids equal the positive ones unless negative sizes are given.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "diffusion/guidance.h"
#include "io/image.h"
#include "models/adapters/lora.h"
#include "models/clip/sdxl_text_encoders.h"
#include "models/sdxl/sdxl_configs.h"
#include "models/unet/unet_2d_condition.h"
#include "models/vae/autoencoder_kl.h"
#include "validate/generation.h"

namespace dtune::validate {

class SDXLPipeline {
  public:
    SDXLPipeline(models::SDXLTextEncoders text_encoders, models::UNet2DConditionModel unet,
                 models::AutoencoderKL vae, nlohmann::json scheduler_config, c10::Device device);

    // A diffusers SDXL folder (model_index.json, text encoders, tokenizers, unet, vae, scheduler).
    static SDXLPipeline load(const std::filesystem::path& folder, const PipelineLoadOptions& options = {});
    // An SDXL single-file checkpoint (ldm/sgm layout, io/ldm_keys.h) for the weights, with the
    // configs, tokenizers and scheduler of `config_folder` (a diffusers SDXL folder of the same
    // architecture, as diffusers' from_single_file(config=...)) or, when `config_folder` is empty,
    // dtune's built-in SDXL base 1.0 ones (models/sdxl/sdxl_configs.h; the file must then have
    // SDXL base's architecture). With the built-ins, a file marked as v-prediction (a `v_pred` key,
    // ComfyUI's convention) gets prediction_type v_prediction, and one marked `ztsnr` zero-terminal
    // SNR. Strict: any missing, unexpected or mis-shaped tensor is a DataError.
    static SDXLPipeline load_single_file(const std::filesystem::path& checkpoint,
                                         const std::filesystem::path& config_folder = {},
                                         const PipelineLoadOptions& options = {});
    // The same with the configs given.
    static SDXLPipeline load_single_file(const std::filesystem::path& checkpoint, models::SDXLConfigs configs,
                                         const PipelineLoadOptions& options = {});

    // Applies a UNet LoRA file (diffusers, PEFT or kohya layout) at `strength` for every later
    // generate() (models/adapters/lora_apply.h). One LoRA per pipeline: a second call is a
    // UsageError.
    void load_lora(const std::filesystem::path& file, double strength = 1.0);
    const models::LoRAAdapters* lora() const { return lora_ ? &*lora_ : nullptr; }

    // Throws UsageError for sizes not a multiple of the VAE factor, empty prompts, steps < 1 or
    // latents of the wrong shape.
    GenerationResult generate(const GenerationRequest& request, const StepCallback& on_step = {});

    models::SDXLTextEncoders& text_encoders() { return text_encoders_; }
    models::UNet2DConditionModel& unet() { return unet_; }
    models::AutoencoderKL& vae() { return vae_; }
    const nlohmann::json& scheduler_config() const { return scheduler_config_; }
    c10::Device device() const { return device_; }

  private:
    struct Conditioning;
    Conditioning condition(const GenerationRequest& request, bool cfg);
    at::Tensor denoise(const GenerationRequest& request, const Conditioning& cond, at::Tensor latents,
                       at::Generator& generator, const StepCallback& on_step);

    models::SDXLTextEncoders text_encoders_;
    models::UNet2DConditionModel unet_;
    models::AutoencoderKL vae_;
    nlohmann::json scheduler_config_;
    c10::Device device_;
    std::optional<models::LoRAAdapters> lora_;  // refers to unet_'s layers, declared after it
};

}  // namespace dtune::validate
