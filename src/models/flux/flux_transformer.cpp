// Flux.1's transformer (see flux_transformer.h). Float32 math wherever diffusers upcasts: the RoPE
// tables, the rotation itself and the RMS norms; everything else in the weights' dtype.
#include "models/flux/flux_transformer.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/nn/modules/dropout.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>
#include <string>

#include "core/error.h"
#include "models/common/blocks.h"
#include "models/common/checkpoint.h"
#include "models/common/concat_gelu.h"
#include "models/common/epilogue_linear.h"
#include "models/common/gated_residual.h"
#include "models/common/gelu_mlp.h"
#include "models/common/layers.h"
#include "models/common/qk_norm_rope.h"
#include "models/common/unit_hooks.h"
#include "models/common/weights.h"

namespace dtune::models {
namespace {

// No affine, eps 1e-6 (diffusers' AdaLN norms). In x's dtype even under autocast, whose float32 rule
// for layer_norm would cast x up, normalise and hand a float32 result to a Linear that casts it back:
// the kernel keeps its statistics in float32 either way, and the next matmul sees the same bf16 input.
at::Tensor layer_norm(const at::Tensor& x) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    return at::layer_norm(x, {x.size(-1)}, {}, {}, 1e-6);
}

// layer_norm(x) · (1 + scale) + shift, the AdaLN modulation; scale and shift [B, 1, D]. With one
// sample they are layer_norm's affine weight and bias: one fused kernel (and one rounding) instead of
// three passes over x, which for a batch of several samples are kept.
at::Tensor modulate(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // as layer_norm
    const int64_t d = x.size(-1);
    if (x.size(0) == 1 && scale.numel() == d && shift.numel() == d && scale.scalar_type() == x.scalar_type())
        return at::layer_norm(x, {d}, (1 + scale).reshape({d}), shift.reshape({d}), 1e-6);
    return layer_norm(x) * (1 + scale) + shift;
}

// q, k and v of one stream [B, S, inner] each (`group`: to_q, to_k, to_v or the add_*_proj layers).
// LoRA training with an adapter on each of the three runs the fused LoRA projections (whatever
// `fused` says; adapters/lora_qkv.h). Otherwise, with `fused`, one matmul over the three layers'
// weights stacked for the call (diffusers' fuse_projections computes the same products with a
// to_qkv copy of them), unless a layer carries an adapter or a quantised weight, which computes its
// own output. That plain form is not faster than three matmuls at Flux's sizes (H200, LoRA on the
// text stream, 1024²: 497 vs 484 ms/step, RUNS="context fused" tools/gpu/flux_train.sh); it is there
// for SimpleTuner configs that set it.
std::array<at::Tensor, 3> project_qkv(const at::Tensor& x, const ProjectionGroup& group, bool fused) {
    bool plain = fused;
    for (const AdaptableLinearImpl* l : group)
        plain = plain && l->adapter() == nullptr && !l->weight_scale.defined() && l->bias.defined();
    if (!plain) {
        const auto out = project_group(x, group);  // layer by layer unless the LoRA group fuses
        return {out[0], out[1], out[2]};
    }
    const AdaptableLinearImpl &q = *group[0], &k = *group[1], &v = *group[2];
    const at::Tensor weight = at::cat({q.weight, k.weight, v.weight}, 0);  // [3 inner, D]
    const at::Tensor bias = at::cat({q.bias, k.bias, v.bias}, 0);          // [3 inner]
    const auto out = at::linear(x, weight, bias).chunk(3, -1);
    return {out[0], out[1], out[2]};
}

// Identity forward; backward hands on the output gradient densely packed in the [B, S, H, Dh] order
// the attention output is stored in. A single block's cat([attention, mlp]) returns a slice of wider
// rows as the attention's output gradient, and cuDNN's attention backward read out of bounds with it
// (an illegal memory access at Flux's sizes, torch 2.11; bench/flux_attention_probe.py +strided).
struct DenseOutputGrad : public torch::autograd::Function<DenseOutputGrad> {
    static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& out) {  // [B, H, S, Dh]
        return out.view_as(out);
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                   torch::autograd::variable_list grads) {
        return {grads[0].transpose(1, 2).contiguous().transpose(1, 2)};
    }
};

// Six (double blocks) or three (single) modulation chunks of linear(silu(temb)), each [B, 1, D].
std::vector<at::Tensor> modulation(AdaptableLinear& linear, const at::Tensor& temb, int64_t chunks) {
    std::vector<at::Tensor> out = linear->forward(at::silu(temb)).chunk(chunks, 1);
    for (auto& t : out) t = t.unsqueeze(1);
    return out;
}

// DTUNE_FLUX_ATTENTION=flash (read once) puts the training pass back on the flash kernel, for triage.
FluxTrainingAttention initial_training_attention() {
    const char* v = std::getenv("DTUNE_FLUX_ATTENTION");
    if (v == nullptr || *v == '\0' || std::string(v) == "auto") return FluxTrainingAttention::kSdpaChoice;
    DTUNE_CHECK_AS(
        UsageError, std::string(v) == "flash", "DTUNE_FLUX_ATTENTION=", v,
        " is not a choice: use flash (the flash kernel by name) or auto (SDPA's pick, the default)");
    return FluxTrainingAttention::kFlash;
}

