// AutoencoderTiny (see autoencoder_tiny.h).
#include "models/vae/autoencoder_tiny.h"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/upsampling.h>

#include "core/error.h"
#include "models/common/layers.h"

namespace dtune::models {

namespace {

Conv2d conv3(int64_t in, int64_t out, bool bias = true, int64_t stride = 1) {
    return Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1).stride(stride).bias(bias));
}

// A holder that registers `encoder` / `decoder` with a child named `layers`, as diffusers does.
struct LayersHolderImpl : torch::nn::Module {
    explicit LayersHolderImpl(torch::nn::Sequential layers) { register_module("layers", std::move(layers)); }
};
TORCH_MODULE(LayersHolder);

}  // namespace

AutoencoderTinyConfig AutoencoderTinyConfig::from_json(const ConfigReader& c) {
    if (c.has("_class_name")) c.expect_value("_class_name", "AutoencoderTiny");
    c.expect_value("act_fn", "relu");
    if (c.has("upsample_fn")) c.expect_value("upsample_fn", "nearest");
    AutoencoderTinyConfig v;
    v.in_channels = c.get_int("in_channels", 3);
    v.out_channels = c.get_int("out_channels", 3);
    v.latent_channels = c.get_int("latent_channels", 4);
    if (c.has("encoder_block_out_channels"))
        v.encoder_block_out_channels = c.require_int_list("encoder_block_out_channels");
    if (c.has("decoder_block_out_channels"))
        v.decoder_block_out_channels = c.require_int_list("decoder_block_out_channels");
    if (c.has("num_encoder_blocks")) v.num_encoder_blocks = c.require_int_list("num_encoder_blocks");
    if (c.has("num_decoder_blocks")) v.num_decoder_blocks = c.require_int_list("num_decoder_blocks");
    v.upsampling_scaling_factor = c.get_int("upsampling_scaling_factor", 2);
    if (v.num_encoder_blocks.size() != v.encoder_block_out_channels.size() || v.num_encoder_blocks.empty())
        c.unsupported("num_encoder_blocks", "needs one entry per encoder_block_out_channels entry");
    if (v.num_decoder_blocks.size() != v.decoder_block_out_channels.size() || v.num_decoder_blocks.empty())
        c.unsupported("num_decoder_blocks", "needs one entry per decoder_block_out_channels entry");
    return v;
}

AutoencoderTinyBlockImpl::AutoencoderTinyBlockImpl(int64_t in, int64_t out) {
    conv_ = register_module("conv", torch::nn::Sequential(conv3(in, out), torch::nn::ReLU(), conv3(out, out),
                                                          torch::nn::ReLU(), conv3(out, out)));
    if (in != out) {
        Conv2d skip(torch::nn::Conv2dOptions(in, out, 1).bias(false));
        register_module("skip", skip);
        skip_ = torch::nn::AnyModule(skip);
    }
    register_module("fuse", torch::nn::ReLU());
}

at::Tensor AutoencoderTinyBlockImpl::forward(const at::Tensor& x) {
    const at::Tensor skip = skip_.is_empty() ? x : skip_.forward(x);
    return at::relu(conv_->forward(x) + skip);
}

AutoencoderTinyImpl::AutoencoderTinyImpl(const AutoencoderTinyConfig& c) : config_(c) {
    // EncoderTiny: a conv, then per level a stride-2 conv (not at the first) and its blocks.
    for (std::size_t i = 0; i < c.num_encoder_blocks.size(); ++i) {
        const int64_t ch = c.encoder_block_out_channels[i];
        if (i == 0)
            encoder_layers_->push_back(conv3(c.in_channels, ch));
        else
            encoder_layers_->push_back(conv3(ch, ch, /*bias=*/false, /*stride=*/2));
        for (int64_t b = 0; b < c.num_encoder_blocks[i]; ++b)
            encoder_layers_->push_back(AutoencoderTinyBlock(ch, ch));
    }
    encoder_layers_->push_back(conv3(c.encoder_block_out_channels.back(), c.latent_channels));
    // DecoderTiny: conv + ReLU, then per level its blocks, a nearest upsample (not at the last) and a
    // conv (biased only at the last, which gives out_channels).
    decoder_layers_->push_back(conv3(c.latent_channels, c.decoder_block_out_channels[0]));
    decoder_layers_->push_back(torch::nn::ReLU());
    const std::size_t n = c.num_decoder_blocks.size();
    for (std::size_t i = 0; i < n; ++i) {
        const bool last = i + 1 == n;
        const int64_t ch = c.decoder_block_out_channels[i];
        for (int64_t b = 0; b < c.num_decoder_blocks[i]; ++b)
            decoder_layers_->push_back(AutoencoderTinyBlock(ch, ch));
        if (!last) {
            const double f = static_cast<double>(c.upsampling_scaling_factor);
            decoder_layers_->push_back(torch::nn::Upsample(
                torch::nn::UpsampleOptions().scale_factor(std::vector<double>{f, f}).mode(torch::kNearest)));
        }
        decoder_layers_->push_back(conv3(ch, last ? c.out_channels : ch, /*bias=*/last));
    }
    register_module("encoder", LayersHolder(encoder_layers_));
    register_module("decoder", LayersHolder(decoder_layers_));
}

at::Tensor AutoencoderTinyImpl::decode(const at::Tensor& latents) {
    DTUNE_CHECK(latents.dim() == 4 && latents.size(1) == config_.latent_channels,
                "AutoencoderTiny.decode: latents ", latents.sizes(), " are not [B, ", config_.latent_channels,
                ", h, w]");
    const at::Tensor x = at::tanh(latents / 3) * 3;  // diffusers' soft clamp to [-3, 3]
    return decoder_layers_->forward(x).mul(2).sub(1);
}

at::Tensor AutoencoderTinyImpl::encode(const at::Tensor& images) {
    DTUNE_CHECK(images.dim() == 4 && images.size(1) == config_.in_channels, "AutoencoderTiny.encode: images ",
                images.sizes(), " are not [B, ", config_.in_channels, ", H, W]");
    return encoder_layers_->forward(images.add(1).div(2));
}

AutoencoderTiny load_autoencoder_tiny(const std::filesystem::path& dir, const ComponentLoadOptions& options) {
    const auto config = AutoencoderTinyConfig::from_json(component_config(dir, options, "tiny autoencoder"));
    AutoencoderTiny model{nullptr};
    {
        UninitializedParameters scope(options.dtype, options.device);  // the strict load fills every tensor
        model = AutoencoderTiny(config);
    }
    load_component_weights(*model, dir, options, "tiny autoencoder", io::LdmComponent::kVAE);
    model->eval();
    return model;
}

}  // namespace dtune::models
