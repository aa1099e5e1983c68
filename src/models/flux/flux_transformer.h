// Flux.1's denoiser: diffusers' FluxTransformer2DModel (0.42), numerically equal to it in float32
// (tests/models/test_flux_transformer_unit.cpp against tools/ref/gen_flux_transformer_ref.py).
//
//   x [B, N, in] (2×2-packed latents)  --x_embedder-->  image tokens [B, N, D]
//   context [B, T, joint] (T5)  --context_embedder-->  text tokens [B, T, D]
//   temb = timestep_embedder(sin(t·1000)) (+ guidance_embedder(sin(g·1000)) for [dev])
//          + text_embedder(pooled CLIP)                                       [B, D]
//   num_layers double-stream blocks: text and image keep their own AdaLN-Zero modulation, norms,
//     projections and feed-forward, and attend jointly ([text; image]);
//   num_single_layers single-stream blocks on [text; image]: one AdaLN-Zero, attention and a GELU
//     MLP side by side, one output projection;
//   norm_out (AdaLN-continuous) and proj_out on the image tokens -> [B, N, out].
// Attention: per-head RMSNorm of q and k, rotary embeddings over 3 position axes (axes_dims_rope;
// ids [S, 3]: 0 for text, (0, row, col) for image tokens), scaled dot-product attention. With a
// text mask (SimpleTuner's flux_attention_masked_training) the T5 padding tokens are left out as
// keys in every block's joint attention ([text mask; ones for the image tokens]), so they do not
// reach the image. With fused q/k/v (fuse_qkv_projections) each stream's three projections run as one
// matmul over their stacked weights: the same products, one kernel. In LoRA training with an adapter
// on each of a stream's q, k and v, the three run as one fused LoRA function either way
// (adapters/lora_qkv.h). On the GPU the q/k norms, the concatenation and the rotation run as one
// kernel (common/qk_norm_rope.h), a single block's attention ⊕ GELU(MLP) as another
// (common/concat_gelu.h), and the gated residuals as a third (common/gated_residual.h).
// Child modules carry diffusers' names, so a diffusers transformer/ folder loads by name; Linear
// layers are adaptable (LoRA targets).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "io/safetensors.h"
#include "models/adapters/lora_qkv.h"
#include "models/common/adaptable.h"
#include "models/common/attention_stash.h"
#include "models/common/blocks.h"
#include "models/common/component.h"

namespace dtune::models {

struct FluxTransformerConfig {
    int64_t patch_size = 1;
    int64_t in_channels = 64;
    int64_t out_channels = 64;  // config null: in_channels
    int64_t num_layers = 19;
    int64_t num_single_layers = 38;
    int64_t attention_head_dim = 128;
    int64_t num_attention_heads = 24;
    int64_t joint_attention_dim = 4096;
    int64_t pooled_projection_dim = 768;
    bool guidance_embeds = false;
    std::vector<int64_t> axes_dims_rope = {16, 56, 56};

    int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
    // From a transformer/config.json; the attention head size must equal the sum of the RoPE axes.
    static FluxTransformerConfig from_json(const ConfigReader& config);
};

// Per-head RMSNorm with a learned scale (`weight`), as torch.nn.RMSNorm: the parameter and eps under
// diffusers' names; FluxAttention applies it through joint_qk_norm_rope (common/qk_norm_rope.h).
class FluxRMSNormImpl : public torch::nn::Module {
  public:
    FluxRMSNormImpl(int64_t dim, double eps);
    double eps() const { return eps_; }
    at::Tensor weight;

  private:
    double eps_;
};
TORCH_MODULE(FluxRMSNorm);

// The joint attention of both block kinds (diffusers' FluxAttention): `added` gives the text
// stream its own projections (double blocks); `pre_only` drops the output projection (single).
// The attention kernel Flux's training pass (gradients recorded, on a GPU, in half precision) asks
// for: SDPA's own choice (the default), which on Hopper is cuDNN's kernel (twice flash's speed at
// Flux's sizes), or flash by name (DTUNE_FLUX_ATTENTION=flash at start, for triage). Process-wide.
enum class FluxTrainingAttention { kFlash, kSdpaChoice };
void set_flux_training_attention(FluxTrainingAttention kernel);
FluxTrainingAttention flux_training_attention();

class FluxAttentionImpl : public torch::nn::Module, public ProjectionGroupHost {
  public:
    FluxAttentionImpl(int64_t dim, int64_t heads, int64_t head_dim, bool added, bool pre_only);
    // x [B, N, D] (the whole joint sequence for single blocks); context [B, T, D] or undefined;
    // rope (cos, sin) [T + N, head_dim]; key_mask [B, 1, 1, T + N] bool (true: attended) or undefined.
    // Returns (image, text) outputs (text undefined without context).
    std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& context,
                                              const std::pair<at::Tensor, at::Tensor>& rope,
                                              const at::Tensor& key_mask = {});
    // One matmul for q, k and v of each stream (while none of the three carries an adapter or a
    // quantised weight; such layers compute their own outputs, or the fused LoRA projections).
    void set_fused_qkv(bool fused) { fused_qkv_ = fused; }
    // The image stream's {to_q, to_k, to_v} and, in double blocks, the text stream's add_*_proj: with
    // a LoRA on each, inject_lora lays them out for the fused LoRA projections (adapters/lora_qkv.h).
    std::vector<ProjectionGroup> projection_groups() override;
    // Where a checkpointed block keeps its attention output for the recomputation (attention_stash.h).
    void set_attention_stash(std::shared_ptr<AttentionStash> stash) {
        stash_ = std::move(stash);
        stash_slot_ = stash_ ? stash_->add_slot() : -1;
    }