// Read on first use, not during static initialisation: a bad value must reach the CLI as a
// UsageError (exit 2 naming the variable), not terminate the process before main.
std::atomic<FluxTrainingAttention>& training_attention() {
    static std::atomic<FluxTrainingAttention> kernel{initial_training_attention()};
    return kernel;
}

}  // namespace

void set_flux_training_attention(FluxTrainingAttention kernel) {
    training_attention().store(kernel);
}

FluxTrainingAttention flux_training_attention() {
    return training_attention().load();
}

FluxTransformerConfig FluxTransformerConfig::from_json(const ConfigReader& r) {
    FluxTransformerConfig c;
    c.patch_size = r.get_int("patch_size", c.patch_size);
    c.in_channels = r.get_int("in_channels", c.in_channels);
    c.out_channels = r.get_int("out_channels", c.in_channels);
    c.num_layers = r.get_int("num_layers", c.num_layers);
    c.num_single_layers = r.get_int("num_single_layers", c.num_single_layers);
    c.attention_head_dim = r.get_int("attention_head_dim", c.attention_head_dim);
    c.num_attention_heads = r.get_int("num_attention_heads", c.num_attention_heads);
    c.joint_attention_dim = r.get_int("joint_attention_dim", c.joint_attention_dim);
    c.pooled_projection_dim = r.get_int("pooled_projection_dim", c.pooled_projection_dim);
    c.guidance_embeds = r.get_bool("guidance_embeds", c.guidance_embeds);
    if (r.has("axes_dims_rope")) c.axes_dims_rope = r.require_int_list("axes_dims_rope");
    int64_t rope_dim = 0;
    for (const int64_t d : c.axes_dims_rope) rope_dim += d;
    DTUNE_CHECK_AS(DataError, c.axes_dims_rope.size() == 3 && rope_dim == c.attention_head_dim, r.origin(),
                   ": axes_dims_rope must be three sizes adding up to attention_head_dim (",
                   c.attention_head_dim, ")");
    DTUNE_CHECK_AS(DataError, c.patch_size == 1, r.origin(), ": patch_size ", c.patch_size,
                   " is not supported (Flux.1 packs 2×2 latent patches outside the model: patch_size 1)");
    return c;
}

FluxRMSNormImpl::FluxRMSNormImpl(int64_t dim, double eps) : eps_(eps) {
    weight = register_parameter("weight", at::ones({dim}));
}

FluxAttentionImpl::FluxAttentionImpl(int64_t dim, int64_t heads, int64_t head_dim, bool added, bool pre_only)
    : heads_(heads) {
    const int64_t inner = heads * head_dim;
    norm_q_ = register_module("norm_q", FluxRMSNorm(head_dim, 1e-6));
    norm_k_ = register_module("norm_k", FluxRMSNorm(head_dim, 1e-6));
    to_q_ = register_module("to_q", AdaptableLinear(dim, inner));
    to_k_ = register_module("to_k", AdaptableLinear(dim, inner));
    to_v_ = register_module("to_v", AdaptableLinear(dim, inner));
    if (!pre_only) {
        to_out_ = AdaptableLinear(inner, dim);
        register_module("to_out", torch::nn::ModuleList(to_out_, torch::nn::Dropout(0.0)));
    }
    if (added) {
        norm_added_q_ = register_module("norm_added_q", FluxRMSNorm(head_dim, 1e-6));
        norm_added_k_ = register_module("norm_added_k", FluxRMSNorm(head_dim, 1e-6));
        add_q_proj_ = register_module("add_q_proj", AdaptableLinear(dim, inner));
        add_k_proj_ = register_module("add_k_proj", AdaptableLinear(dim, inner));
        add_v_proj_ = register_module("add_v_proj", AdaptableLinear(dim, inner));
        to_add_out_ = register_module("to_add_out", AdaptableLinear(inner, dim));
    }
    image_qkv_ = {to_q_.get(), to_k_.get(), to_v_.get()};
    if (added) context_qkv_ = {add_q_proj_.get(), add_k_proj_.get(), add_v_proj_.get()};
}

std::vector<ProjectionGroup> FluxAttentionImpl::projection_groups() {
    if (context_qkv_.empty()) return {image_qkv_};
    return {image_qkv_, context_qkv_};
}

