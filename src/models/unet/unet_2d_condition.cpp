// UNet2DConditionModel: config parsing, construction and forward.
#include "models/unet/unet_2d_condition.h"

#include <torch/autograd.h>
#include <torch/nn/modules/container/modulelist.h>

#include <algorithm>

#include "core/error.h"
#include "models/common/group_norm_act.h"
#include "models/common/layers.h"
#include "models/common/quantize.h"

namespace dtune::models {
namespace {

const std::vector<std::string> kDownTypes = {"DownBlock2D", "CrossAttnDownBlock2D"};
const std::vector<std::string> kUpTypes = {"UpBlock2D", "CrossAttnUpBlock2D"};

void reject_unsupported(const ConfigReader& c) {
    for (const char* key :
         {"class_embed_type", "num_class_embeds", "encoder_hid_dim", "encoder_hid_dim_type",
          "time_cond_proj_dim", "time_embedding_act_fn", "timestep_post_act", "cross_attention_norm",
          "time_embedding_dim", "reverse_transformer_layers_per_block"})
        c.expect_null(key);
    c.expect_value("act_fn", "silu");
    c.expect_value("resnet_time_scale_shift", "default");
    c.expect_value("time_embedding_type", "positional");
    c.expect_value("dual_cross_attention", false);
    c.expect_value("attention_type", "default");
    c.expect_value("resnet_skip_time_act", false);
    c.expect_value("resnet_out_scale_factor", 1.0);
    c.expect_value("class_embeddings_concat", false);
    c.expect_value("mid_block_type", "UNetMidBlock2DCrossAttn");
    c.expect_value("dropout", 0.0);
    if (c.has("mid_block_only_cross_attention")) c.expect_value("mid_block_only_cross_attention", false);
    if (c.has("_class_name")) c.expect_value("_class_name", "UNet2DConditionModel");
    const bool null_groups = c.json().contains("norm_num_groups") && c.json().at("norm_num_groups").is_null();
    if (null_groups) c.unsupported("norm_num_groups", "null (no output GroupNorm) is not implemented");
}

void check_block_types(const ConfigReader& c, const std::string& key, const std::vector<std::string>& types,
                       const std::vector<std::string>& allowed) {
    for (const auto& t : types)
        if (std::find(allowed.begin(), allowed.end(), t) == allowed.end())
            c.unsupported(key, str("block type '", t, "'; supported: ", allowed[0], ", ", allowed[1]));
}

}  // namespace

UNet2DConditionConfig UNet2DConditionConfig::from_json(const ConfigReader& c) {
    reject_unsupported(c);
    UNet2DConditionConfig u;
    u.in_channels = c.get_int("in_channels", 4);
    u.out_channels = c.get_int("out_channels", 4);
    u.conv_in_kernel = c.get_int("conv_in_kernel", 3);
    u.conv_out_kernel = c.get_int("conv_out_kernel", 3);
    if (u.conv_in_kernel % 2 == 0) c.unsupported("conv_in_kernel", "must be odd");
    if (u.conv_out_kernel % 2 == 0) c.unsupported("conv_out_kernel", "must be odd");
    u.center_input_sample = c.get_bool("center_input_sample", false);
    u.flip_sin_to_cos = c.get_bool("flip_sin_to_cos", true);
    u.freq_shift = c.get_double("freq_shift", 0);
    u.down_block_types = c.require_string_list("down_block_types");
    u.up_block_types = c.require_string_list("up_block_types");
    check_block_types(c, "down_block_types", u.down_block_types, kDownTypes);
    check_block_types(c, "up_block_types", u.up_block_types, kUpTypes);
    u.block_out_channels = c.require_int_list("block_out_channels");
    const std::size_t n = u.down_block_types.size();
    if (n == 0 || u.up_block_types.size() != n || u.block_out_channels.size() != n)
        c.unsupported("block_out_channels",
                      "down_block_types, up_block_types and block_out_channels must be "
                      "non-empty lists of the same length");
    u.layers_per_block = c.per_block_int("layers_per_block", n, 2);
    u.transformer_layers_per_block = c.per_block_int("transformer_layers_per_block", n, 1);
    u.heads = c.has("num_attention_heads") ? c.per_block_int("num_attention_heads", n, 8)
                                           : c.per_block_int("attention_head_dim", n, 8);
    u.cross_attention_dim = c.per_block_int("cross_attention_dim", n, 1280);
    u.only_cross_attention = c.per_block_bool("only_cross_attention", n, false);
    u.downsample_padding = c.get_int("downsample_padding", 1);
    u.mid_block_scale_factor = c.get_double("mid_block_scale_factor", 1.0);
    u.norm_num_groups = c.get_int("norm_num_groups", 32);
    u.norm_eps = c.get_double("norm_eps", 1e-5);
    u.use_linear_projection = c.get_bool("use_linear_projection", false);
    u.upcast_attention = c.get_bool("upcast_attention", false);
    for (std::size_t i = 0; i < n; ++i) {
        if (u.block_out_channels[i] % u.heads[i] != 0)
            c.unsupported("attention_head_dim", str("block ", i, " has ", u.block_out_channels[i],
                                                    " channels, not divisible by ", u.heads[i], " heads"));
        if (u.block_out_channels[i] % u.norm_num_groups != 0)
            c.unsupported("norm_num_groups",
                          str("block ", i, " has ", u.block_out_channels[i], " channels, not divisible into ",
                              u.norm_num_groups, " groups"));
    }
    const std::string add = c.get_string("addition_embed_type", "");
    if (!add.empty() && add != "text_time")
        c.unsupported("addition_embed_type", "only null and \"text_time\" (SDXL)");
    u.text_time_embedding = add == "text_time";
    if (u.text_time_embedding) {
        u.addition_time_embed_dim = c.require_int("addition_time_embed_dim");
        u.projection_class_embeddings_input_dim = c.require_int("projection_class_embeddings_input_dim");
    }
    return u;
}

int64_t UNet2DConditionConfig::downsampling_factor() const {
    return int64_t{1} << (block_out_channels.size() - 1);
}

namespace {

// The options every block of level `level` (0 = highest resolution) shares.
UNetBlockOptions level_options(const UNet2DConditionConfig& c, std::size_t level) {
    UNetBlockOptions o;
    o.temb_channels = c.time_embed_dim();
    o.groups = c.norm_num_groups;
    o.eps = c.norm_eps;
    o.downsample_padding = c.downsample_padding;
    o.use_linear_projection = c.use_linear_projection;
    o.upcast_attention = c.upcast_attention;
    o.transformer_layers = c.transformer_layers_per_block[level];
    o.heads = c.heads[level];
    o.cross_attention_dim = c.cross_attention_dim[level];
    o.only_cross_attention = c.only_cross_attention[level];
    return o;
}

AdaptableConv2d same_conv(int64_t in, int64_t out, int64_t k) {
    return AdaptableConv2d(torch::nn::Conv2dOptions(in, out, k).padding(k / 2));
}

}  // namespace

UNet2DConditionModelImpl::UNet2DConditionModelImpl(UNet2DConditionConfig config)
    : config_(std::move(config)) {
    const auto& c = config_;
    const std::size_t n = c.block_out_channels.size();
    const int64_t ted = c.time_embed_dim();
    conv_in_ =
        register_module("conv_in", same_conv(c.in_channels, c.block_out_channels[0], c.conv_in_kernel));
    time_embedding_ = register_module("time_embedding", TimestepEmbedding(c.block_out_channels[0], ted));
    if (c.text_time_embedding)
        add_embedding_ =
            register_module("add_embedding", TimestepEmbedding(c.projection_class_embeddings_input_dim, ted));

    auto down_list = register_module("down_blocks", torch::nn::ModuleList());
    for (std::size_t i = 0; i < n; ++i) {
        UNetBlockOptions o = level_options(c, i);
        o.in_channels = c.block_out_channels[i == 0 ? 0 : i - 1];
        o.out_channels = c.block_out_channels[i];
        o.num_layers = c.layers_per_block[i];
        o.cross_attention = c.down_block_types[i] == "CrossAttnDownBlock2D";
        o.add_sample = i + 1 < n;
        down_blocks_.push_back(DownBlock(o));
        down_list->push_back(down_blocks_.back());
    }

    UNetBlockOptions mid = level_options(c, n - 1);
    mid.in_channels = mid.out_channels = c.block_out_channels.back();
    mid.num_layers = 1;
    mid.cross_attention = true;
    mid.only_cross_attention = false;  // diffusers' mid block never passes it on
    mid.output_scale_factor = c.mid_block_scale_factor;
    mid_block_ = register_module("mid_block", MidBlock(mid));

    auto up_list = register_module("up_blocks", torch::nn::ModuleList());
    for (std::size_t i = 0; i < n; ++i) {
        const std::size_t r = n - 1 - i;  // the level (down block) this up block mirrors
        UNetBlockOptions o = level_options(c, r);
        o.prev_output_channels = c.block_out_channels[std::min(r + 1, n - 1)];
        o.out_channels = c.block_out_channels[r];
        o.in_channels = c.block_out_channels[r == 0 ? 0 : r - 1];
        o.num_layers = c.layers_per_block[r] + 1;
        o.cross_attention = c.up_block_types[i] == "CrossAttnUpBlock2D";
        o.add_sample = i + 1 < n;
        up_blocks_.push_back(UpBlock(o));
        up_list->push_back(up_blocks_.back());
    }

    conv_norm_out_ = register_module(
        "conv_norm_out",
        torch::nn::GroupNorm(
            torch::nn::GroupNormOptions(c.norm_num_groups, c.block_out_channels[0]).eps(c.norm_eps)));
    conv_out_ =
        register_module("conv_out", same_conv(c.block_out_channels[0], c.out_channels, c.conv_out_kernel));
}

at::Tensor UNet2DConditionModelImpl::embed_time(const at::Tensor& timestep, const UNetAddedCond& added,
                                                int64_t batch, c10::ScalarType dtype) {
    const auto& c = config_;
    const auto device = conv_in_->weight.device();
    at::Tensor t = timestep.reshape({-1}).to(device);
    if (t.size(0) == 1 && batch > 1) t = t.expand({batch});
    DTUNE_CHECK_AS(UsageError, t.size(0) == batch, "UNet: ", t.size(0), " timesteps for a batch of ", batch,
                   "; pass one timestep per sample or a single one");
    at::Tensor emb = time_embedding_->forward(
        timestep_embedding(t, c.block_out_channels[0], c.flip_sin_to_cos, c.freq_shift)
            .to(dtype));  // [B, 4*C0]
    if (!c.text_time_embedding) return emb;
    DTUNE_CHECK_AS(UsageError, added.text_embeds.defined() && added.time_ids.defined(),
                   "UNet: this config has addition_embed_type \"text_time\" (SDXL); pass text_embeds (pooled "
                   "prompt embedding) and time_ids (size/crop micro-conditioning)");
    at::Tensor time_ids = added.time_ids.to(device).reshape({-1});
    at::Tensor time_embeds =
        timestep_embedding(time_ids, c.addition_time_embed_dim, c.flip_sin_to_cos, c.freq_shift)
            .reshape({batch, -1});  // [B, n_ids * addition_time_embed_dim]
    at::Tensor add = at::cat({added.text_embeds.to(device).to(at::kFloat), time_embeds}, -1).to(dtype);
    DTUNE_CHECK_AS(UsageError, add.size(1) == c.projection_class_embeddings_input_dim, "UNet: text_embeds [",
                   added.text_embeds.sizes(), "] and time_ids [", added.time_ids.sizes(), "] give ",
                   add.size(1), " features but the config's projection_class_embeddings_input_dim is ",
                   c.projection_class_embeddings_input_dim,
                   "; check the pooled embedding size and the 6 time ids");
    return emb + add_embedding_->forward(add);
}

at::Tensor UNet2DConditionModelImpl::forward(const at::Tensor& sample, const at::Tensor& timestep,
                                             const at::Tensor& encoder_hidden_states,
                                             const UNetAddedCond& added) {
    const auto dtype = conv_in_->dtype();
    DTUNE_CHECK_AS(UsageError, sample.dim() == 4 && sample.size(1) == config_.in_channels,
                   "UNet: sample has shape ", sample.sizes(), "; expected [B, ", config_.in_channels,
                   ", H, W]");
    DTUNE_CHECK_AS(UsageError, encoder_hidden_states.dim() == 3, "UNet: encoder_hidden_states has shape ",
                   encoder_hidden_states.sizes(), "; expected [B, tokens, ", config_.cross_attention_dim[0],
                   "]");
    at::Tensor x = sample.to(dtype);
    if (channels_last_) x = x.contiguous(at::MemoryFormat::ChannelsLast);
    if (config_.center_input_sample) x = 2 * x - 1;
    const at::Tensor emb = embed_time(timestep, added, x.size(0), dtype);  // [B, 4*C0]
    const at::Tensor context = encoder_hidden_states.to(dtype);

    x = conv_in_->forward(x);
    std::vector<at::Tensor> skips{x};
    for (auto& block : down_blocks_) x = block->forward(x, emb, context, skips);
    x = mid_block_->forward(x, emb, context);
    for (auto& block : up_blocks_) x = block->forward(x, emb, context, skips);
    return conv_out_->forward(group_norm_act(*conv_norm_out_, x, {}, /*silu=*/true));
}

void UNet2DConditionModelImpl::set_gradient_checkpointing(bool enabled, int64_t interval) {
    DTUNE_CHECK_AS(UsageError, interval >= 1, "gradient_checkpointing_interval must be 1 or more; got ",
                   interval);
    CheckpointSelector selector{enabled, interval};
    for (auto& b : down_blocks_) b->set_gradient_checkpointing(selector);
    mid_block_->set_gradient_checkpointing(selector);
    for (auto& b : up_blocks_) b->set_gradient_checkpointing(selector);
    const int64_t units = selector.next;
    const int64_t taken = enabled ? (units + interval - 1) / interval : 0;
    checkpointed_blocks_ = {taken, units};
}

void UNet2DConditionModelImpl::set_channels_last(bool enabled) {
    channels_last_ = enabled;
    if (enabled) {
        convert_to_channels_last(*this);
        return;
    }
    torch::NoGradGuard no_grad;
    for (auto& p : parameters(true))
        if (p.dim() == 4) p.set_data(p.contiguous());
}

UNet2DConditionModel load_unet(const std::filesystem::path& dir, const ComponentLoadOptions& options) {
    const auto config = UNet2DConditionConfig::from_json(component_config(dir, options, "UNet"));
    UNet2DConditionModel model{nullptr};
    {
        UninitializedParameters scope(options.dtype, options.device);  // the strict load fills every tensor
        model = UNet2DConditionModel(config);
    }
    ComponentLoadOptions load = options;
    load.channels_last = false;
    io::LdmLayout layout;
    layout.unet_layers_per_block = static_cast<int>(model->config().layers_per_block.at(0));
    load_component_weights(*model, dir, load, "UNet", io::LdmComponent::kUNet, layout);
    if (options.channels_last) model->set_channels_last(true);
    return model;
}

UNet2DConditionModel load_quantized_unet(const std::filesystem::path& dir, const std::filesystem::path& file,
                                         const ComponentLoadOptions& options) {
    const auto config = UNet2DConditionConfig::from_json(component_config(dir, options, "UNet"));
    UNet2DConditionModel model{nullptr};
    {
        UninitializedParameters scope(options.dtype, options.device);  // load_quantized fills every tensor
        model = UNet2DConditionModel(config);
    }
    load_quantized(*model, file, options.device, options.dtype);
    if (options.channels_last) model->set_channels_last(true);
    return model;
}

}  // namespace dtune::models
