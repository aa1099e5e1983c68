// What a text-to-image request asks and gets, for every family's pipeline (validate/sdxl_pipeline.h,
// validate/flux_pipeline.h) and for validation during training (family::ImageSampler). A field a
// family has no use for is ignored by it (SDXL's micro-conditioning sizes under Flux).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "diffusion/guidance.h"
#include "io/image.h"

namespace dtune::validate {

struct StepLatents {
    int64_t step = 0;         // 0-based index of the sampler step that just ran
    int64_t total_steps = 0;  // steps of the whole sampling run
    double timestep = 0;      // the step's timestep (the scheduler's t)
    at::Tensor latents;       // [B*N, C, h, w] float32 on the pipeline's device (C: the VAE's channels)
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
    // Flux: true classifier-free guidance with negative_prompt when > 1 (two passes a step), T5's
    // prompt tokens, and freeing both text encoders once the prompts are encoded (one-shot use).
    double true_cfg_scale = 1.0;
    int64_t true_cfg_start_step = 0;  // true CFG from this sampler step on (earlier steps: one pass)
    int64_t max_sequence_length = 512;
    bool free_text_encoders = false;
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

// [B, 3, H, W] in [0, 1] -> 8-bit RGB images (value * 255, rounded, as diffusers' numpy_to_pil).
std::vector<io::RgbImage> to_rgb_images(const at::Tensor& images);

}  // namespace dtune::validate