std::pair<at::Tensor, at::Tensor> FluxAttentionImpl::forward(const at::Tensor& x, const at::Tensor& context,
                                                             const std::pair<at::Tensor, at::Tensor>& rope,
                                                             const at::Tensor& key_mask) {
    // A checkpointed block's recomputation: the attention output the forward kept starts back now,
    // behind the projections.
    if (stash_ && in_recompute()) stash_->prefetch(stash_slot_);
    // Text first, then image; q and k normalised per head and rotated (one kernel each way on the GPU).
    const auto image = project_qkv(x, image_qkv_, fused_qkv_);
    std::vector<QKVStream> streams;
    const int64_t text = context.defined() ? context.size(1) : 0;
    if (context.defined()) {
        const auto added = project_qkv(context, context_qkv_, fused_qkv_);
        streams.push_back({added[0], added[1], added[2], norm_added_q_->weight, norm_added_k_->weight});
    }
    streams.push_back({image[0], image[1], image[2], norm_q_->weight, norm_k_->weight});
    const auto [q, k, v] = joint_qk_norm_rope(streams, heads_, norm_q_->eps(), rope.first, rope.second);
    // [B, H, S, Dh]. SDPA's own pick, cuDNN's kernel for head_dim 128 on Hopper (twice flash's speed
    // at Flux's sizes), unless set_flux_training_attention / DTUNE_FLUX_ATTENTION=flash ask for the
    // flash kernel by name while gradients are recorded. cuDNN's backward hit an illegal memory
    // access in training before DenseOutputGrad (torch 2.11; bench_flux --cudnn_attention 1).
    const at::Tensor qh = q.transpose(1, 2), kh = k.transpose(1, 2), vh = v.transpose(1, 2);
    // The flash kernel takes no mask: a masked attention (key_mask) goes to SDPA's pick.
    const bool flash = q.is_cuda() && at::GradMode::is_enabled() && !key_mask.defined() &&
                       flux_training_attention() == FluxTrainingAttention::kFlash &&
                       (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf);
    // Unmasked: through the stash (SDPA's pick, keeping a checkpointed block's output on the host).
    at::Tensor attended = flash ? std::get<0>(at::_scaled_dot_product_flash_attention(qh, kh, vh))
                          : key_mask.defined() ? at::scaled_dot_product_attention(qh, kh, vh, key_mask)
                          : stash_             ? stash_->attend(stash_slot_, qh, kh, vh)
                                               : at::scaled_dot_product_attention(qh, kh, vh);
    if (!flash && attended.requires_grad() && attended.is_cuda()) attended = DenseOutputGrad::apply(attended);
    at::Tensor out = attended.transpose(1, 2).flatten(2, 3).to(q.scalar_type());  // [B, S, H·Dh]
    if (!context.defined()) return {out, at::Tensor()};
    // One split, not two narrows: its backward concatenates the two gradients in one pass (two
    // narrows' each zero a full-size gradient, copy their part in and are then summed).
    const auto parts = out.split_with_sizes({text, out.size(1) - text}, 1);
    return {to_out_->forward(parts[1].contiguous()), to_add_out_->forward(parts[0].contiguous())};
}

FluxTransformerBlockImpl::FluxTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim) : dim_(dim) {
    const auto adaln = [&](const char* name, int64_t chunks) {
        auto holder = register_module(name, std::make_shared<torch::nn::Module>());
        return holder->register_module("linear", AdaptableLinear(dim, chunks * dim));
    };
    norm1_ = adaln("norm1", 6);
    norm1_context_ = adaln("norm1_context", 6);
    attn_ = register_module("attn", FluxAttention(dim, heads, head_dim, /*added=*/true, /*pre_only=*/false));
    // FeedForward(dim, activation "gelu-approximate"): net.0.proj, net.1 (dropout), net.2.
    const auto feed_forward = [&](const char* name, AdaptableLinear& in, AdaptableLinear& out) {
        auto gelu = std::make_shared<torch::nn::Module>();
        in = gelu->register_module("proj", AdaptableLinear(dim, 4 * dim));
        out = AdaptableLinear(4 * dim, dim);
        auto holder = register_module(name, std::make_shared<torch::nn::Module>());
        holder->register_module("net", torch::nn::ModuleList(gelu, torch::nn::Dropout(0.0), out));
    };
    feed_forward("ff", ff_in_, ff_out_);
    feed_forward("ff_context", ff_context_in_, ff_context_out_);
}

namespace {

// Whether a block's last product (its MLP output, entering out = x + gate ⊙ mlp) is computed for
// its gradient only: in a checkpointed block's recomputation the block output is never read, only
// differentiated, and gate ⊙ mlp's backward reads mlp only for the gate's own gradient (none when
// the modulation is frozen, as in LoRA training). fp16 clamps the output, and the clamp's backward
// reads it, so fp16 computes it.
bool tail_unused(const at::Tensor& gate) {
    return in_recompute() && !gate.requires_grad() && gate.scalar_type() != at::kHalf;
}

}  // namespace

std::pair<at::Tensor, at::Tensor> FluxTransformerBlockImpl::forward(
    const at::Tensor& x, const at::Tensor& context, const at::Tensor& temb,
    const std::pair<at::Tensor, at::Tensor>& rope, const at::Tensor& key_mask) {
    // shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp
    const auto m = modulation(norm1_, temb, 6);
    const auto c = modulation(norm1_context_, temb, 6);
    const at::Tensor nx = modulate(x, m[1], m[0]);
    const at::Tensor nc = modulate(context, c[1], c[0]);
    auto [attn_x, attn_c] = attn_->forward(nx, nc, rope, key_mask);
    at::Tensor h = gated_residual(x, m[2], attn_x);
    h = gated_residual(h, m[5], gelu_mlp(modulate(h, m[4], m[3]), *ff_in_, *ff_out_, tail_unused(m[5])));
    at::Tensor e = gated_residual(context, c[2], attn_c);
    e = gated_residual(
        e, c[5], gelu_mlp(modulate(e, c[4], c[3]), *ff_context_in_, *ff_context_out_, tail_unused(c[5])));
    if (e.scalar_type() == at::kHalf) e = e.clamp(-65504, 65504);
    return {e, h};
}

