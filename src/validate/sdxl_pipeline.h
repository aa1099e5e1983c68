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

namespace dtune::validate {

struct StepLatents {
    int64_t step = 0;         // 0-based index of the sampler step that just ran
    int64_t total_steps = 0;  // steps of the whole sampling run
    double timestep = 0;      // the step's timestep (the scheduler's t)
    at::Tensor latents;       // [B*N, 4, h, w] float32 on the pipeline's device
};

struct GenerationRequest {
    std::vector<std::string> prompt;  // B prompts
    // nullopt: no negative prompt (zeros when the folder forces them); size 1 or B.
    std::optional<std::vector<std::string>> negative_prompt;
    int64_t width = 1024;
    int64_t height = 1024;
    int64_t steps = 30;
    double guidance_scale = 5.0;
    double guidance_rescale = 0.0;
    // euler | euler_a | ddim | dpmpp_2m | dpmpp_2m_karras | unipc (or the diffusion layer's names);
    // "" = the scheduler config's class.
    std::string sampler;
    uint64_t seed = 0;
    int num_images_per_prompt = 1;
    std::optional<int> clip_skip;
    // SDXL micro-conditioning; nullopt sizes mean (height, width).
    std::optional<diffusion::SizeHW> original_size;
    std::array<int64_t, 2> crops_coords_top_left{0, 0};
    std::optional<diffusion::SizeHW> target_size;
    std::optional<diffusion::SizeHW> negative_original_size;
    std::array<int64_t, 2> negative_crops_coords_top_left{0, 0};
    std::optional<diffusion::SizeHW> negative_target_size;
    // Given N(0, 1) latents [B*N, 4, H/8, W/8] replace the seeded draw (still scaled by
    // init_noise_sigma, as diffusers does with `latents=`).
    at::Tensor latents;
    bool decode = true;       // false: return only the final latents (diffusers' output_type="latent")
    bool vae_tiling = false;  // decode in overlapping tiles (AutoencoderKL::decode_tiled)
    // After each sampler step, with the latents the step produced (x_{t-1}, still scaled: what
    // diffusers' callback_on_step_end sees), for previews (report/validation.cpp). May be empty.
    std::function<void(const StepLatents&)> on_latents;
};

struct GenerationResult {
    at::Tensor latents;  // [B*N, 4, h, w] float32 CPU, final (still scaled) latents
    at::Tensor images;   // [B*N, 3, H, W] float32 CPU in [0, 1]; undefined when decode is false
};

// Called after each sampler step with (steps done, total steps).
using StepCallback = std::function<void(int64_t done, int64_t total)>;

struct PipelineLoadOptions {
    c10::ScalarType dtype = c10::kFloat;  // UNet and text encoders; the VAE follows force_upcast
    c10::Device device = c10::Device(c10::kCPU);
};

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

// [B, 3, H, W] in [0, 1] -> 8-bit RGB images (value * 255, rounded, as diffusers' numpy_to_pil).
std::vector<io::RgbImage> to_rgb_images(const at::Tensor& images);

}  // namespace dtune::validate
