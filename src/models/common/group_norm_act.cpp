// Fused inference GroupNorm(+bias)(+SiLU) and bias + residual add (see group_norm_act.h).
#include "models/common/group_norm_act.h"

#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>

#include "core/error.h"
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
// set_fused_resnet_training: 0 off, 1 on, -1: DTUNE_FUSED_RESNET_TRAINING decides (read once).
std::atomic<int> g_resnet_training{-1};

bool resnet_training_env() {
    static const bool on = [] {
        const char* v = std::getenv("DTUNE_FUSED_RESNET_TRAINING");
        if (!v || *v == '\0') return true;
        const auto parsed = parse_fused_kernels_value(v);
        DTUNE_CHECK_AS(UsageError, parsed.has_value(), "DTUNE_FUSED_RESNET_TRAINING='", v,
                       "' is not understood; use 1 (on/true, the default) or 0 (off/false: broadcast adds "
                       "of the convolutions' biases)");
        return *parsed;
    }();
    return on;
}

at::Tensor channel_view(const at::Tensor& bias, const at::Tensor& x) {  // [C] or [N, C] -> broadcastable
    return bias.dim() == 1 ? bias.view({1, -1, 1, 1}) : bias.view({x.size(0), -1, 1, 1});
}

#ifdef DTUNE_WITH_CUDA_KERNELS
at::Tensor float_or_undefined(const at::Tensor& t) {
    return t.defined() ? t.to(at::kFloat).contiguous() : t;
}

// An optional float32 input of the autograd functions below, always defined: autograd (torch 2.11)
// cannot record an undefined tensor input, so "none" is an empty tensor.
at::Tensor float_or_empty(const at::Tensor& t, const at::Tensor& like) {
    return t.defined() ? t.to(at::kFloat).contiguous() : at::empty({0}, like.options().dtype(at::kFloat));
}

bool present(const at::Tensor& t) {
    return t.defined() && t.numel() > 0;
}

const float* float_ptr(const at::Tensor& t) {
    return present(t) ? t.const_data_ptr<float>() : nullptr;
}