FluxSingleTransformerBlockImpl::FluxSingleTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim)
    : dim_(dim) {
    auto holder = register_module("norm", std::make_shared<torch::nn::Module>());
    norm_ = holder->register_module("linear", AdaptableLinear(dim, 3 * dim));
    proj_mlp_ = register_module("proj_mlp", AdaptableLinear(dim, 4 * dim));
    proj_out_ = register_module("proj_out", AdaptableLinear(5 * dim, dim));
    attn_ = register_module("attn", FluxAttention(dim, heads, head_dim, /*added=*/false, /*pre_only=*/true));
}

at::Tensor FluxSingleTransformerBlockImpl::forward(const at::Tensor& joint, const at::Tensor& temb,
                                                   const std::pair<at::Tensor, at::Tensor>& rope,
                                                   const at::Tensor& key_mask) {
    const auto m = modulation(norm_, temb, 3);  // shift, scale, gate
    const at::Tensor n = modulate(joint, m[1], m[0]);
    // proj_out(cat([attention, gelu_tanh(proj_mlp(n))])): with the GELU in the GEMMs' epilogues where
    // gelu_mlp.h's fused path takes the layers, else the MLP projection first, as diffusers orders it.
    const bool fused_mlp = gelu_mlp_fuses(dim_, n, *proj_mlp_, *proj_out_);
    const at::Tensor mlp = fused_mlp ? at::Tensor() : proj_mlp_->forward(n);
    const at::Tensor attn = attn_->forward(n, {}, rope, key_mask).first;
    const at::Tensor projected =
        fused_mlp ? concat_gelu_mlp(attn, n, *proj_mlp_, *proj_out_, tail_unused(m[2]))
                  : output_projection(concat_gelu_tanh(attn, mlp), *proj_out_, tail_unused(m[2]));
    at::Tensor out = gated_residual(joint, m[2], projected);
    if (out.scalar_type() == at::kHalf) out = out.clamp(-65504, 65504);
    return out;
}

FluxTransformer2DModelImpl::FluxTransformer2DModelImpl(FluxTransformerConfig config)
    : config_(std::move(config)) {
    // Read the kernel switches now: a bad DTUNE_FUSED_QK_NORM_ROPE / _CONCAT_GELU / _GATED_RESIDUAL /
    // _GELU_GEMM / _LINEAR_EPILOGUE fails the load, not a training step.
    (void)fused_qk_norm_rope_enabled();
    (void)fused_concat_gelu_enabled();
    (void)fused_gated_residual_enabled();
    (void)fused_gelu_gemm_enabled();
    (void)fused_linear_epilogue_enabled();
    const auto& c = config_;
    const int64_t d = c.inner_dim();
    auto tte = register_module("time_text_embed", std::make_shared<torch::nn::Module>());
    timestep_embedder_ = tte->register_module("timestep_embedder", TimestepEmbedding(256, d));
    if (c.guidance_embeds)
        guidance_embedder_ = tte->register_module("guidance_embedder", TimestepEmbedding(256, d));
    text_embedder_ = tte->register_module("text_embedder", TimestepEmbedding(c.pooled_projection_dim, d));
    context_embedder_ = register_module("context_embedder", AdaptableLinear(c.joint_attention_dim, d));
    x_embedder_ = register_module("x_embedder", AdaptableLinear(c.in_channels, d));
    auto blocks = register_module("transformer_blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.num_layers; ++i) {
        blocks_.push_back(FluxTransformerBlock(d, c.num_attention_heads, c.attention_head_dim));
        blocks->push_back(blocks_.back());
    }
    auto singles = register_module("single_transformer_blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.num_single_layers; ++i) {
        single_blocks_.push_back(FluxSingleTransformerBlock(d, c.num_attention_heads, c.attention_head_dim));
        singles->push_back(single_blocks_.back());
    }
    auto norm_out = register_module("norm_out", std::make_shared<torch::nn::Module>());
    norm_out_ = norm_out->register_module("linear", AdaptableLinear(d, 2 * d));
    proj_out_ = register_module("proj_out", AdaptableLinear(d, c.patch_size * c.patch_size * c.out_channels));
    stash_ = std::make_shared<AttentionStash>();
    for (auto& block : blocks_) block->attn()->set_attention_stash(stash_);
    for (auto& block : single_blocks_) block->attn()->set_attention_stash(stash_);
}

