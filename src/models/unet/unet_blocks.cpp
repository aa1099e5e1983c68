// Down, mid and up blocks of UNet2DConditionModel.
#include "models/unet/unet_blocks.h"

#include <torch/autograd.h>
#include <torch/nn/modules/container/modulelist.h>

#include "models/common/checkpoint.h"
#include "models/common/unit_hooks.h"

namespace dtune::models {

void UNetBlockBase::set_gradient_checkpointing(CheckpointSelector& selector) {
    resnet_checkpointing_.assign(resnets_.size(), false);
    for (size_t i = 0; i < resnets_.size(); ++i) {
        resnet_checkpointing_[i] = selector.take();
        if (i < attentions_.size()) attentions_[i]->set_gradient_checkpointing(selector);
    }
    for (size_t i = resnets_.size(); i < attentions_.size(); ++i)
        attentions_[i]->set_gradient_checkpointing(selector);
}

void UNetBlockBase::build_transformer(const UNetBlockOptions& o, int64_t channels) {
    Transformer2DOptions t;
    t.in_channels = channels;
    t.heads = o.heads;
    t.head_dim = channels / o.heads;
    t.num_layers = o.transformer_layers;
    t.cross_attention_dim = o.cross_attention_dim;
    t.norm_groups = o.groups;
    t.use_linear_projection = o.use_linear_projection;
    t.only_cross_attention = o.only_cross_attention;
    t.upcast_attention = o.upcast_attention;
    attentions_.push_back(Transformer2DModel(t));
    attention_list_->push_back(attentions_.back());
}

at::Tensor UNetBlockBase::run_resnet(std::size_t i, const at::Tensor& x, const at::Tensor& temb) {
    ResnetBlock2D resnet = resnets_[i];
    const bool checkpoint = !resnet_checkpointing_.empty() && resnet_checkpointing_[i];
    if (checkpoint && at::GradMode::is_enabled()) {
        auto fn = [impl = resnet.ptr()](const std::vector<at::Tensor>& in) {
            return run_unit(*impl, [&] { return impl->forward(in[0], in[1]); });
        };
        return checkpointed(fn, {x, temb}, parameter_list(*resnet));
    }
    return run_unit(*resnet, [&] { return resnet->forward(x, temb); });
}

at::Tensor UNetBlockBase::run_attention(std::size_t i, const at::Tensor& x, const at::Tensor& context) {
    return attentions_[i]->forward(x, context);  // checkpointed per transformer block inside
}

namespace {

ResnetBlock2DOptions resnet_options(const UNetBlockOptions& o, int64_t in, int64_t out) {
    ResnetBlock2DOptions r;
    r.in_channels = in;
    r.out_channels = out;
    r.temb_channels = o.temb_channels;
    r.groups = o.groups;
    r.eps = o.eps;
    r.output_scale_factor = o.output_scale_factor;
    return r;
}

}  // namespace

DownBlockImpl::DownBlockImpl(const UNetBlockOptions& o) {
    resnet_list_ = register_module("resnets", torch::nn::ModuleList());
    if (o.cross_attention) attention_list_ = register_module("attentions", torch::nn::ModuleList());
    for (int64_t i = 0; i < o.num_layers; ++i) {
        resnets_.push_back(
            ResnetBlock2D(resnet_options(o, i == 0 ? o.in_channels : o.out_channels, o.out_channels)));
        resnet_list_->push_back(resnets_.back());
        if (o.cross_attention) build_transformer(o, o.out_channels);
    }
    if (o.add_sample) {
        downsampler_ = Downsample2D(o.out_channels, o.downsample_padding);
        register_module("downsamplers", torch::nn::ModuleList(downsampler_));
    }
}

at::Tensor DownBlockImpl::forward(at::Tensor x, const at::Tensor& temb, const at::Tensor& context,
                                  std::vector<at::Tensor>& skips) {
    for (std::size_t i = 0; i < resnets_.size(); ++i) {
        x = run_resnet(i, x, temb);
        if (!attentions_.empty()) x = run_attention(i, x, context);
        skips.push_back(x);
    }
    if (downsampler_) {
        x = downsampler_->forward(x);
        skips.push_back(x);
    }
    return x;
}

MidBlockImpl::MidBlockImpl(const UNetBlockOptions& o) {
    resnet_list_ = register_module("resnets", torch::nn::ModuleList());
    attention_list_ = register_module("attentions", torch::nn::ModuleList());
    resnets_.push_back(ResnetBlock2D(resnet_options(o, o.in_channels, o.in_channels)));
    resnet_list_->push_back(resnets_.back());
    for (int64_t i = 0; i < o.num_layers; ++i) {
        build_transformer(o, o.in_channels);
        resnets_.push_back(ResnetBlock2D(resnet_options(o, o.in_channels, o.in_channels)));
        resnet_list_->push_back(resnets_.back());
    }
}

at::Tensor MidBlockImpl::forward(at::Tensor x, const at::Tensor& temb, const at::Tensor& context) {
    x = run_resnet(0, x, temb);
    for (std::size_t i = 0; i < attentions_.size(); ++i) {
        x = run_attention(i, x, context);
        x = run_resnet(i + 1, x, temb);
    }
    return x;
}

UpBlockImpl::UpBlockImpl(const UNetBlockOptions& o) {
    resnet_list_ = register_module("resnets", torch::nn::ModuleList());
    if (o.cross_attention) attention_list_ = register_module("attentions", torch::nn::ModuleList());
    for (int64_t i = 0; i < o.num_layers; ++i) {
        // The last ResNet takes the skip from before this level's downsampler (in_channels wide).
        const int64_t skip = i == o.num_layers - 1 ? o.in_channels : o.out_channels;
        const int64_t from_below = i == 0 ? o.prev_output_channels : o.out_channels;
        resnets_.push_back(ResnetBlock2D(resnet_options(o, from_below + skip, o.out_channels)));
        resnet_list_->push_back(resnets_.back());
        if (o.cross_attention) build_transformer(o, o.out_channels);
    }
    if (o.add_sample) {
        upsampler_ = Upsample2D(o.out_channels);
        register_module("upsamplers", torch::nn::ModuleList(upsampler_));
    }
}

at::Tensor UpBlockImpl::forward(at::Tensor x, const at::Tensor& temb, const at::Tensor& context,
                                std::vector<at::Tensor>& skips) {
    for (std::size_t i = 0; i < resnets_.size(); ++i) {
        x = at::cat({x, skips.back()}, 1);  // [B, C + C_skip, H, W]
        skips.pop_back();
        x = run_resnet(i, x, temb);
        if (!attentions_.empty()) x = run_attention(i, x, context);
    }
    if (upsampler_) {
        std::optional<std::vector<int64_t>> size;
        if (!skips.empty()) size = std::vector<int64_t>{skips.back().size(2), skips.back().size(3)};
        x = upsampler_->forward(x, size);
    }
    return x;
}

}  // namespace dtune::models
