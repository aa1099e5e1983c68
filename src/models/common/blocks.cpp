// Convolutional building blocks: time embedding, ResNet block, down/up sampling.
#include "models/common/blocks.h"

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/nn/functional.h>

#include <atomic>
#include <cmath>

#include "models/common/group_norm_act.h"

namespace dtune::models {

namespace F = torch::nn::functional;

at::Tensor timestep_embedding(const at::Tensor& timesteps, int64_t dim, bool flip_sin_to_cos,
                              double freq_shift) {
    const int64_t half = dim / 2;
    auto opts = at::TensorOptions().dtype(at::kFloat).device(timesteps.device());
    at::Tensor exponent =
        -std::log(10000.0) * at::arange(0, half, opts) / (static_cast<double>(half) - freq_shift);
    at::Tensor args = timesteps.to(at::kFloat).unsqueeze(1) * exponent.exp().unsqueeze(0);  // [N, half]
    at::Tensor emb =
        flip_sin_to_cos ? at::cat({args.cos(), args.sin()}, -1) : at::cat({args.sin(), args.cos()}, -1);
    if (dim % 2 == 1) emb = at::constant_pad_nd(emb, {0, 1});
    return emb;  // [N, dim]
}

TimestepEmbeddingImpl::TimestepEmbeddingImpl(int64_t in_channels, int64_t time_embed_dim) {
    linear_1_ = register_module("linear_1", AdaptableLinear(in_channels, time_embed_dim));
    linear_2_ = register_module("linear_2", AdaptableLinear(time_embed_dim, time_embed_dim));
}

namespace {

bool keep_low_precision(const at::Tensor& x) {
    const auto t = x.scalar_type();
    return (t == at::kBFloat16 || t == at::kHalf) && at::autocast::is_autocast_enabled(x.device().type());
}

at::Tensor cast_to(const at::Tensor& w, const at::Tensor& x) {
    return w.defined() ? w.to(x.scalar_type()) : w;
}

}  // namespace

at::Tensor norm_forward(torch::nn::LayerNormImpl& norm, const at::Tensor& x) {
    if (!keep_low_precision(x)) return norm.forward(x);
    const at::Tensor w = cast_to(norm.weight, x), b = cast_to(norm.bias, x);
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    return at::layer_norm(x, norm.options.normalized_shape(), w, b, norm.options.eps());
}

namespace {
std::atomic<bool> g_group_norm_nhwc{false};
}  // namespace

void set_group_norm_nhwc(bool enabled) {
    g_group_norm_nhwc = enabled;
}
bool group_norm_nhwc_enabled() {
    return g_group_norm_nhwc;
}

at::Tensor group_norm_nhwc(const at::Tensor& x, int64_t groups, const at::Tensor& weight,
                           const at::Tensor& bias, double eps) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const int64_t n = x.size(0), c = x.size(1), hw = x.size(2) * x.size(3), cg = c / groups;
    const at::Tensor v = x.permute({0, 2, 3, 1}).view({n, hw, groups, cg});     // [N, HW, G, Cg], NHWC memory
    const at::Tensor mean = at::mean(v, {1, 3}, /*keepdim=*/true, at::kFloat);  // [N, 1, G, 1]
    // Out-of-place on these tiny [N, 1, G, 1] tensors, so the whole function stays differentiable.
    const at::Tensor mean_sq =
        at::linalg_vector_norm(v, 2, at::IntArrayRef{1, 3}, true, at::kFloat).square() /
        static_cast<double>(hw * cg);  // E[x²], [N, 1, G, 1]
    const at::Tensor rstd = (mean_sq - mean * mean).clamp_min(0).add(eps).rsqrt();
    at::Tensor scale = weight.defined() ? rstd * weight.to(at::kFloat).view({1, 1, groups, cg})
                                        : rstd.expand({n, 1, groups, cg}).contiguous();  // [N, 1, G, Cg]
    at::Tensor shift = -mean * scale;
    if (bias.defined()) shift = shift + bias.to(at::kFloat).view({1, 1, groups, cg});
    if (at::GradMode::is_enabled() && (x.requires_grad() || (weight.defined() && weight.requires_grad()) ||
                                       (bias.defined() && bias.requires_grad()))) {
        // Differentiable (out= is not): float32 result, then x's dtype; NHWC memory either way.
        const at::Tensor y = at::addcmul(shift, v, scale).to(x.scalar_type());  // [N, HW, G, Cg]
        return y.view({n, x.size(2), x.size(3), c}).permute({0, 3, 1, 2});
    }
    at::Tensor out = at::empty_like(x, at::MemoryFormat::ChannelsLast);  // [N, C, H, W]
    at::Tensor out_view = out.permute({0, 2, 3, 1}).view({n, hw, groups, cg});
    at::addcmul_out(out_view, shift, v, scale);  // computed in float32, rounded once to x's dtype
    return out;
}

at::Tensor norm_forward(torch::nn::GroupNormImpl& norm, const at::Tensor& x) {
    if (fused_group_norm_training_ready(norm, x)) return group_norm_act(norm, x, {}, /*silu=*/false);
    if (g_group_norm_nhwc && x.dim() == 4 && !x.is_contiguous() &&
        x.is_contiguous(at::MemoryFormat::ChannelsLast))
        return group_norm_nhwc(x, norm.options.num_groups(), norm.weight, norm.bias, norm.options.eps());
    if (!keep_low_precision(x)) return norm.forward(x);
    const at::Tensor w = cast_to(norm.weight, x), b = cast_to(norm.bias, x);
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    return at::group_norm(x, norm.options.num_groups(), w, b, norm.options.eps());
}