at::Tensor FluxTransformer2DModelImpl::forward(const at::Tensor& x, const at::Tensor& context,
                                               const at::Tensor& pooled, const at::Tensor& timestep,
                                               const at::Tensor& guidance, const at::Tensor& img_ids,
                                               const at::Tensor& txt_ids, const at::Tensor& text_mask) {
    const auto& c = config_;
    const auto dtype = this->dtype();
    const auto device = x_embedder_->weight.device();
    DTUNE_CHECK_AS(UsageError, x.dim() == 3 && x.size(2) == c.in_channels, "Flux transformer: hidden states ",
                   x.sizes(), " must be [B, N, ", c.in_channels, "] (2×2-packed latents)");
    DTUNE_CHECK_AS(UsageError, !c.guidance_embeds || guidance.defined(),
                   "this Flux transformer embeds the guidance scale (Flux.1 [dev]): pass guidance");
    at::Tensor h = x_embedder_->forward(x.to(device, dtype));
    // diffusers: timestep.to(dtype) * 1000, sinusoids in float32, cast to the weights' dtype.
    const auto embed = [&](TimestepEmbedding& e, const at::Tensor& t) {
        const at::Tensor scaled = t.to(device).to(dtype).reshape({-1}) * 1000;
        return e->forward(
            timestep_embedding(scaled, 256, /*flip_sin_to_cos=*/true, /*freq_shift=*/0).to(dtype));
    };
    at::Tensor temb = embed(timestep_embedder_, timestep);
    if (c.guidance_embeds) temb = temb + embed(guidance_embedder_, guidance);
    temb = temb + text_embedder_->forward(pooled.to(device, dtype));
    at::Tensor e = context_embedder_->forward(context.to(device, dtype));
    const auto rope = flux_rope(at::cat({txt_ids, img_ids}, 0).to(device), c.axes_dims_rope);
    // [B, 1, 1, T + N] bool: T5's padding left out as keys, every image token kept.
    at::Tensor key_mask;
    if (text_mask.defined()) {
        const int64_t b = h.size(0), t = e.size(1), n = h.size(1);
        DTUNE_CHECK_AS(UsageError,
                       text_mask.dim() == 2 && text_mask.size(1) == t &&
                           (text_mask.size(0) == b || text_mask.size(0) == 1),
                       "Flux transformer: the text mask ", text_mask.sizes(), " must be [", b, ", ", t,
                       "] (one entry per T5 token of the prompt embeddings)");
        const at::Tensor text_keep = (text_mask.to(device) != 0).expand({b, t});
        key_mask = at::cat({text_keep, at::ones({b, n}, text_keep.options())}, 1).view({b, 1, 1, t + n});
    }
    const bool recompute = at::GradMode::is_enabled();
    for (size_t i = 0; i < blocks_.size(); ++i) {
        const std::shared_ptr<FluxTransformerBlockImpl> block = blocks_[i].ptr();
        if (!(recompute && i < checkpoint_double_.size() && checkpoint_double_[i])) {
            std::tie(e, h) =
                run_unit_pair(*block, [&] { return block->forward(h, e, temb, rope, key_mask); });
            continue;
        }
        // One output for the checkpoint: [context; image] along the sequence, split after.
        const int64_t text_len = e.size(1);
        const at::Tensor both = checkpointed(
            [block](const std::vector<at::Tensor>& in) {
                return run_unit(*block, [&] {
                    const auto [ctx, img] = block->forward(in[0], in[1], in[2], {in[3], in[4]}, in[5]);
                    return at::cat({ctx, img}, 1);
                });
            },
            {h, e, temb, rope.first, rope.second, key_mask}, parameter_list(*block));
        e = both.narrow(1, 0, text_len);
        h = both.narrow(1, text_len, both.size(1) - text_len);
    }
    const int64_t text = e.size(1);
    at::Tensor joint = at::cat({e, h}, 1);
    for (size_t i = 0; i < single_blocks_.size(); ++i) {
        const std::shared_ptr<FluxSingleTransformerBlockImpl> block = single_blocks_[i].ptr();
        if (!(recompute && i < checkpoint_single_.size() && checkpoint_single_[i])) {
            joint = run_unit(*block, [&] { return block->forward(joint, temb, rope, key_mask); });
            continue;
        }
        joint = checkpointed(
            [block](const std::vector<at::Tensor>& in) {
                return run_unit(*block, [&] { return block->forward(in[0], in[1], {in[2], in[3]}, in[4]); });
            },
            {joint, temb, rope.first, rope.second, key_mask}, parameter_list(*block));
    }
    stash_->flush();  // the last saved output's copy is done before anything reuses its memory
    h = joint.narrow(1, text, joint.size(1) - text);
    const auto mod = norm_out_->forward(at::silu(temb)).to(h.scalar_type()).chunk(2, 1);  // scale, shift
    h = modulate(h, mod[0].unsqueeze(1), mod[1].unsqueeze(1));
    return proj_out_->forward(h);
}

void FluxTransformer2DModelImpl::set_fused_qkv(bool fused) {
    for (auto& block : blocks_) block->attn()->set_fused_qkv(fused);
    for (auto& block : single_blocks_) block->attn()->set_fused_qkv(fused);
}

