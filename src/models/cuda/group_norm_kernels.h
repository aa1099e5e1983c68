// Launchers of the fused channels-last GroupNorm kernels (cuda/group_norm_kernels.cu):
// y = act(GroupNorm(x + in_bias)) over x stored NHWC as [n, hw, c], its backward, and the bias +
// residual add that closes a ResNet block. Plain pointers, the dtype as a
// code and the stream as an opaque cudaStream_t, so code built without nvcc can call them. Built only when
// CMake found nvcc (DTUNE_WITH_CUDA_KERNELS).
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
    float* mean_rstd = nullptr;  // null, or [n, groups, 2] float32 out: each group's mean and 1/std
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

// The backward of y = act(GroupNorm(x + in_bias)), from the forward's mean_rstd (the statistics of
// x + in_bias): dx (which is also the gradient of x + in_bias), and per sample and channel the sums
// that make the affine gradients (dweight = sum over n of dweight_nc, dbias likewise). With act =
// SiLU, the normalised value is recomputed from x and in_bias.
struct GroupNormNhwcBackwardArgs {
    const void* dy = nullptr;          // [n, hw, c], `dtype`
    const void* x = nullptr;           // [n, hw, c], `dtype` (the forward's input)
    void* dx = nullptr;                // [n, hw, c], `dtype` out
    const float* mean_rstd = nullptr;  // [n, groups, 2] from the forward
    const float* in_bias = nullptr;    // the forward's (GroupNormNhwcArgs::in_bias), or null
    bool in_bias_per_sample = false;
    const float* weight = nullptr;  // float32 [c] or null (1)
    const float* bias = nullptr;    // float32 [c] or null (0)
    float* dweight_nc = nullptr;    // null, or [n, c] float32 out: sum over pixels of dz * x_hat
    float* dbias_nc = nullptr;      // null, or [n, c] float32 out: sum over pixels of dz
    int64_t n = 0, hw = 0, c = 0, groups = 0;
    bool silu = false;
    KernelDtype dtype = KernelDtype::kFloat;
    float* workspace = nullptr;  // group_norm_nhwc_backward_workspace_floats(n, hw, c, sm_count) floats
    int sm_count = 1;
};
int64_t group_norm_nhwc_backward_workspace_floats(int64_t n, int64_t hw, int64_t c, int sm_count);
// Three launches: per-block channel sums of dz and dz * x_hat, per-(sample, channel) coefficients
// (dx = A dz + B x + C), and the pass that writes dx. 0 = success, else the cudaError_t.
int group_norm_nhwc_backward(const GroupNormNhwcBackwardArgs& args, void* stream);

// out = (h + bias[channel] + residual) * scale over [rows, c] (NHWC rows); bias (float32 [c]) and
// residual (`dtype`, like h) may be null. Arithmetic in float, one rounding. out may alias h.
int add_bias_residual_nhwc(const void* h, const float* bias, const void* residual, void* out, int64_t rows,
                           int64_t c, float scale, KernelDtype dtype, void* stream);

}  // namespace dtune::models::cuda
