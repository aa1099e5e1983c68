// Attention, feed-forward and transformer blocks (diffusers' attention.py / transformer_2d.py).
#include "models/common/attention.h"

#include <torch/autograd.h>
#include <torch/nn/modules/dropout.h>

#include <algorithm>
#include <cmath>

#include "models/common/blocks.h"
#include "models/common/checkpoint.h"
#include "models/common/geglu.h"
#include "models/common/group_norm_act.h"
#include "models/common/layer_norm.h"

namespace dtune::models {

std::string sdpa_backend_name(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    switch (at::_fused_sdp_choice(q, k, v)) {
        case 0: return "math";
        case 1: return "flash_attention";
        case 2: return "efficient_attention";
        case 3: return "cudnn_attention";
        case 4: return "overrideable";
        default: return "error";
    }
}

at::Tensor attention_float_scores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  int64_t max_score_elements) {
    const int64_t b = q.size(0), h = q.size(1), n = q.size(2), d = q.size(3), m = k.size(2), bh = b * h;
    const at::Tensor q3 = q.reshape({bh, n, d}), kt = k.reshape({bh, m, d}).transpose(1, 2);  // [BH, d, M]
    const at::Tensor v3 = v.reshape({bh, m, d});
    at::Tensor out = at::empty({bh, n, d}, q.options());
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    const bool low_precision = q.scalar_type() != at::kFloat;
    // Whole rows for several (batch, head) pairs at a time, or row blocks of one pair: each chunk's
    // output is then a contiguous slice of `out`.
    const int64_t rows = std::clamp<int64_t>(max_score_elements / std::max<int64_t>(m, 1), 1, n);
    const int64_t pairs =
        rows == n ? std::max<int64_t>(1, max_score_elements / std::max<int64_t>(n * m, 1)) : 1;
    for (int64_t i = 0; i < bh; i += pairs) {
        const int64_t np = std::min(pairs, bh - i);
        const at::Tensor kc = kt.narrow(0, i, np), vc = v3.narrow(0, i, np);
        for (int64_t r = 0; r < n; r += rows) {
            const int64_t nr = std::min(rows, n - r);
            const at::Tensor qc = q3.narrow(0, i, np).narrow(1, r, nr);
            at::Tensor s = at::empty({np, nr, m}, q.options().dtype(at::kFloat));
            if (low_precision)
                at::baddbmm_out(s, s, qc, kc, at::kFloat, /*beta=*/0, /*alpha=*/scale);
            else
                at::baddbmm_out(s, s, qc, kc, /*beta=*/0, /*alpha=*/scale);
            at::Tensor p = at::_softmax(s, -1, /*half_to_float=*/false);
            s.reset();
            if (low_precision) p = p.to(q.scalar_type());
            at::Tensor dst = out.narrow(0, i, np).narrow(1, r, nr);
            at::bmm_out(dst, p, vc);
        }
    }
    return out.view({b, h, n, d});
}

AttentionImpl::AttentionImpl(const AttentionOptions& o) : options_(o) {
    const int64_t inner = o.heads * o.head_dim;
    const int64_t kv_dim = o.cross_attention_dim > 0 ? o.cross_attention_dim : o.query_dim;
    if (o.norm_groups > 0)
        group_norm_ = register_module(
            "group_norm",
            torch::nn::GroupNorm(torch::nn::GroupNormOptions(o.norm_groups, o.query_dim).eps(o.norm_eps)));
    to_q_ = register_module("to_q",
                            AdaptableLinear(torch::nn::LinearOptions(o.query_dim, inner).bias(o.qkv_bias)));
    to_k_ =
        register_module("to_k", AdaptableLinear(torch::nn::LinearOptions(kv_dim, inner).bias(o.qkv_bias)));
    to_v_ =
        register_module("to_v", AdaptableLinear(torch::nn::LinearOptions(kv_dim, inner).bias(o.qkv_bias)));
    out_proj_ = AdaptableLinear(inner, o.query_dim);
    to_out_ = register_module("to_out", torch::nn::ModuleList(out_proj_, torch::nn::Dropout(0.0)));
    qkv_ = {to_q_.get(), to_k_.get(), to_v_.get()};
    kv_ = {to_k_.get(), to_v_.get()};
}

