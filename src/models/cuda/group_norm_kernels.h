// Launchers of the fused channels-last GroupNorm kernels (cuda/group_norm_kernels.cu), for inference
// (no backward): y = act(GroupNorm(x + in_bias)) over x stored NHWC as [n, hw, c], and the
// bias + residual add that closes a ResNet block. Plain pointers, the dtype as a code and the stream
// as an opaque cudaStream_t, so code built without nvcc can call them. Built only when CMake found
// nvcc (DTUNE_WITH_CUDA_KERNELS).
#pragma once

#include <cstdint>

#include "models/cuda/kernel_dtype.h"

namespace dtune::models::cuda {

struct GroupNormNhwcArgs {
    const void* x = nullptr;  // [n, hw, c], `dtype`
    void* out = nullptr;      // [n, hw, c], `dtype`
    // float32, or null: added to x before normalising, per channel ([c]) or per sample and channel
    // ([n, c], in_bias_per_sample)
    const float* in_bias = nullptr;
    bool in_bias_per_sample = false;
    const float* weight = nullptr;  // float32 [c] or null (1)
    const float* bias = nullptr;    // float32 [c] or null (0)
    int64_t n = 0, hw = 0, c = 0, groups = 0;
    double eps = 1e-6;
    bool silu = false;  // y = silu(normalised)
    KernelDtype dtype = KernelDtype::kFloat;
    float* workspace = nullptr;  // group_norm_nhwc_workspace_floats(n, hw, c, sm_count) floats
    int sm_count = 1;            // the device's multiprocessors (sizes the statistics grid)
};

// False when the kernels do not handle this shape (c not a multiple of `groups`, or more channels
// than one block covers): the caller then uses the composite ops. Past 256 channels the kernels also
// need x and out 16-byte aligned (fresh allocations are).
bool group_norm_nhwc_supported(int64_t c, int64_t groups, KernelDtype dtype);
// The current device's multiprocessor count (GroupNormNhwcArgs::sm_count).
int current_device_sm_count();
int64_t group_norm_nhwc_workspace_floats(int64_t n, int64_t hw, int64_t c, int sm_count);
// Three launches on `stream`: per-block channel sums, per-(sample, channel) scale and shift, and
// the normalising pass. Returns the launches' cudaError_t as an int (0 = success).
int group_norm_nhwc(const GroupNormNhwcArgs& args, void* stream);

// out = (h + bias[channel] + residual) * scale over [rows, c] (NHWC rows); bias (float32 [c]) and
// residual (`dtype`, like h) may be null. Arithmetic in float, one rounding. out may alias h.
int add_bias_residual_nhwc(const void* h, const float* bias, const void* residual, void* out, int64_t rows,
                           int64_t c, float scale, KernelDtype dtype, void* stream);

}  // namespace dtune::models::cuda