void FluxTransformer2DModelImpl::set_gradient_checkpointing(bool enabled, int64_t interval) {
    CheckpointSelector selector{enabled, std::max<int64_t>(1, interval)};
    checkpoint_double_.assign(blocks_.size(), false);
    checkpoint_single_.assign(single_blocks_.size(), false);
    for (size_t i = 0; i < blocks_.size(); ++i) checkpoint_double_[i] = selector.take();
    for (size_t i = 0; i < single_blocks_.size(); ++i) checkpoint_single_[i] = selector.take();
    // The last block's backward comes first, right after the forward: recomputing it would rebuild
    // the activations it just held, at the same peak (they are alive in backward either way), so it
    // keeps them. One block's forward less per step, the same gradients.
    if (!checkpoint_single_.empty()) checkpoint_single_.back() = false;
}

std::pair<int64_t, int64_t> FluxTransformer2DModelImpl::checkpointed_blocks() const {
    int64_t taken = 0;
    for (const bool b : checkpoint_double_) taken += b;
    for (const bool b : checkpoint_single_) taken += b;
    return {taken, static_cast<int64_t>(blocks_.size() + single_blocks_.size())};
}

std::pair<at::Tensor, at::Tensor> flux_rope(const at::Tensor& ids, const std::vector<int64_t>& axes_dims,
                                            double theta) {
    // diffusers' get_1d_rotary_pos_embed(repeat_interleave_real, use_real) per axis, frequencies in
    // float64 (float32 on devices without it), then float32 tables.
    const bool f64 = !ids.is_mps();
    const auto fdtype = f64 ? at::kDouble : at::kFloat;
    const at::Tensor pos = ids.to(at::kFloat);
    std::vector<at::Tensor> cos, sin;
    for (size_t i = 0; i < axes_dims.size(); ++i) {
        const int64_t dim = axes_dims[i];
        const at::Tensor exponent = at::arange(0, dim, 2, ids.options().dtype(fdtype)).narrow(0, 0, dim / 2) /
                                    static_cast<double>(dim);
        const at::Tensor freqs = 1.0 / at::pow(theta, exponent);  // [dim/2]
        const at::Tensor angles =
            at::outer(pos.select(1, static_cast<int64_t>(i)).to(fdtype), freqs);  // [S, dim/2]
        cos.push_back(angles.cos().repeat_interleave(2, 1).to(at::kFloat));
        sin.push_back(angles.sin().repeat_interleave(2, 1).to(at::kFloat));
    }
    return {at::cat(cos, -1), at::cat(sin, -1)};
}

at::Tensor flux_pack_latents(const at::Tensor& latents) {
    const int64_t b = latents.size(0), ch = latents.size(1), h = latents.size(2), w = latents.size(3);
    DTUNE_CHECK_AS(UsageError, h % 2 == 0 && w % 2 == 0, "Flux packs 2×2 latent patches: latent size ", h,
                   "x", w, " must be even (image sides multiples of 16)");
    return latents.view({b, ch, h / 2, 2, w / 2, 2})
        .permute({0, 2, 4, 1, 3, 5})
        .reshape({b, (h / 2) * (w / 2), ch * 4});
}

at::Tensor flux_unpack_latents(const at::Tensor& packed, int64_t height, int64_t width) {
    const int64_t b = packed.size(0), ch = packed.size(2) / 4;
    return packed.view({b, height / 2, width / 2, ch, 2, 2})
        .permute({0, 3, 1, 4, 2, 5})
        .reshape({b, ch, height, width});
}

at::Tensor flux_image_ids(int64_t latent_height, int64_t latent_width) {
    const int64_t h = latent_height / 2, w = latent_width / 2;
    at::Tensor ids = at::zeros({h, w, 3}, at::kFloat);
    ids.select(2, 1).add_(at::arange(h, at::kFloat).unsqueeze(1));
    ids.select(2, 2).add_(at::arange(w, at::kFloat).unsqueeze(0));
    return ids.reshape({h * w, 3});
}

namespace {

// A BFL file's keys: bare, or under ComfyUI's prefix.
struct BflKeys {
    std::string prefix;
    std::set<std::string> keys;
    explicit BflKeys(const io::WeightSource& file) {
        for (const auto& k : file.keys()) keys.insert(k);
        if (keys.count("img_in.weight") == 0 && keys.count("model.diffusion_model.img_in.weight") != 0)
            prefix = "model.diffusion_model.";
    }
    bool has(const std::string& k) const { return keys.count(prefix + k) != 0; }
};

// The per-head q/k RMSNorm scales: (diffusers key, BFL key) pairs, read by both conversions.
std::vector<std::pair<std::string, std::string>> norm_scale_keys(const FluxTransformerConfig& c) {
    std::vector<std::pair<std::string, std::string>> out;
    for (int64_t i = 0; i < c.num_layers; ++i) {
        const std::string d = str("transformer_blocks.", i, ".attn."), b = str("double_blocks.", i, ".");
        out.emplace_back(d + "norm_q.weight", b + "img_attn.norm.query_norm.scale");
        out.emplace_back(d + "norm_k.weight", b + "img_attn.norm.key_norm.scale");
        out.emplace_back(d + "norm_added_q.weight", b + "txt_attn.norm.query_norm.scale");
        out.emplace_back(d + "norm_added_k.weight", b + "txt_attn.norm.key_norm.scale");
    }
    for (int64_t i = 0; i < c.num_single_layers; ++i) {
        const std::string d = str("single_transformer_blocks.", i, ".attn."),
                          b = str("single_blocks.", i, ".");
        out.emplace_back(d + "norm_q.weight", b + "norm.query_norm.scale");
        out.emplace_back(d + "norm_k.weight", b + "norm.key_norm.scale");
    }
    return out;
}

int64_t count_blocks(const BflKeys& k, const std::string& stem, const char* probe) {
    int64_t n = 0;
    while (k.has(str(stem, n, ".", probe))) ++n;
    return n;
}

}  // namespace