// A non-empty 4-D channels-last CUDA tensor the kernels read (float32, bf16 or fp16, 16-byte aligned).
bool nhwc_cuda(const at::Tensor& t) {
    const auto d = t.scalar_type();
    return t.is_cuda() && t.dim() == 4 && t.numel() > 0 &&
           (d == at::kFloat || d == at::kBFloat16 || d == at::kHalf) &&
           t.is_contiguous(at::MemoryFormat::ChannelsLast) &&
           reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

// act(GroupNorm(x + in_bias)) on channels-last CUDA x, differentiable in x, weight and bias (all
// defined) and in_bias (empty, or float32 [C] or [N, C], contiguous). Saves x, the affine
// weights, in_bias and each group's float32 mean and 1/std (no output).
struct GroupNormActFunction : public torch::autograd::Function<GroupNormActFunction> {
    static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                              const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& in_bias,
                              int64_t groups, double eps, bool silu) {
        const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
        const c10::cuda::CUDAGuard guard(x.device());
        const int64_t n = x.size(0), c = x.size(1), hw = x.size(2) * x.size(3);
        const int sm_count = cuda::current_device_sm_count();
        const at::Tensor w = float_or_undefined(weight), b = float_or_undefined(bias);
        at::Tensor out = at::empty_like(x, at::MemoryFormat::ChannelsLast);
        const auto f32 = x.options().dtype(at::kFloat);
        at::Tensor workspace = at::empty({cuda::group_norm_nhwc_workspace_floats(n, hw, c, sm_count)}, f32);
        at::Tensor mean_rstd = at::empty({n, groups, 2}, f32);
        cuda::GroupNormNhwcArgs a;
        a.x = x.const_data_ptr();
        a.out = out.mutable_data_ptr();
        a.in_bias = float_ptr(in_bias);
        a.in_bias_per_sample = present(in_bias) && in_bias.dim() == 2;
        a.weight = float_ptr(w);
        a.bias = float_ptr(b);
        a.n = n, a.hw = hw, a.c = c, a.groups = groups;
        a.eps = eps;
        a.silu = silu;
        a.dtype = kernel_dtype(x.scalar_type(), "group_norm_act");
        a.workspace = workspace.mutable_data_ptr<float>();
        a.sm_count = sm_count;
        a.mean_rstd = mean_rstd.mutable_data_ptr<float>();
        check_launch(cuda::group_norm_nhwc(a, current_stream_of(x)), "group_norm_act", "GroupNorm");
        ctx->save_for_backward({x, weight, bias, mean_rstd, in_bias});
        ctx->saved_data["groups"] = groups;
        ctx->saved_data["silu"] = silu;
        return out;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        const at::Tensor &x = saved[0], &weight = saved[1], &bias = saved[2], &mean_rstd = saved[3];
        const at::Tensor& in_bias = saved[4];
        const c10::cuda::CUDAGuard guard(x.device());
        const int64_t n = x.size(0), c = x.size(1), hw = x.size(2) * x.size(3);
        const int sm_count = cuda::current_device_sm_count();
        const at::Tensor dy = grads[0].to(x.scalar_type()).contiguous(at::MemoryFormat::ChannelsLast);
        const at::Tensor w = float_or_undefined(weight), b = float_or_undefined(bias);
        const bool need_w = ctx->needs_input_grad(1), need_b = ctx->needs_input_grad(2);
        const auto f32 = x.options().dtype(at::kFloat);
        at::Tensor dx = at::empty_like(x, at::MemoryFormat::ChannelsLast);
        at::Tensor dw_nc = need_w ? at::empty({n, c}, f32) : at::Tensor();
        at::Tensor db_nc = need_b ? at::empty({n, c}, f32) : at::Tensor();
        at::Tensor workspace =
            at::empty({cuda::group_norm_nhwc_backward_workspace_floats(n, hw, c, sm_count)}, f32);
        cuda::GroupNormNhwcBackwardArgs a;
        a.dy = dy.const_data_ptr();
        a.x = x.const_data_ptr();
        a.dx = dx.mutable_data_ptr();
        a.mean_rstd = mean_rstd.const_data_ptr<float>();
        a.in_bias = float_ptr(in_bias);
        a.in_bias_per_sample = present(in_bias) && in_bias.dim() == 2;
        a.weight = float_ptr(w);
        a.bias = float_ptr(b);
        a.dweight_nc = need_w ? dw_nc.mutable_data_ptr<float>() : nullptr;
        a.dbias_nc = need_b ? db_nc.mutable_data_ptr<float>() : nullptr;
        a.n = n, a.hw = hw, a.c = c, a.groups = ctx->saved_data["groups"].toInt();
        a.silu = ctx->saved_data["silu"].toBool();
        a.dtype = kernel_dtype(x.scalar_type(), "group_norm_act");
        a.workspace = workspace.mutable_data_ptr<float>();
        a.sm_count = sm_count;
        check_launch(cuda::group_norm_nhwc_backward(a, current_stream_of(x)), "group_norm_act",
                     "GroupNorm backward");
        // x + in_bias's gradient is dx's: summed over the pixels (and the samples for a [C] bias).
        at::Tensor d_in;
        if (ctx->needs_input_grad(3) && present(in_bias))
            d_in =
                in_bias.dim() == 2 ? dx.sum({2, 3}, false, at::kFloat) : dx.sum({0, 2, 3}, false, at::kFloat);
        return {ctx->needs_input_grad(0) ? dx : at::Tensor(),
                need_w ? dw_nc.sum(0).to(weight.scalar_type()) : at::Tensor(),
                need_b ? db_nc.sum(0).to(bias.scalar_type()) : at::Tensor(),
                d_in,
                at::Tensor(),
                at::Tensor(),
                at::Tensor()};
    }
};

