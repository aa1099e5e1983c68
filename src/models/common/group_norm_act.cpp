// Fused inference GroupNorm(+bias)(+SiLU) and bias + residual add (see group_norm_act.h).
#include "models/common/group_norm_act.h"

#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>

#include <atomic>
#include <cstdint>

#include "core/fused_env.h"
#include "models/common/blocks.h"

#ifdef DTUNE_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>

#include "models/common/cuda_launch.h"
#include "models/cuda/group_norm_kernels.h"
#endif

namespace dtune::models {
namespace {

std::atomic<bool> g_fused{true};

at::Tensor channel_view(const at::Tensor& bias, const at::Tensor& x) {  // [C] or [N, C] -> broadcastable
    return bias.dim() == 1 ? bias.view({1, -1, 1, 1}) : bias.view({x.size(0), -1, 1, 1});
}

#ifdef DTUNE_WITH_CUDA_KERNELS
at::Tensor float_or_undefined(const at::Tensor& t) {
    return t.defined() ? t.to(at::kFloat).contiguous() : t;
}
#endif

}  // namespace

void set_fused_inference(bool enabled) {
    g_fused = enabled;
}
bool fused_inference_enabled() {
    return g_fused && fused_kernels_allowed();
}

bool fused_inference_kernels_built() {
#ifdef DTUNE_WITH_CUDA_KERNELS
    return true;
#else
    return false;
#endif
}

bool fused_inference_ready(const at::Tensor& x) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    const auto t = x.scalar_type();
    return fused_inference_enabled() && !at::GradMode::is_enabled() && x.is_cuda() && x.dim() == 4 &&
           (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf) &&
           x.is_contiguous(at::MemoryFormat::ChannelsLast) && !at::autocast::is_autocast_enabled(at::kCUDA) &&
           reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 == 0;
#else
    (void)x;
    return false;
#endif
}

at::Tensor group_norm_act(torch::nn::GroupNormImpl& norm, const at::Tensor& x, const at::Tensor& in_bias,
                          bool silu) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    const int64_t groups = norm.options.num_groups();
    if (fused_inference_ready(x) && x.numel() > 0 &&
        cuda::group_norm_nhwc_supported(x.size(1), groups, kernel_dtype(x.scalar_type(), "group_norm_act"))) {
        const c10::cuda::CUDAGuard guard(x.device());
        const int64_t n = x.size(0), c = x.size(1), hw = x.size(2) * x.size(3);
        const int sm_count = cuda::current_device_sm_count();
        const at::Tensor weight = float_or_undefined(norm.weight), bias = float_or_undefined(norm.bias);
        const at::Tensor add = float_or_undefined(in_bias);
        at::Tensor out = at::empty_like(x, at::MemoryFormat::ChannelsLast);
        at::Tensor workspace = at::empty({cuda::group_norm_nhwc_workspace_floats(n, hw, c, sm_count)},
                                         x.options().dtype(at::kFloat));
        cuda::GroupNormNhwcArgs a;
        a.x = x.const_data_ptr();
        a.out = out.mutable_data_ptr();
        a.in_bias = add.defined() ? add.const_data_ptr<float>() : nullptr;
        a.in_bias_per_sample = add.defined() && add.dim() == 2;
        a.weight = weight.defined() ? weight.const_data_ptr<float>() : nullptr;
        a.bias = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
        a.n = n, a.hw = hw, a.c = c, a.groups = groups;
        a.eps = norm.options.eps();
        a.silu = silu;
        a.dtype = kernel_dtype(x.scalar_type(), "group_norm_act");
        a.workspace = workspace.mutable_data_ptr<float>();
        a.sm_count = sm_count;
        check_launch(cuda::group_norm_nhwc(a, current_stream_of(x)), "group_norm_act", "GroupNorm");
        return out;
    }
#endif
    const at::Tensor in = in_bias.defined() ? x + channel_view(in_bias, x).to(x.scalar_type()) : x;
    at::Tensor y = norm_forward(norm, in);
    return silu ? at::silu(y) : y;
}

at::Tensor add_bias_residual(at::Tensor h, const at::Tensor& bias, const at::Tensor& residual, double scale) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    if (fused_inference_ready(h) && h.numel() > 0 &&
        (!residual.defined() || (residual.scalar_type() == h.scalar_type() && residual.sizes() == h.sizes() &&
                                 residual.is_contiguous(at::MemoryFormat::ChannelsLast)))) {
        const c10::cuda::CUDAGuard guard(h.device());
        const at::Tensor b = float_or_undefined(bias);
        check_launch(cuda::add_bias_residual_nhwc(
                         h.const_data_ptr(), b.defined() ? b.const_data_ptr<float>() : nullptr,
                         residual.defined() ? residual.const_data_ptr() : nullptr, h.mutable_data_ptr(),
                         h.numel() / h.size(1), h.size(1), static_cast<float>(scale),
                         kernel_dtype(h.scalar_type(), "add_bias_residual"), current_stream_of(h)),
                     "add_bias_residual", "add");
        return h;
    }
#endif
    at::Tensor out = bias.defined() ? h + channel_view(bias, h).to(h.scalar_type()) : h;
    if (residual.defined()) out = residual + out;
    return scale != 1.0 ? out * scale : out;
}

}  // namespace dtune::models
