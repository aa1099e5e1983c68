// Classifier-free guidance and SDXL's micro-conditioning, as diffusers' StableDiffusionXLPipeline
// applies them.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>

namespace dtune::diffusion {

// Whether the pipeline needs the unconditional pass at all: diffusers runs CFG only for scale > 1.
inline bool uses_cfg(double guidance_scale) {
    return guidance_scale > 1.0;
}

// uncond + scale (cond - uncond), then, for guidance_rescale > 0, Lin et al. 2023's rescale (§3.4):
// the guided prediction's per-sample std is brought toward the conditional one's and blended by
// guidance_rescale (diffusers' rescale_noise_cfg). With uses_cfg(scale) false it returns `cond`
// unchanged, as the pipeline does then.
at::Tensor classifier_free_guidance(const at::Tensor& uncond, const at::Tensor& cond, double guidance_scale,
                                    double guidance_rescale = 0.0);
// The rescale alone: guided [B, ...] toward cond [B, ...]'s std over all but the batch dim.
at::Tensor rescale_noise_cfg(const at::Tensor& guided, const at::Tensor& cond, double guidance_rescale);

// SDXL "add_time_ids": (original_size, crops_coords_top_left, target_size) as (h, w, top, left, h, w),
// repeated for the batch. [B, 6] float32.
struct SizeHW {
    int64_t height;
    int64_t width;
};
at::Tensor sdxl_time_ids(SizeHW original_size, std::array<int64_t, 2> crops_coords_top_left,
                         SizeHW target_size, int64_t batch_size);

}  // namespace dtune::diffusion