at::Tensor TimestepEmbeddingImpl::forward(const at::Tensor& x) {
    return linear_2_->forward(at::silu(linear_1_->forward(x)));
}

namespace {

torch::nn::GroupNorm group_norm(int64_t groups, int64_t channels, double eps) {
    return torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, channels).eps(eps));
}

AdaptableConv2d conv(int64_t in, int64_t out, int64_t kernel, int64_t stride = 1, int64_t padding = -1) {
    if (padding < 0) padding = kernel / 2;
    return AdaptableConv2d(torch::nn::Conv2dOptions(in, out, kernel).stride(stride).padding(padding));
}

}  // namespace

ResnetBlock2DImpl::ResnetBlock2DImpl(const ResnetBlock2DOptions& o) : options_(o) {
    norm1_ = register_module("norm1", group_norm(o.groups, o.in_channels, o.eps));
    conv1_ = register_module("conv1", conv(o.in_channels, o.out_channels, 3));
    if (o.temb_channels > 0)
        time_emb_proj_ = register_module("time_emb_proj", AdaptableLinear(o.temb_channels, o.out_channels));
    norm2_ = register_module("norm2", group_norm(o.groups, o.out_channels, o.eps));
    conv2_ = register_module("conv2", conv(o.out_channels, o.out_channels, 3));
    if (o.in_channels != o.out_channels)
        conv_shortcut_ = register_module("conv_shortcut", conv(o.in_channels, o.out_channels, 1));
}

bool ResnetBlock2DImpl::can_fuse(const at::Tensor& x) const {
    // The differentiable kernels, with or without gradients recorded (a checkpointed block's first
    // pass and its recompute take the same path).
    const bool training = fused_resnet_training_enabled() && fused_group_norm_training_ready(*norm1_, x);
    return (fused_inference_ready(x) || training) && !conv1_->adapter() && !conv2_->adapter() &&
           !(conv_shortcut_ && conv_shortcut_->adapter()) && x.scalar_type() == conv1_->dtype();
}

at::Tensor ResnetBlock2DImpl::forward_fused(const at::Tensor& x, const at::Tensor& temb) {
    at::Tensor h = conv1_->forward_without_bias(group_norm_act(*norm1_, x, {}, /*silu=*/true));
    at::Tensor in_bias = conv1_->bias;  // [C]
    if (time_emb_proj_ && temb.defined()) {
        const at::Tensor t = time_emb_proj_->forward(at::silu(temb)).to(at::kFloat);  // [B, C]
        in_bias = in_bias.defined() ? t + in_bias.to(at::kFloat) : t;
    }
    h = conv2_->forward_without_bias(group_norm_act(*norm2_, h, in_bias, /*silu=*/true));
    at::Tensor out_bias = conv2_->bias;
    at::Tensor shortcut = x;
    if (conv_shortcut_) {
        shortcut = conv_shortcut_->forward_without_bias(x);
        if (conv_shortcut_->bias.defined())
            out_bias = out_bias.defined() ? out_bias.to(at::kFloat) + conv_shortcut_->bias.to(at::kFloat)
                                          : conv_shortcut_->bias;
    }
    return add_bias_residual(h, out_bias, shortcut, 1.0 / options_.output_scale_factor);
}

at::Tensor ResnetBlock2DImpl::forward(const at::Tensor& x, const at::Tensor& temb) {
    if (can_fuse(x)) return forward_fused(x, temb);
    at::Tensor h = conv1_->forward(group_norm_act(*norm1_, x, {}, /*silu=*/true));
    if (time_emb_proj_ && temb.defined()) {
        h = h + time_emb_proj_->forward(at::silu(temb)).unsqueeze(-1).unsqueeze(-1);  // [B, C, 1, 1]
    }
    h = conv2_->forward(group_norm_act(*norm2_, h, {}, /*silu=*/true));
    at::Tensor shortcut = conv_shortcut_ ? conv_shortcut_->forward(x) : x;
    at::Tensor out = shortcut + h;
    if (options_.output_scale_factor != 1.0) out = out / options_.output_scale_factor;
    return out;
}

Downsample2DImpl::Downsample2DImpl(int64_t channels, int64_t padding) : padding_(padding) {
    conv_ = register_module("conv", conv(channels, channels, 3, 2, padding));
}

at::Tensor Downsample2DImpl::forward(const at::Tensor& x) {
    if (padding_ == 0) return conv_->forward(at::constant_pad_nd(x, {0, 1, 0, 1}, 0));
    return conv_->forward(x);
}

Upsample2DImpl::Upsample2DImpl(int64_t channels) {
    conv_ = register_module("conv", conv(channels, channels, 3));
}

at::Tensor Upsample2DImpl::forward(const at::Tensor& x, std::optional<std::vector<int64_t>> size) {
    std::vector<int64_t> out_size = size ? *size : std::vector<int64_t>{x.size(2) * 2, x.size(3) * 2};
    at::Tensor up = at::upsample_nearest2d(x, out_size);  // [B, C, 2H, 2W] or [B, C, size]
    return conv_->forward(up);
}

std::vector<at::Tensor> parameter_list(const torch::nn::Module& module) {
    return module.parameters(true);
}

}  // namespace dtune::models