  private:
    int64_t heads_;
    bool fused_qkv_ = false;
    std::shared_ptr<AttentionStash> stash_;
    int64_t stash_slot_ = -1;
    AdaptableLinear to_q_{nullptr}, to_k_{nullptr}, to_v_{nullptr}, to_out_{nullptr};
    AdaptableLinear add_q_proj_{nullptr}, add_k_proj_{nullptr}, add_v_proj_{nullptr}, to_add_out_{nullptr};
    ProjectionGroup image_qkv_, context_qkv_;  // the layers above (context_qkv_ empty without `added`)
    FluxRMSNorm norm_q_{nullptr}, norm_k_{nullptr}, norm_added_q_{nullptr}, norm_added_k_{nullptr};
};
TORCH_MODULE(FluxAttention);

class FluxTransformerBlockImpl : public torch::nn::Module, public HookableUnit {
  public:
    FluxTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim);
    // Returns (context, x).
    std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& context,
                                              const at::Tensor& temb,
                                              const std::pair<at::Tensor, at::Tensor>& rope,
                                              const at::Tensor& key_mask = {});
    FluxAttention& attn() { return attn_; }

  private:
    int64_t dim_;
    AdaptableLinear norm1_{nullptr}, norm1_context_{nullptr};  // the AdaLN-Zero modulations (.linear)
    FluxAttention attn_{nullptr};
    AdaptableLinear ff_in_{nullptr}, ff_out_{nullptr}, ff_context_in_{nullptr}, ff_context_out_{nullptr};
};
TORCH_MODULE(FluxTransformerBlock);

class FluxSingleTransformerBlockImpl : public torch::nn::Module, public HookableUnit {
  public:
    FluxSingleTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim);
    // On the joint sequence [B, T + N, D].
    at::Tensor forward(const at::Tensor& joint, const at::Tensor& temb,
                       const std::pair<at::Tensor, at::Tensor>& rope, const at::Tensor& key_mask = {});
    FluxAttention& attn() { return attn_; }

  private:
    int64_t dim_;
    AdaptableLinear norm_{nullptr};  // .linear
    FluxAttention attn_{nullptr};
    AdaptableLinear proj_mlp_{nullptr}, proj_out_{nullptr};
};
TORCH_MODULE(FluxSingleTransformerBlock);

class FluxTransformer2DModelImpl : public torch::nn::Module {
  public:
    explicit FluxTransformer2DModelImpl(FluxTransformerConfig config);

    // x [B, N, in]; context [B, T, joint]; pooled [B, pooled]; timestep [B] sigmas in [0, 1];
    // guidance [B] (required with guidance_embeds, ignored otherwise); img_ids [N, 3]; txt_ids [T, 3];
    // text_mask [B, T] (T5's attention mask: nonzero = a real token) or undefined for no masking.
    // Returns [B, N, out] in the weights' dtype.
    at::Tensor forward(const at::Tensor& x, const at::Tensor& context, const at::Tensor& pooled,
                       const at::Tensor& timestep, const at::Tensor& guidance, const at::Tensor& img_ids,
                       const at::Tensor& txt_ids, const at::Tensor& text_mask = {});
    // fuse_qkv_projections for every attention (FluxAttentionImpl::set_fused_qkv).
    void set_fused_qkv(bool fused);

    const FluxTransformerConfig& config() const { return config_; }
    c10::ScalarType dtype() const { return x_embedder_->dtype(); }
    // Recompute every `interval`-th block (the double-stream blocks, then the single-stream ones, in
    // forward order) in backward instead of keeping its activations (SimpleTuner's
    // gradient_checkpointing and gradient_checkpointing_interval), except the last single block,
    // whose backward runs right after the forward (no memory to save there). Gradients are unchanged.
    void set_gradient_checkpointing(bool enabled, int64_t interval = 1);
    // (checkpointed, all) blocks after the last set_gradient_checkpointing.
    std::pair<int64_t, int64_t> checkpointed_blocks() const;
    // The checkpointed blocks' attention outputs, kept for their recomputation (attention_stash.h).
    const AttentionStash& attention_stash() const { return *stash_; }