FluxTransformerConfig flux_config_from_bfl(const io::WeightSource& file, const std::string& origin,
                                           bool any_head_size) {
    const BflKeys k(file);
    DTUNE_CHECK_AS(DataError, k.has("img_in.weight") && k.has("double_blocks.0.img_attn.qkv.weight"), origin,
                   " is not a Flux transformer checkpoint in Black Forest Labs' layout (no img_in.weight / "
                   "double_blocks.*); pass a diffusers Flux folder, or a flux1-dev/schnell .safetensors");
    FluxTransformerConfig c;  // FLUX.1's sizes, then what the file says
    const auto shape = [&](const std::string& key) { return file.info(k.prefix + key).shape; };
    c.in_channels = c.out_channels = shape("img_in.weight").at(1);
    c.joint_attention_dim = shape("txt_in.weight").at(1);
    c.pooled_projection_dim = shape("vector_in.in_layer.weight").at(1);
    c.attention_head_dim = shape("double_blocks.0.img_attn.norm.query_norm.scale").at(0);
    c.num_attention_heads = shape("img_in.weight").at(0) / c.attention_head_dim;
    c.num_layers = count_blocks(k, "double_blocks.", "img_mod.lin.weight");
    c.num_single_layers = count_blocks(k, "single_blocks.", "modulation.lin.weight");
    c.guidance_embeds = k.has("guidance_in.in_layer.weight");
    DTUNE_CHECK_AS(
        DataError, any_head_size || c.attention_head_dim == 128, origin, ": attention head size ",
        c.attention_head_dim,
        " is not FLUX.1's 128, so its rotary axes are unknown; load the model from a diffusers folder");
    return c;
}

int64_t FluxBflLinear::out_features() const {
    int64_t rows = 0;
    for (const auto& part : parts) rows += part.second;
    return rows;
}

std::vector<FluxBflLinear> flux_bfl_linear_layers(const FluxTransformerConfig& c) {
    const int64_t d = c.inner_dim(), mlp = 4 * d;
    std::vector<FluxBflLinear> out;
    const auto add = [&](std::string bfl, int64_t in, std::vector<std::pair<std::string, int64_t>> parts) {
        out.push_back({std::move(bfl), in, std::move(parts), false});
    };
    add("time_in.in_layer", 256, {{"time_text_embed.timestep_embedder.linear_1", d}});
    add("time_in.out_layer", d, {{"time_text_embed.timestep_embedder.linear_2", d}});
    add("vector_in.in_layer", c.pooled_projection_dim, {{"time_text_embed.text_embedder.linear_1", d}});
    add("vector_in.out_layer", d, {{"time_text_embed.text_embedder.linear_2", d}});
    if (c.guidance_embeds) {
        add("guidance_in.in_layer", 256, {{"time_text_embed.guidance_embedder.linear_1", d}});
        add("guidance_in.out_layer", d, {{"time_text_embed.guidance_embedder.linear_2", d}});
    }
    add("txt_in", c.joint_attention_dim, {{"context_embedder", d}});
    add("img_in", c.in_channels, {{"x_embedder", d}});
    for (int64_t i = 0; i < c.num_layers; ++i) {
        const std::string to = str("transformer_blocks.", i, "."), from = str("double_blocks.", i, ".");
        add(from + "img_mod.lin", d, {{to + "norm1.linear", 6 * d}});
        add(from + "txt_mod.lin", d, {{to + "norm1_context.linear", 6 * d}});
        add(from + "img_attn.qkv", d, {{to + "attn.to_q", d}, {to + "attn.to_k", d}, {to + "attn.to_v", d}});
        add(from + "txt_attn.qkv", d,
            {{to + "attn.add_q_proj", d}, {to + "attn.add_k_proj", d}, {to + "attn.add_v_proj", d}});
        add(from + "img_attn.proj", d, {{to + "attn.to_out.0", d}});
        add(from + "txt_attn.proj", d, {{to + "attn.to_add_out", d}});
        add(from + "img_mlp.0", d, {{to + "ff.net.0.proj", mlp}});
        add(from + "img_mlp.2", mlp, {{to + "ff.net.2", d}});
        add(from + "txt_mlp.0", d, {{to + "ff_context.net.0.proj", mlp}});
        add(from + "txt_mlp.2", mlp, {{to + "ff_context.net.2", d}});
    }
    for (int64_t i = 0; i < c.num_single_layers; ++i) {
        const std::string to = str("single_transformer_blocks.", i, "."),
                          from = str("single_blocks.", i, ".");
        add(from + "modulation.lin", d, {{to + "norm.linear", 3 * d}});
        add(from + "linear1", d,
            {{to + "attn.to_q", d}, {to + "attn.to_k", d}, {to + "attn.to_v", d}, {to + "proj_mlp", mlp}});
        add(from + "linear2", d + mlp, {{to + "proj_out", d}});
    }
    add("final_layer.linear", d, {{"proj_out", c.patch_size * c.patch_size * c.out_channels}});
    add("final_layer.adaLN_modulation.1", d, {{"norm_out.linear", 2 * d}});
    out.back().swap_halves = true;
    return out;
}

