// Classifier-free guidance and SDXL time ids (see guidance.h).
#include "diffusion/guidance.h"

#include <vector>

#include "core/error.h"

namespace dtune::diffusion {

at::Tensor rescale_noise_cfg(const at::Tensor& guided, const at::Tensor& cond, double guidance_rescale) {
    std::vector<int64_t> dims;
    for (int64_t d = 1; d < cond.dim(); ++d) dims.push_back(d);
    const at::Tensor std_cond = cond.std(dims, /*unbiased=*/true, /*keepdim=*/true);      // [B, 1, 1, 1]
    const at::Tensor std_guided = guided.std(dims, /*unbiased=*/true, /*keepdim=*/true);  // [B, 1, 1, 1]
    const at::Tensor rescaled = guided * (std_cond / std_guided);
    return guidance_rescale * rescaled + (1 - guidance_rescale) * guided;
}

at::Tensor classifier_free_guidance(const at::Tensor& uncond, const at::Tensor& cond, double guidance_scale,
                                    double guidance_rescale) {
    if (!uses_cfg(guidance_scale)) return cond;
    DTUNE_CHECK(uncond.sizes() == cond.sizes(), "unconditional ", uncond.sizes(), " and conditional ",
                cond.sizes(), " predictions differ in shape");
    const at::Tensor guided = uncond + guidance_scale * (cond - uncond);
    if (guidance_rescale > 0.0) return rescale_noise_cfg(guided, cond, guidance_rescale);
    return guided;
}

at::Tensor sdxl_time_ids(SizeHW original_size, std::array<int64_t, 2> crop, SizeHW target_size,
                         int64_t batch_size) {
    const std::vector<float> ids = {static_cast<float>(original_size.height),
                                    static_cast<float>(original_size.width),
                                    static_cast<float>(crop[0]),
                                    static_cast<float>(crop[1]),
                                    static_cast<float>(target_size.height),
                                    static_cast<float>(target_size.width)};
    return at::tensor(ids, at::kFloat).unsqueeze(0).repeat({batch_size, 1});  // [B, 6]
}

}  // namespace dtune::diffusion