std::vector<ProjectionGroup> AttentionImpl::projection_groups() {
    return {options_.cross_attention_dim > 0 ? kv_ : qkv_};
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& context) {
    const at::Tensor& kv = context.defined() ? context : x;
    const int64_t b = x.size(0), heads = options_.heads, d = options_.head_dim;
    auto split = [&](const at::Tensor& t) {
        return t.view({b, -1, heads, d}).transpose(1, 2);
    };  // [B, h, N, d]
    at::Tensor q, k, v;
    if (context.defined()) {
        q = split(to_q_->forward(x));
        const auto kv_out = project_group(kv, kv_);
        k = split(kv_out[0]), v = split(kv_out[1]);
    } else {
        const auto qkv_out = project_group(x, qkv_);
        q = split(qkv_out[0]), k = split(qkv_out[1]), v = split(qkv_out[2]);
    }
    const auto dtype = q.scalar_type();
    const bool upcast = options_.upcast && (dtype == at::kHalf || dtype == at::kBFloat16);
    if (upcast) {
        q = q.to(at::kFloat), k = k.to(at::kFloat), v = v.to(at::kFloat);
    }
    const bool wide_inference =
        d > 256 && q.is_cuda() && !at::GradMode::is_enabled() && fused_inference_enabled();
    at::Tensor o = wide_inference ? attention_float_scores(q, k, v)
                                  : at::scaled_dot_product_attention(q, k, v);  // [B, h, N, d]
    if (upcast) o = o.to(dtype);
    o = o.transpose(1, 2).reshape({b, -1, heads * d});  // [B, N, h*d]
    return out_proj_->forward(o);
}

at::Tensor AttentionImpl::forward_spatial(const at::Tensor& x) {
    const int64_t b = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
    at::Tensor t = x;
    if (group_norm_)
        t = fused_inference_ready(x) ? group_norm_act(*group_norm_, x, {}, /*silu=*/false)
                                     : group_norm_->forward(x);
    t = t.view({b, c, h * w}).transpose(1, 2);             // [B, HW, C]
    t = forward(t).transpose(1, 2).reshape({b, c, h, w});  // [B, C, H, W]
    return t + x;
}

GEGLUImpl::GEGLUImpl(int64_t dim_in, int64_t dim_out) {
    proj_ = register_module("proj", AdaptableLinear(dim_in, dim_out * 2));
}

at::Tensor GEGLUImpl::forward(const at::Tensor& x) {
    return geglu(proj_->forward(x));
}

FeedForwardImpl::FeedForwardImpl(int64_t dim) {
    geglu_ = GEGLU(dim, dim * 4);
    out_ = AdaptableLinear(dim * 4, dim);
    register_module("net", torch::nn::ModuleList(geglu_, torch::nn::Dropout(0.0), out_));
}

at::Tensor FeedForwardImpl::forward(const at::Tensor& x) {
    return out_->forward(geglu_->forward(x));
}

BasicTransformerBlockImpl::BasicTransformerBlockImpl(const TransformerBlockOptions& o) : options_(o) {
    auto layer_norm = [&] { return torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim}).eps(1e-5)); };
    AttentionOptions a;
    a.query_dim = o.dim;
    a.heads = o.heads;
    a.head_dim = o.head_dim;
    a.upcast = o.upcast_attention;
    norm1_ = register_module("norm1", layer_norm());
    a.cross_attention_dim = o.only_cross_attention ? o.cross_attention_dim : 0;
    attn1_ = register_module("attn1", Attention(a));
    norm2_ = register_module("norm2", layer_norm());
    a.cross_attention_dim = o.cross_attention_dim;
    attn2_ = register_module("attn2", Attention(a));
    norm3_ = register_module("norm3", layer_norm());
    ff_ = register_module("ff", FeedForward(o.dim));
}