io::TensorList flux_bfl_to_diffusers(const io::WeightSource& file, const FluxTransformerConfig& c,
                                     const std::string& origin) {
    const BflKeys k(file);
    io::TensorList out;
    const auto get = [&](const std::string& key) {
        DTUNE_CHECK_AS(DataError, k.has(key), origin, ": key ", k.prefix + key,
                       " is missing; the file is incomplete or not a Flux transformer");
        return file.get(k.prefix + key);
    };
    for (const FluxBflLinear& layer : flux_bfl_linear_layers(c))
        for (const std::string part : {".weight", ".bias"}) {
            at::Tensor t = get(layer.bfl + part);
            DTUNE_CHECK_AS(DataError, t.dim() >= 1 && t.size(0) == layer.out_features(), origin, ": ",
                           k.prefix + layer.bfl + part, " has shape ", t.sizes(), " but this config needs ",
                           layer.out_features(),
                           " rows; the file belongs to another Flux size (check the "
                           "config folder)");
            if (layer.swap_halves) {
                const auto halves = t.chunk(2, 0);
                t = at::cat({halves[1], halves[0]}, 0);
            }
            if (layer.parts.size() == 1) {
                out.emplace_back(layer.parts.front().first + part, t);  // a view of the file, as it is
                continue;
            }
            int64_t lo = 0;
            for (const auto& [name, rows] : layer.parts) {
                out.emplace_back(name + part, t.narrow(0, lo, rows));
                lo += rows;
            }
        }
    for (const auto& [diffusers, bfl] : norm_scale_keys(c)) out.emplace_back(diffusers, get(bfl));
    return out;
}

io::TensorList flux_diffusers_to_bfl(const io::TensorList& state, const FluxTransformerConfig& c) {
    std::map<std::string, at::Tensor> by_name;
    for (const auto& [name, t] : state) by_name[name] = t;
    const auto get = [&](const std::string& key) {
        const auto it = by_name.find(key);
        DTUNE_CHECK_AS(UsageError, it != by_name.end(), "Flux single-file export: the transformer has no ",
                       key, "; it does not match its config");
        return it->second;
    };
    io::TensorList out;
    for (const FluxBflLinear& layer : flux_bfl_linear_layers(c))
        for (const std::string part : {".weight", ".bias"}) {
            std::vector<at::Tensor> rows;
            for (const auto& p : layer.parts) rows.push_back(get(p.first + part));
            at::Tensor t = rows.size() == 1 ? rows.front() : at::cat(rows, 0);
            if (layer.swap_halves) {
                const auto halves = t.chunk(2, 0);
                t = at::cat({halves[1], halves[0]}, 0);
            }
            out.emplace_back(layer.bfl + part, t);
        }
    for (const auto& [diffusers, bfl] : norm_scale_keys(c)) out.emplace_back(bfl, get(diffusers));
    return out;
}

FluxTransformer2DModel load_flux_transformer(const std::filesystem::path& dir,
                                             const ComponentLoadOptions& options) {
    if (options.single_file) {
        const std::string origin = options.single_file->string();
        const io::WeightSource file = io::WeightSource::open(*options.single_file);
        const FluxTransformerConfig config = options.config
                                                 ? FluxTransformerConfig::from_json(*options.config)
                                                 : flux_config_from_bfl(file, origin);
        FluxTransformer2DModel model{nullptr};
        {
            UninitializedParameters scope(options.dtype, options.device);
            model = FluxTransformer2DModel(config);
        }
        model->to(options.device, options.dtype);
        LoadOptions load;
        load.dtype = options.dtype;
        load.device = options.device;
        load_weights(*model, flux_bfl_to_diffusers(file, config, origin), load,
                     str("Flux transformer from ", origin), origin, &file);
        return model;
    }
    const auto config = FluxTransformerConfig::from_json(component_config(dir, options, "Flux transformer"));
    FluxTransformer2DModel model{nullptr};
    {
        UninitializedParameters scope(options.dtype, options.device);  // the strict load fills every tensor
        model = FluxTransformer2DModel(config);
    }
    model->to(options.device, options.dtype);  // the few tensors built outside the scope (RMSNorm scales)
    LoadOptions load;
    load.dtype = options.dtype;
    load.device = options.device;
    load_weights(*model, io::WeightSource::open(dir, "diffusion_pytorch_model"), load,
                 str("Flux transformer from ", dir.string()));
    return model;
}

}  // namespace dtune::models
