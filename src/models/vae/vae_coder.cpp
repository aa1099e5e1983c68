// VAE encoder and decoder.
#include "models/vae/vae_coder.h"

#include <torch/nn/modules/container/modulelist.h>

#include "models/common/group_norm_act.h"

namespace dtune::models {
namespace {

constexpr double kEps = 1e-6;  // diffusers hard-codes the VAE's GroupNorm eps

Conv2d conv3(int64_t in, int64_t out) {
    return Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1));
}

ResnetBlock2D resnet(int64_t in, int64_t out, int64_t groups) {
    ResnetBlock2DOptions o;
    o.in_channels = in;
    o.out_channels = out;
    o.groups = groups;
    o.eps = kEps;
    return ResnetBlock2D(o);
}

torch::nn::GroupNorm norm(int64_t groups, int64_t channels) {
    return torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, channels).eps(kEps));
}

}  // namespace

VAEMidBlockImpl::VAEMidBlockImpl(int64_t channels, int64_t groups, bool add_attention) {
    resnet0_ = resnet(channels, channels, groups);
    resnet1_ = resnet(channels, channels, groups);
    register_module("resnets", torch::nn::ModuleList(resnet0_, resnet1_));
    if (add_attention) {
        AttentionOptions a;
        a.query_dim = channels;
        a.heads = 1;  // diffusers: attention_head_dim = channels
        a.head_dim = channels;
        a.qkv_bias = true;
        a.norm_groups = groups;
        a.norm_eps = kEps;
        attention_ = Attention(a);
        register_module("attentions", torch::nn::ModuleList(attention_));
    }
}

at::Tensor VAEMidBlockImpl::forward(const at::Tensor& x) {
    at::Tensor h = resnet0_->forward(x);
    if (attention_) h = attention_->forward_spatial(h);
    return resnet1_->forward(h);
}

VAECoderBlockImpl::VAECoderBlockImpl(int64_t in, int64_t out, int64_t layers, int64_t groups, bool down,
                                     bool resample) {
    auto list = register_module("resnets", torch::nn::ModuleList());
    for (int64_t i = 0; i < layers; ++i) {
        resnets_.push_back(resnet(i == 0 ? in : out, out, groups));
        list->push_back(resnets_.back());
    }
    if (resample && down) {
        downsampler_ = Downsample2D(out, /*padding=*/0);
        register_module("downsamplers", torch::nn::ModuleList(downsampler_));
    } else if (resample) {
        upsampler_ = Upsample2D(out);
        register_module("upsamplers", torch::nn::ModuleList(upsampler_));
    }
}

at::Tensor VAECoderBlockImpl::forward(at::Tensor x) {
    for (auto& r : resnets_) x = r->forward(x);
    if (downsampler_) x = downsampler_->forward(x);
    if (upsampler_) x = upsampler_->forward(x);
    return x;
}

VAEEncoderImpl::VAEEncoderImpl(const VAECoderOptions& o) {
    const auto& boc = o.block_out_channels;
    conv_in_ = register_module("conv_in", conv3(o.in_channels, boc[0]));
    auto list = register_module("down_blocks", torch::nn::ModuleList());
    int64_t output = boc[0];
    for (std::size_t i = 0; i < boc.size(); ++i) {
        const int64_t input = output;
        output = boc[i];
        blocks_.push_back(VAECoderBlock(input, output, o.layers_per_block, o.norm_num_groups, /*down=*/true,
                                        /*resample=*/i + 1 < boc.size()));
        list->push_back(blocks_.back());
    }
    mid_block_ =
        register_module("mid_block", VAEMidBlock(boc.back(), o.norm_num_groups, o.mid_block_add_attention));
    conv_norm_out_ = register_module("conv_norm_out", norm(o.norm_num_groups, boc.back()));
    conv_out_ = register_module("conv_out", conv3(boc.back(), o.out_channels));
}

at::Tensor VAEEncoderImpl::forward(const at::Tensor& x) {
    at::Tensor h = conv_in_->forward(x);
    for (auto& b : blocks_) h = b->forward(h);
    h = mid_block_->forward(h);
    if (fused_inference_ready(h))
        return conv_out_->forward(group_norm_act(*conv_norm_out_, h, {}, /*silu=*/true));
    return conv_out_->forward(at::silu(conv_norm_out_->forward(h)));
}

VAEDecoderImpl::VAEDecoderImpl(const VAECoderOptions& o) {
    const auto& boc = o.block_out_channels;
    const std::size_t n = boc.size();
    conv_in_ = register_module("conv_in", conv3(o.in_channels, boc.back()));
    mid_block_ =
        register_module("mid_block", VAEMidBlock(boc.back(), o.norm_num_groups, o.mid_block_add_attention));
    auto list = register_module("up_blocks", torch::nn::ModuleList());
    int64_t output = boc.back();
    for (std::size_t i = 0; i < n; ++i) {
        const int64_t prev = output;
        output = boc[n - 1 - i];
        blocks_.push_back(VAECoderBlock(prev, output, o.layers_per_block + 1, o.norm_num_groups,
                                        /*down=*/false,
                                        /*resample=*/i + 1 < n));
        list->push_back(blocks_.back());
    }
    conv_norm_out_ = register_module("conv_norm_out", norm(o.norm_num_groups, boc[0]));
    conv_out_ = register_module("conv_out", conv3(boc[0], o.out_channels));
}

at::Tensor VAEDecoderImpl::forward(const at::Tensor& z) {
    at::Tensor h = conv_in_->forward(z);
    h = mid_block_->forward(h);
    for (auto& b : blocks_) h = b->forward(h);
    if (fused_inference_ready(h))
        return conv_out_->forward(group_norm_act(*conv_norm_out_, h, {}, /*silu=*/true));
    return conv_out_->forward(at::silu(conv_norm_out_->forward(h)));
}

}  // namespace dtune::models