at::Tensor BasicTransformerBlockImpl::forward(const at::Tensor& x, const at::Tensor& context) {
    // Each residual add and the norm after it are one function (layer_norm.h: one pass forward, and
    // in backward the residual's gradient joins the norm's input gradient in the same pass).
    const at::Tensor a1 =
        attn1_->forward(layer_norm(*norm1_, x), options_.only_cross_attention ? context : at::Tensor());
    const auto [h1, n2] = add_layer_norm(*norm2_, a1, x);
    const auto [h2, n3] = add_layer_norm(*norm3_, attn2_->forward(n2, context), h1);
    return h2 + ff_->forward(n3);
}

void Transformer2DModelImpl::set_gradient_checkpointing(CheckpointSelector& selector) {
    options_.checkpoint_blocks.assign(blocks_.size(), false);
    for (size_t i = 0; i < blocks_.size(); ++i) options_.checkpoint_blocks[i] = selector.take();
}

Transformer2DModelImpl::Transformer2DModelImpl(const Transformer2DOptions& o) : options_(o) {
    const int64_t inner = o.heads * o.head_dim;
    norm_ = register_module(
        "norm", torch::nn::GroupNorm(torch::nn::GroupNormOptions(o.norm_groups, o.in_channels).eps(1e-6)));
    if (o.use_linear_projection)
        proj_in_linear_ = register_module("proj_in", AdaptableLinear(o.in_channels, inner));
    else
        proj_in_conv_ =
            register_module("proj_in", AdaptableConv2d(torch::nn::Conv2dOptions(o.in_channels, inner, 1)));
    auto list = register_module("transformer_blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < o.num_layers; ++i) {
        blocks_.push_back(BasicTransformerBlock(TransformerBlockOptions{
            inner, o.heads, o.head_dim, o.cross_attention_dim, o.only_cross_attention, o.upcast_attention}));
        list->push_back(blocks_.back());
    }
    if (o.use_linear_projection)
        proj_out_linear_ = register_module("proj_out", AdaptableLinear(inner, o.in_channels));
    else
        proj_out_conv_ =
            register_module("proj_out", AdaptableConv2d(torch::nn::Conv2dOptions(inner, o.in_channels, 1)));
}

at::Tensor Transformer2DModelImpl::forward(const at::Tensor& x, const at::Tensor& context) {
    const int64_t b = x.size(0), h = x.size(2), w = x.size(3);
    at::Tensor t = norm_forward(*norm_, x);
    if (proj_in_conv_) t = proj_in_conv_->forward(t);
    const int64_t inner = t.size(1);
    t = t.permute({0, 2, 3, 1}).reshape({b, h * w, inner});  // [B, HW, C]
    if (proj_in_linear_) t = proj_in_linear_->forward(t);
    const bool grad = at::GradMode::is_enabled();
    for (size_t i = 0; i < blocks_.size(); ++i) {
        auto& block = blocks_[i];
        const bool checkpoint = grad && !options_.checkpoint_blocks.empty() && options_.checkpoint_blocks[i];
        if (checkpoint) {
            auto fn = [impl = block.ptr()](const std::vector<at::Tensor>& in) {
                return run_unit(*impl, [&] { return impl->forward(in[0], in[1]); });
            };
            t = checkpointed(fn, {t, context}, parameter_list(*block));
        } else {
            t = run_unit(*block, [&] { return block->forward(t, context); });
        }
    }
    if (proj_out_linear_) t = proj_out_linear_->forward(t);
    const int64_t out_c = t.size(2);
    // [B, C, H, W] in x's layout: a view when x is channels-last, a copy to NCHW otherwise
    t = t.reshape({b, h, w, out_c}).permute({0, 3, 1, 2}).contiguous(x.suggest_memory_format());
    if (proj_out_conv_) t = proj_out_conv_->forward(t);
    return t + x;
}

}  // namespace dtune::models