  private:
    FluxTransformerConfig config_;
    std::shared_ptr<AttentionStash> stash_;
    std::vector<bool> checkpoint_double_, checkpoint_single_;  // per block; empty: none
    AdaptableLinear x_embedder_{nullptr}, context_embedder_{nullptr}, norm_out_{nullptr}, proj_out_{nullptr};
    TimestepEmbedding timestep_embedder_{nullptr}, guidance_embedder_{nullptr}, text_embedder_{nullptr};
    std::vector<FluxTransformerBlock> blocks_;
    std::vector<FluxSingleTransformerBlock> single_blocks_;
};
TORCH_MODULE(FluxTransformer2DModel);

// Flux's rotary embedding tables for position ids [S, 3]: (cos, sin), each [S, sum(axes_dims)]
// float32, every frequency repeated for the (real, imaginary) pair (diffusers' FluxPosEmbed).
std::pair<at::Tensor, at::Tensor> flux_rope(const at::Tensor& ids, const std::vector<int64_t>& axes_dims,
                                            double theta = 10000.0);

// FluxPipeline's 2×2 packing: latents [B, C, H, W] -> [B, (H/2)(W/2), 4C], and back.
at::Tensor flux_pack_latents(const at::Tensor& latents);
at::Tensor flux_unpack_latents(const at::Tensor& packed, int64_t height, int64_t width);
// Image position ids for an (H/2)×(W/2) token grid: [(H/2)(W/2), 3] float32 (0, row, col).
at::Tensor flux_image_ids(int64_t latent_height, int64_t latent_width);

// A diffusers FluxTransformer2DModel folder (config.json + diffusion_pytorch_model*.safetensors),
// or with options.single_file a Black Forest Labs checkpoint (flux1-dev.safetensors' key layout:
// double_blocks.N.img_attn.qkv, single_blocks.N.linear1, ..., optionally under ComfyUI's
// "model.diffusion_model." prefix; fp8 e4m3 files are converted to the load dtype). The config is
// options.config when given, else FLUX.1's own, with the block counts and the guidance embedding
// read from the file.
FluxTransformer2DModel load_flux_transformer(const std::filesystem::path& dir,
                                             const ComponentLoadOptions& options = {});

// One Linear layer of Black Forest Labs' layout and the diffusers layers its output rows become, in
// order: fused q/k/v (double_blocks.N.{img,txt}_attn.qkv) and single_blocks.N.linear1 (q, k, v, MLP
// in) are split by rows; the final AdaLN's rows are (shift, scale) in BFL's layout and (scale,
// shift) in diffusers'. The one table behind the weight map and the Flux LoRA key map
// (models/flux/flux_lora.h).
struct FluxBflLinear {
    std::string bfl;  // "double_blocks.0.img_attn.qkv"
    int64_t in_features = 0;
    std::vector<std::pair<std::string, int64_t>> parts;  // (diffusers layer, rows)
    bool swap_halves = false;                            // final_layer.adaLN_modulation.1

    int64_t out_features() const;
};
// Every Linear layer of a transformer with this config, embedders first, then the blocks in order.
std::vector<FluxBflLinear> flux_bfl_linear_layers(const FluxTransformerConfig& config);

// The diffusers-named tensors of a BFL-layout Flux transformer file (what diffusers'
// convert_flux_transformer_checkpoint_to_diffusers computes): fused q/k/v and linear1 rows split,
// the final AdaLN's (shift, scale) halves swapped. DataError naming the file for a missing key.
io::TensorList flux_bfl_to_diffusers(const io::WeightSource& file, const FluxTransformerConfig& config,
                                     const std::string& origin);
// The inverse: a diffusers-named state dict of a transformer with this config as Black Forest Labs'
// layout (flux1-dev.safetensors' keys, bare, as ComfyUI's diffusion_models loader reads them): q/k/v
// (and the single blocks' MLP input) rows stacked into the fused layers, the final AdaLN's halves
// swapped back. UsageError naming the key for a tensor the state dict lacks.
io::TensorList flux_diffusers_to_bfl(const io::TensorList& state, const FluxTransformerConfig& config);
// FLUX.1's transformer config for a BFL-layout file: [dev]'s shape, the file's block counts and
// guidance embedding.
// `any_head_size` accepts heads other than FLUX.1's 128 (for reporting; the RoPE axes are then
// not known).
FluxTransformerConfig flux_config_from_bfl(const io::WeightSource& file, const std::string& origin,
                                           bool any_head_size = false);

}  // namespace dtune::models
