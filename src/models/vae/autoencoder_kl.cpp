// AutoencoderKL: config, encode/decode, posterior, tiling and loading.
#include "models/vae/autoencoder_kl.h"

#include <torch/autograd.h>

#include "core/error.h"
#include "core/log.h"
#include "models/common/layers.h"
#include "models/common/weights.h"

namespace dtune::models {

AutoencoderKLConfig AutoencoderKLConfig::from_json(const ConfigReader& c) {
    if (c.has("_class_name")) c.expect_value("_class_name", "AutoencoderKL");
    c.expect_value("act_fn", "silu");
    AutoencoderKLConfig v;
    v.in_channels = c.get_int("in_channels", 3);
    v.out_channels = c.get_int("out_channels", 3);
    v.latent_channels = c.get_int("latent_channels", 4);
    v.block_out_channels = c.require_int_list("block_out_channels");
    const std::size_t n = v.block_out_channels.size();
    for (const char* key : {"down_block_types", "up_block_types"}) {
        if (!c.has(key)) continue;
        const auto types = c.require_string_list(key);
        const std::string want =
            std::string(key) == "down_block_types" ? "DownEncoderBlock2D" : "UpDecoderBlock2D";
        if (types.size() != n) c.unsupported(key, "needs one entry per block_out_channels entry");
        for (const auto& t : types)
            if (t != want) c.unsupported(key, str("block type '", t, "'; only ", want, " is implemented"));
    }
    v.layers_per_block = c.get_int("layers_per_block", 1);
    v.norm_num_groups = c.get_int("norm_num_groups", 32);
    for (int64_t ch : v.block_out_channels)
        if (ch % v.norm_num_groups != 0)
            c.unsupported("norm_num_groups",
                          str(ch, " channels are not divisible into ", v.norm_num_groups, " groups"));
    if (c.has("sample_size") && c.json().at("sample_size").is_array()) {
        v.sample_size = c.json().at("sample_size").at(0).get<int64_t>();
    } else {
        v.sample_size = c.get_int("sample_size", 512);
    }
    v.scaling_factor = c.get_double("scaling_factor", 0.18215);
    v.shift_factor = c.get_double("shift_factor", 0.0);
    v.force_upcast = c.get_bool("force_upcast", true);
    v.use_quant_conv = c.get_bool("use_quant_conv", true);
    v.use_post_quant_conv = c.get_bool("use_post_quant_conv", true);
    v.mid_block_add_attention = c.get_bool("mid_block_add_attention", true);
    return v;
}

at::Tensor DiagonalGaussian::sample(std::optional<at::Generator> generator) const {
    at::Tensor noise = at::empty_like(mean).normal_(0.0, 1.0, generator);
    return mean + std * noise;
}

AutoencoderKLImpl::AutoencoderKLImpl(AutoencoderKLConfig config) : config_(std::move(config)) {
    const auto& c = config_;
    VAECoderOptions e;
    e.in_channels = c.in_channels;
    e.out_channels = 2 * c.latent_channels;
    e.block_out_channels = c.block_out_channels;
    e.layers_per_block = c.layers_per_block;
    e.norm_num_groups = c.norm_num_groups;
    e.mid_block_add_attention = c.mid_block_add_attention;
    encoder_ = register_module("encoder", VAEEncoder(e));
    VAECoderOptions d = e;
    d.in_channels = c.latent_channels;
    d.out_channels = c.out_channels;
    decoder_ = register_module("decoder", VAEDecoder(d));
    const int64_t m = 2 * c.latent_channels;
    if (c.use_quant_conv)
        quant_conv_ = register_module("quant_conv", Conv2d(torch::nn::Conv2dOptions(m, m, 1)));
    if (c.use_post_quant_conv)
        post_quant_conv_ = register_module(
            "post_quant_conv", Conv2d(torch::nn::Conv2dOptions(c.latent_channels, c.latent_channels, 1)));
}

at::Tensor AutoencoderKLImpl::encode_moments(const at::Tensor& x) {
    at::Tensor moments = encoder_->forward(x);  // [B, 2*latent, h, w]
    return quant_conv_ ? quant_conv_->forward(moments) : moments;
}

at::Tensor AutoencoderKLImpl::decode_raw(const at::Tensor& z) {
    return decoder_->forward(post_quant_conv_ ? post_quant_conv_->forward(z) : z);
}

DiagonalGaussian AutoencoderKLImpl::posterior(const at::Tensor& moments, c10::ScalarType out_dtype) const {
    auto parts = moments.chunk(2, 1);
    DiagonalGaussian g;
    g.mean = parts[0].to(out_dtype);
    g.logvar = parts[1].clamp(-30.0, 20.0).to(out_dtype);
    g.std = (0.5 * parts[1].clamp(-30.0, 20.0)).exp().to(out_dtype);
    return g;
}

namespace {

void check_image(const at::Tensor& x, int64_t channels, int64_t factor, const char* what) {
    DTUNE_CHECK_AS(UsageError, x.dim() == 4 && x.size(1) == channels, "VAE ", what, ": input has shape ",
                   x.sizes(), "; expected [B, ", channels, ", H, W]");
    DTUNE_CHECK_AS(UsageError,
                   std::string(what) != "encode" || (x.size(2) % factor == 0 && x.size(3) % factor == 0),
                   "VAE encode: image size ", x.size(2), "x", x.size(3), " is not a multiple of ", factor,
                   "; resize or crop the image to a multiple of ", factor);
}

}  // namespace

DiagonalGaussian AutoencoderKLImpl::encode(const at::Tensor& image) {
    check_image(image, config_.in_channels, config_.downsampling_factor(), "encode");
    const auto dtype = encoder_->parameters()[0].scalar_type();
    return posterior(encode_moments(image.to(dtype)), image.scalar_type());
}

at::Tensor AutoencoderKLImpl::decode(const at::Tensor& latents) {
    check_image(latents, config_.latent_channels, 1, "decode");
    const auto dtype = decoder_->parameters()[0].scalar_type();
    return decode_raw(latents.to(dtype)).to(latents.scalar_type());
}

DiagonalGaussian AutoencoderKLImpl::encode_tiled(const at::Tensor& image, const VAETileOptions& tiles) {
    check_image(image, config_.in_channels, config_.downsampling_factor(), "encode");
    const auto dtype = encoder_->parameters()[0].scalar_type();
    const double scale = 1.0 / static_cast<double>(config_.downsampling_factor());
    at::Tensor moments = run_tiled(image.to(dtype), tiles.tile_sample_size, tiles.overlap, scale,
                                   [this](const at::Tensor& t) { return encode_moments(t); });
    return posterior(moments, image.scalar_type());
}

at::Tensor AutoencoderKLImpl::decode_tiled(const at::Tensor& latents, const VAETileOptions& tiles) {
    check_image(latents, config_.latent_channels, 1, "decode");
    const auto dtype = decoder_->parameters()[0].scalar_type();
    const int64_t f = config_.downsampling_factor();
    DTUNE_CHECK_AS(UsageError, tiles.tile_sample_size % f == 0 && tiles.tile_sample_size >= f,
                   "VAE tiling: tile_sample_size ", tiles.tile_sample_size,
                   " must be a positive multiple of ", f);
    at::Tensor out = run_tiled(latents.to(dtype), tiles.tile_sample_size / f, tiles.overlap,
                               static_cast<double>(f), [this](const at::Tensor& t) { return decode_raw(t); });
    return out.to(latents.scalar_type());
}

at::Tensor AutoencoderKLImpl::scale_latents(const at::Tensor& z) const {
    return (z - config_.shift_factor) * config_.scaling_factor;
}

at::Tensor AutoencoderKLImpl::unscale_latents(const at::Tensor& z) const {
    return z / config_.scaling_factor + config_.shift_factor;
}

namespace {

// Linear cross-fade of the first `extent` rows (dim 2) or columns (dim 3) of `b` from `a`'s last ones.
at::Tensor blend(const at::Tensor& a, at::Tensor b, int64_t dim, int64_t extent) {
    extent = std::min({a.size(dim), b.size(dim), extent});
    if (extent <= 0) return b;
    at::Tensor w = at::arange(extent, b.options()) / static_cast<double>(extent);  // [extent]: 0 .. 1
    w = dim == 2 ? w.view({1, 1, extent, 1}) : w.view({1, 1, 1, extent});
    at::Tensor head = a.narrow(dim, a.size(dim) - extent, extent) * (1 - w) + b.narrow(dim, 0, extent) * w;
    return at::cat({head, b.narrow(dim, extent, b.size(dim) - extent)}, dim);
}

}  // namespace

at::Tensor run_tiled(const at::Tensor& x, int64_t tile, double overlap, double scale,
                     const std::function<at::Tensor(const at::Tensor&)>& fn) {
    DTUNE_CHECK_AS(UsageError, tile > 0 && overlap >= 0 && overlap < 1, "VAE tiling: tile ", tile,
                   " and overlap ", overlap, " are invalid; use a positive tile and an overlap in [0, 1)");
    const int64_t stride = std::max<int64_t>(1, static_cast<int64_t>(tile * (1 - overlap)));
    const auto out_tile = static_cast<int64_t>(tile * scale);
    const auto extent = static_cast<int64_t>(out_tile * overlap);
    const int64_t limit = out_tile - extent;  // each tile contributes this many rows/cols
    const int64_t h = x.size(2), w = x.size(3);
    std::vector<std::vector<at::Tensor>> rows;
    for (int64_t i = 0; i < h; i += stride) {
        std::vector<at::Tensor> row;
        for (int64_t j = 0; j < w; j += stride)
            row.push_back(fn(x.narrow(2, i, std::min(tile, h - i)).narrow(3, j, std::min(tile, w - j))));
        rows.push_back(std::move(row));
    }
    std::vector<at::Tensor> out_rows;
    for (std::size_t i = 0; i < rows.size(); ++i) {
        std::vector<at::Tensor> cols;
        for (std::size_t j = 0; j < rows[i].size(); ++j) {
            at::Tensor t = rows[i][j];
            if (i > 0) t = blend(rows[i - 1][j], t, 2, extent);
            if (j > 0) t = blend(rows[i][j - 1], t, 3, extent);
            rows[i][j] = t;  // later neighbours blend against the blended tile, as diffusers does
            cols.push_back(
                t.narrow(2, 0, std::min(limit, t.size(2))).narrow(3, 0, std::min(limit, t.size(3))));
        }
        out_rows.push_back(at::cat(cols, 3));
    }
    at::Tensor out = at::cat(out_rows, 2);  // [B, C, H*scale, W*scale]
    const auto out_h = static_cast<int64_t>(h * scale), out_w = static_cast<int64_t>(w * scale);
    return out.narrow(2, 0, std::min(out_h, out.size(2))).narrow(3, 0, std::min(out_w, out.size(3)));
}

namespace {

// A VAE single file: first checks that its latent channels are the config's (Flux's VAE has 16, SD's
// 4, and the two are easily confused), then loads it here when it is in diffusers' own layout (a
// vae/ folder's weights). Returns false for an ldm-layout file, which load_component_weights maps.
bool load_vae_file_in_diffusers_layout(AutoencoderKLImpl& model, const ComponentLoadOptions& options) {
    const std::string origin = options.single_file->string();
    const io::WeightSource file = io::WeightSource::open(*options.single_file);
    const auto ldm = io::ldm_vae_prefix(file.keys());
    const std::string conv_in = ldm.value_or("") + "decoder.conv_in.weight";
    if (file.contains(conv_in) && file.info(conv_in).shape.size() == 4) {
        const int64_t channels = file.info(conv_in).shape[1];
        DTUNE_CHECK_AS(
            DataError, channels == model.config().latent_channels, origin, ": the VAE decodes ", channels,
            " latent channels (", conv_in, ") but the model's VAE config has ",
            model.config().latent_channels,
            " (Flux.1's VAE has 16, SD and SDXL's 4); pass the VAE file that belongs to this model");
    }
    if (ldm || !file.contains("decoder.mid_block.resnets.0.conv1.weight")) return false;
    model.to(options.device, options.dtype);
    LoadOptions load;
    load.dtype = options.dtype;
    load.device = options.device;
    load_weights(model, file, load, str("VAE from ", origin));
    if (options.channels_last) convert_to_channels_last(model);
    return true;
}

}  // namespace

AutoencoderKL load_autoencoder_kl(const std::filesystem::path& dir, const ComponentLoadOptions& options) {
    const auto config = AutoencoderKLConfig::from_json(component_config(dir, options, "VAE"));
    ComponentLoadOptions load = options;
    if (config.force_upcast && options.dtype == at::kHalf) {
        log::info() << "VAE " << (options.single_file ? *options.single_file : dir).string()
                    << ": force_upcast is set, keeping fp32 weights instead of fp16";
        load.dtype = at::kFloat;
    }
    AutoencoderKL model{nullptr};
    {
        UninitializedParameters scope(load.dtype, load.device);  // the strict load fills every tensor
        model = AutoencoderKL(config);
    }
    io::LdmLayout layout;
    layout.vae_num_blocks = static_cast<int>(model->config().block_out_channels.size());
    if (load.single_file && load_vae_file_in_diffusers_layout(*model, load)) return model;
    load_component_weights(*model, dir, load, "VAE", io::LdmComponent::kVAE, layout);
    return model;
}

}  // namespace dtune::models