// (h + bias + residual) * scale for training on channels-last CUDA tensors: the NHWC kernel into
// a new tensor; backward hands dout * scale to h and residual (the same tensor) and its pixel sums
// to bias (float32 [C]); bias and residual may be empty (none).
struct AddBiasResidualFunction : public torch::autograd::Function<AddBiasResidualFunction> {
    static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h,
                              const at::Tensor& bias, const at::Tensor& residual, double scale) {
        const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
        const c10::cuda::CUDAGuard guard(h.device());
        at::Tensor out = at::empty_like(h, at::MemoryFormat::ChannelsLast);
        check_launch(
            cuda::add_bias_residual_nhwc(
                h.const_data_ptr(), float_ptr(bias), present(residual) ? residual.const_data_ptr() : nullptr,
                out.mutable_data_ptr(), h.numel() / h.size(1), h.size(1), static_cast<float>(scale),
                kernel_dtype(h.scalar_type(), "add_bias_residual"), current_stream_of(h)),
            "add_bias_residual", "add");
        ctx->saved_data["scale"] = scale;
        return out;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const double scale = ctx->saved_data["scale"].toDouble();
        const at::Tensor g = scale == 1.0 ? grads[0] : grads[0] * scale;
        const at::Tensor db = ctx->needs_input_grad(1) ? g.sum({0, 2, 3}, false, at::kFloat) : at::Tensor();
        // (an empty bias or residual takes no gradient: needs_input_grad is false for it)
        return {ctx->needs_input_grad(0) ? g : at::Tensor(), db, ctx->needs_input_grad(2) ? g : at::Tensor(),
                at::Tensor()};
    }
};
#endif

}  // namespace

void set_fused_inference(bool enabled) {
    g_fused = enabled;
}

void set_fused_resnet_training(bool enabled) {
    g_resnet_training = enabled ? 1 : 0;
}

bool fused_resnet_training_enabled() {
    const int chosen = g_resnet_training;
    return fused_kernels_allowed() && (chosen < 0 ? resnet_training_env() : chosen == 1);
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

bool fused_group_norm_training_ready(const torch::nn::GroupNormImpl& norm, const at::Tensor& x) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    return g_fused && fused_kernels_allowed() && nhwc_cuda(x) && norm.weight.defined() &&
           norm.bias.defined() &&
           cuda::group_norm_nhwc_supported(x.size(1), norm.options.num_groups(),
                                           kernel_dtype(x.scalar_type(), "group_norm_act"));
#else
    (void)norm;
    (void)x;
    return false;
#endif
}

at::Tensor group_norm_act(torch::nn::GroupNormImpl& norm, const at::Tensor& x, const at::Tensor& in_bias,
                          bool silu) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    // With an input bias: its shape checked, and only where the ResNet blocks fold their biases in
    // training (fused_resnet_training_enabled).
    const bool bias_ok =
        !in_bias.defined() ||
        (fused_resnet_training_enabled() && in_bias.device() == x.device() && x.dim() == 4 &&
         ((in_bias.dim() == 1 && in_bias.size(0) == x.size(1)) ||
          (in_bias.dim() == 2 && in_bias.size(0) == x.size(0) && in_bias.size(1) == x.size(1))));
    if (bias_ok && !fused_inference_ready(x) && fused_group_norm_training_ready(norm, x))
        return GroupNormActFunction::apply(x, norm.weight, norm.bias, float_or_empty(in_bias, x),
                                           norm.options.num_groups(), norm.options.eps(), silu);
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
    if (fused_resnet_training_enabled() && nhwc_cuda(h) &&
        (!residual.defined() || (nhwc_cuda(residual) && residual.scalar_type() == h.scalar_type() &&
                                 residual.sizes() == h.sizes())) &&
        (!bias.defined() || (bias.dim() == 1 && bias.size(0) == h.size(1) && bias.device() == h.device())))
        return AddBiasResidualFunction::apply(
            h, float_or_empty(bias, h), residual.defined() ? residual : at::empty({0}, h.options()), scale);
#endif
    at::Tensor out = bias.defined() ? h + channel_view(bias, h).to(h.scalar_type()) : h;
    if (residual.defined()) out = residual + out;
    return scale != 1.0 ? out * scale : out;
}

}  // namespace dtune::models
