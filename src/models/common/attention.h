// Attention blocks named as in diffusers: Attention (`to_q`, `to_k`, `to_v`, `to_out.0`, optional
// `group_norm`), GEGLU FeedForward (`ff.net.0.proj`, `ff.net.2`), BasicTransformerBlock
// (`norm1`/`attn1`, `norm2`/`attn2`, `norm3`/`ff`) and Transformer2DModel (`norm`, `proj_in`,
// `transformer_blocks.N`, `proj_out`).
//
// q, k and v (self-attention; k and v for cross-attention) run through project_group
// (adapters/lora_qkv.h): one fused function when each carries a LoRA adapter and inject_lora laid
// their weights out back to back, else layer by layer.
// Attention runs through at::scaled_dot_product_attention, so on CUDA it picks the flash /
// cuDNN / memory-efficient kernels, except for inference with heads wider than those kernels take
// (attention_float_scores). Sequences are [B, N, C].
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <string>

#include "models/adapters/lora_qkv.h"
#include "models/common/adaptable.h"
#include "models/common/checkpoint.h"
#include "models/common/unit_hooks.h"

namespace dtune::models {

// Which kernel at::scaled_dot_product_attention picks for q/k/v of these shapes, dtypes and
// device: "math", "flash_attention", "efficient_attention", "cudnn_attention", ... (diagnostics).
std::string sdpa_backend_name(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// Attention as two batched GEMMs around a float32 softmax, in chunks of at most
// `max_score_elements` scores: q [B, h, N, d], k and v [B, h, M, d] -> [B, h, N, d]. The scores
// q·kᵀ/√d come out of the GEMM in float32 even for bf16/fp16 inputs; the probabilities are rounded
// to the input dtype for the product with v, as the flash kernels do. Used for inference on CUDA
// when the head is wider than 256 (the SDXL VAE's single 512-wide head), where SDPA falls back to its
// memory-efficient kernel at a fraction of the GEMMs' speed. No gradients.
at::Tensor attention_float_scores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  int64_t max_score_elements = int64_t{1} << 28);

struct AttentionOptions {
    int64_t query_dim = 0;
    int64_t cross_attention_dim = 0;  // 0: self-attention (keys/values from the query input)
    int64_t heads = 1;
    int64_t head_dim = 0;
    bool qkv_bias = false;
    bool upcast = false;      // compute attention in fp32 when the weights are fp16/bf16 (SD 2.x)
    int64_t norm_groups = 0;  // > 0: a `group_norm` on the input (the VAE's spatial attention)
    double norm_eps = 1e-6;
};

class AttentionImpl : public torch::nn::Module, public ProjectionGroupHost {
  public:
    explicit AttentionImpl(const AttentionOptions& options);
    // x: [B, N, query_dim]; context: [B, M, cross_attention_dim] or undefined for self-attention.
    at::Tensor forward(const at::Tensor& x, const at::Tensor& context = {});
    // The VAE's form: x [B, C, H, W] -> group_norm -> self-attention over H*W -> + x.
    at::Tensor forward_spatial(const at::Tensor& x);
    // {to_q, to_k, to_v} for self-attention, {to_k, to_v} (both read the context) for cross-attention.
    std::vector<ProjectionGroup> projection_groups() override;

  private:
    AttentionOptions options_;
    AdaptableLinear to_q_{nullptr}, to_k_{nullptr}, to_v_{nullptr};
    ProjectionGroup qkv_, kv_;               // the layers above
    torch::nn::ModuleList to_out_{nullptr};  // [Linear, Dropout] as in diffusers
    AdaptableLinear out_proj_{nullptr};
    torch::nn::GroupNorm group_norm_{nullptr};
};
TORCH_MODULE(Attention);

// hidden, gate = proj(x).chunk(2); hidden * gelu(gate)  (`proj`)
class GEGLUImpl : public torch::nn::Module {
  public:
    GEGLUImpl(int64_t dim_in, int64_t dim_out);
    at::Tensor forward(const at::Tensor& x);

  private:
    AdaptableLinear proj_{nullptr};
};
TORCH_MODULE(GEGLU);

// net = [GEGLU(dim, 4*dim), Dropout, Linear(4*dim, dim)]
class FeedForwardImpl : public torch::nn::Module {
  public:
    explicit FeedForwardImpl(int64_t dim);
    at::Tensor forward(const at::Tensor& x);

  private:
    GEGLU geglu_{nullptr};
    AdaptableLinear out_{nullptr};
};
TORCH_MODULE(FeedForward);

struct TransformerBlockOptions {
    int64_t dim = 0;
    int64_t heads = 1;
    int64_t head_dim = 0;
    int64_t cross_attention_dim = 0;
    bool only_cross_attention = false;  // attn1 also attends to the context
    bool upcast_attention = false;
};

// Pre-LayerNorm self-attention, cross-attention and GEGLU feed-forward, each with a residual.
class BasicTransformerBlockImpl : public torch::nn::Module, public HookableUnit {
  public:
    explicit BasicTransformerBlockImpl(const TransformerBlockOptions& options);
    at::Tensor forward(const at::Tensor& x, const at::Tensor& context);

  private:
    TransformerBlockOptions options_;
    torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr}, norm3_{nullptr};
    Attention attn1_{nullptr}, attn2_{nullptr};
    FeedForward ff_{nullptr};
};
TORCH_MODULE(BasicTransformerBlock);

struct Transformer2DOptions {
    int64_t in_channels = 0;
    int64_t heads = 1;
    int64_t head_dim = 0;
    int64_t num_layers = 1;
    int64_t cross_attention_dim = 0;
    int64_t norm_groups = 32;
    bool use_linear_projection = false;  // Linear proj_in/proj_out (SDXL, SD 2.x) vs 1x1 conv (SD 1.x)
    bool only_cross_attention = false;
    bool upcast_attention = false;
    std::vector<bool> checkpoint_blocks;  // per block: checkpointed (empty: none)
};

// [B, C, H, W] -> GroupNorm -> proj_in -> blocks over the H*W tokens -> proj_out -> + input.
class Transformer2DModelImpl : public torch::nn::Module {
  public:
    explicit Transformer2DModelImpl(const Transformer2DOptions& options);
    at::Tensor forward(const at::Tensor& x, const at::Tensor& context);
    // Each transformer block takes the selector's next decision (see CheckpointSelector).
    void set_gradient_checkpointing(CheckpointSelector& selector);

  private:
    Transformer2DOptions options_;
    torch::nn::GroupNorm norm_{nullptr};
    AdaptableLinear proj_in_linear_{nullptr}, proj_out_linear_{nullptr};
    AdaptableConv2d proj_in_conv_{nullptr}, proj_out_conv_{nullptr};
    std::vector<BasicTransformerBlock> blocks_;
};
TORCH_MODULE(Transformer2DModel);

}  // namespace dtune::models
