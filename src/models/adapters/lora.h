// LoRA and DoRA adapters injected into a torch::nn module tree, as PEFT does it.
//
// inject_lora() walks the tree, picks every layer whose dotted name equals a target or ends with
// "." + target (PEFT's target_modules rule; e.g. "to_out.0" matches
// "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_out.0"), and attaches a LoRALayer to
// it. Targets must be AdaptableLinear / AdaptableConv2d layers (the UNet builds every Linear and
// Conv2d that way).
//
// For a Linear W [out, in]: lora_A [r, in], lora_B [out, r], and
//     y = base(x) + s · B·A·dropout(x),   s = alpha / r   (alpha / sqrt(r) with rslora).
// For a Conv2d W [out, in, kh, kw]: lora_A is a kh×kw conv [r, in, kh, kw] with the base layer's
// stride/padding/dilation and lora_B a 1×1 conv [out, r, 1, 1] (PEFT's LoCon layout).
// With DoRA a magnitude m (initialised to the per-output-channel norm of W, PEFT's
// "lora_magnitude_vector": [out] for Linear, [1, out, 1, 1] for Conv2d) rescales the adapted
// weight: y = m / ‖W + s·BA‖ · (W + s·BA)·x + bias, where the norm is taken over every axis but the
// output one and is detached from the graph (PEFT's forward, following the DoRA paper §4.3).
//
// Parameters are registered on the adapted layer itself under PEFT's exported names, so the
// model's named_parameters() hold e.g.
// "mid_block.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight"; they move with module.to() and the
// dropout follows module.train()/eval(). Dropout masks must be reproducible when gradient
// checkpointing recomputes a block in backward: training code calls LoRAAdapters::set_dropout_seed
// (or draw_dropout_seed) before each forward (the trainer draws it from its own generator, which also keeps
// resume exact). Inject after loading the base weights (a strict base load would list
// the adapter tensors as missing).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "models/common/adaptable.h"

namespace torch::nn {
class Module;
}

namespace dtune::models {

enum class LoRAInit {
    kDefault,   // PEFT init_lora_weights=True: A kaiming-uniform (a = √5), B zero
    kGaussian,  // PEFT "gaussian": A ~ N(0, 1/r), B zero
};

// "default" / "gaussian" (SimpleTuner's lora_init_type); anything else is a UsageError naming the
// value and the accepted ones.
LoRAInit parse_lora_init(const std::string& value);

struct LoRAConfig {
    int64_t rank = 16;
    double alpha = 0.0;  // <= 0: alpha = rank (SimpleTuner's lora_alpha default None)
    double dropout = 0.0;
    LoRAInit init = LoRAInit::kDefault;
    bool use_dora = false;
    bool use_rslora = false;
    // Module-name suffixes (PEFT's list form). SDXL's default attention targets.
    std::vector<std::string> target_modules = {"to_k", "to_q", "to_v", "to_out.0"};
    // When set, a module is targeted iff its full name matches this ECMAScript regex (PEFT's
    // string form of target_modules); target_modules is then ignored.
    std::string target_regex;
    bool freeze_base = true;  // requires_grad(false) on every parameter the tree had before
    // When set, lora_A is drawn from a CPU generator seeded with this (layers in module-tree order),
    // so the initial adapters are a function of the seed; otherwise from the global generator.
    std::optional<uint64_t> init_seed;

    double effective_alpha() const { return alpha > 0 ? alpha : static_cast<double>(rank); }
};

// Process-wide switch of LoRALayer's fused training path (default on); off = the composite path
// (base linear, then the adapter through addmm). For A/B benchmarks (bench_train_step
// --no-fused-lora) and tests.
void set_fused_lora(bool enabled);
bool fused_lora_enabled();

// One adapted layer. Owned by its host layer (through LayerAdapter) and by LoRAAdapters.
class LoRALayer : public LayerAdapter {
  public:
    enum class Kind { kLinear, kConv2d };

    // `init_generator` (CPU, may be null: the global generator) draws lora_A.
    LoRALayer(AdaptableLinearImpl& host, int64_t rank, double alpha, const LoRAConfig& config,
              at::Generator* init_generator = nullptr);
    LoRALayer(AdaptableConv2dImpl& host, int64_t rank, double alpha, const LoRAConfig& config,
              at::Generator* init_generator = nullptr);

    at::Tensor forward(const at::Tensor& x, const at::Tensor& base_out) override;
    // Training a plain linear LoRA (no DoRA, no dropout, frozen base, grad mode on): the base and the
    // adapter run as one autograd function (fused_lora_enabled()), whose backward computes the
    // input's gradient as one GEMM plus one accumulating GEMM and the factors' gradients straight in
    // their dtype: no separate gradient sum of the two branches and no casts of A and B's gradients.
    bool takes_whole_forward(const at::Tensor& x) const override;
    at::Tensor forward_whole(const at::Tensor& x) override;

    Kind kind() const { return kind_; }
    int64_t rank() const { return rank_; }
    double alpha() const { return alpha_; }
    void set_alpha(double alpha) { alpha_ = alpha; }
    double scale() const;
    // Sets alpha so that scale() == s (kohya files store alpha with scale alpha / r).
    void set_scale(double s);
    bool use_dora() const { return magnitude_.defined(); }
    bool merged() const { return merged_; }
    // Copies of A and B in a compute dtype that the fused training function reads instead of
    // casting the factors (LoRAAdapters::refresh_cast_factors); undefined tensors: cast as usual.
    void set_cast_factors(at::Tensor down, at::Tensor up) {
        cast_down_ = std::move(down);
        cast_up_ = std::move(up);
    }
    const at::Tensor& cast_down() const { return cast_down_; }
    const at::Tensor& cast_up() const { return cast_up_; }
    // Seeds this layer's dropout masks: with a seed set, every training forward keeps the elements
    // that a hash of (the value `seed` holds when the kernel runs, `salt`, the element's index)
    // keeps (common/hash_dropout.h), so a gradient-checkpointed block that recomputes its forward
    // in backward, and the backward itself, see the same mask; refreshing `seed` in place (one int64
    // on the layer's device, shared by all layers) gives the next step new masks, inside a CUDA
    // graph too. Without a seed, masks come from the global generator (at::dropout).
    // Data parallel: with `world_size` > 1 element indices are offset by rank · numel, the place of
    // this rank's rows in the global batch, so N ranks × batch b keep what one process keeps for
    // batch N·b.
    void set_dropout_seed(const at::Tensor& seed, uint64_t salt, int rank = 0, int world_size = 1) {
        dropout_seed_ = seed;
        dropout_salt_ = salt;
        dropout_rank_ = rank;
        dropout_world_ = world_size;
    }

    // The mask a training forward of x applies to the adapter's input (no seed: none; then p is 0).
    // The one place that picks this layer's salt and index offset: the fused q/k/v function
    // (lora_qkv.h) takes the same mask per adapter as forward_whole.
    struct InputDropout {
        at::Tensor seed;  // undefined: no dropout
        uint64_t salt = 0;
        double p = 0;
        int64_t index_offset = 0;
        at::Tensor apply(const at::Tensor& t) const;              // t, or its masked scale (no autograd)
        void add_to(at::Tensor& dst, const at::Tensor& t) const;  // dst += apply(t), one pass
    };
    // For the fused paths (takes_whole_forward(x) true): the seeded mask while training with
    // lora_dropout, else none.
    InputDropout input_dropout(const at::Tensor& x) const;

    at::Tensor& down() { return down_; }            // lora_A.weight
    at::Tensor& up() { return up_; }                // lora_B.weight
    at::Tensor& magnitude() { return magnitude_; }  // undefined without DoRA
    const at::Tensor& base_weight() const { return *base_weight_; }

    // s·B·A shaped like the base weight ([out, in] or [out, in, kh, kw]).
    at::Tensor delta_weight() const;
    // ‖W + s·BA‖ per output channel, shaped to broadcast against W ([out, 1] / [out, 1, 1, 1]).
    at::Tensor weight_norm(const at::Tensor& delta) const;

    // Folds the adapter into the base weight (forward then skips it) and back. Idempotent.
    void merge();
    void unmerge();

    // Switched off, the layer returns the base layer's output unchanged (PEFT's disable_adapters):
    // the base model's prediction, for the targets of regularisation batches. Not while merged.
    void set_enabled(bool enabled);
    bool enabled() const { return enabled_; }

  private:
    void create(torch::nn::Module& host, at::IntArrayRef down_shape, at::IntArrayRef up_shape,
                const LoRAConfig& config, at::Generator* init_generator);
    at::Tensor apply_factor(const at::Tensor& x, const at::Tensor& w, bool first) const;  // A or B
    at::Tensor dropout(const at::Tensor& x);
    at::Tensor base_no_bias(const at::Tensor& x) const;

    Kind kind_;
    torch::nn::Module* host_;           // outlives this object (the host owns it)
    at::Tensor* base_weight_;           // the host's `weight`
    at::Tensor* base_bias_;             // the host's `bias` (may be undefined)
    at::Tensor* base_scale_;            // the host's `weight_scale` (defined when quantised)
    at::ScalarType* base_dense_dtype_;  // the host's `dense_dtype`
    // The base weight's dtype before any quantisation.
    at::ScalarType base_dtype() const {
        return base_scale_->defined() ? *base_dense_dtype_ : base_weight_->scalar_type();
    }
    std::vector<int64_t> stride_, padding_, dilation_;  // Conv2d only
    int64_t rank_;
    double alpha_;
    double dropout_;
    bool rslora_;
    at::Tensor down_, up_, magnitude_;
    at::Tensor merged_factor_;  // DoRA: m/‖W'‖ used by merge(), needed by unmerge()
    bool merged_ = false;
    bool enabled_ = true;
    at::Tensor cast_down_, cast_up_;  // set_cast_factors
    at::Tensor dropout_seed_;         // [1] int64 shared by the adapters (undefined: at::dropout)
    uint64_t dropout_salt_ = 0;
    int dropout_rank_ = 0, dropout_world_ = 1;  // this rank's rows of the global-batch mask
};

// The adapters injected into one model, in module-tree order. It refers to the model's layers, so
// it must not outlive the model.
class LoRAAdapters {
  public:
    struct Entry {
        std::string module;  // dotted module name, e.g. "down_blocks.1.attentions.0....attn1.to_q"
        std::shared_ptr<LoRALayer> layer;
    };

    LoRAAdapters(LoRAConfig config, std::vector<Entry> entries);

    const LoRAConfig& config() const { return config_; }
    const std::vector<Entry>& entries() const { return entries_; }
    std::size_t size() const { return entries_.size(); }
    LoRALayer* find(const std::string& module) const;  // nullptr when not adapted

    // Trainable tensors for the optimizer, named as diffusers/PEFT export them (without the
    // "unet." prefix): "<module>.lora_A.weight", "<module>.lora_B.weight",
    // "<module>.lora_magnitude_vector".
    io::TensorList named_parameters() const;
    std::vector<at::Tensor> parameters() const;

    void merge();
    void unmerge();
    // Every layer on or off (LoRALayer::set_enabled).
    void set_enabled(bool enabled);

    // Seeds the dropout masks of the next training forward (LoRALayer::set_dropout_seed): every
    // layer reads the adapters' one seed tensor, salted with its index. Call once per training
    // forward with a fresh seed, the same on every rank. The host form writes `seed`; the device
    // form draws it on the adapters' device from its default generator with no host work, so a
    // CUDA graph that captures the call draws a new seed on every replay.
    void set_dropout_seed(uint64_t seed, int rank = 0, int world_size = 1);
    void draw_dropout_seed(int rank = 0, int world_size = 1);

    // Copies the factors of every linear LoRA layer (DoRA's excepted) into `dtype`, in one
    // multi-tensor pass into buffers kept from step to step, and has the layers' fused training
    // function read the copies instead of casting A and B in each forward (two cast kernels per
    // layer: 1,120 a step for SDXL's attention targets). Factors already in `dtype` are copied too,
    // so that all the copies lie back to back (A's in one buffer, B's in another, in adapter order)
    // and a fused q/k/v group reads its three as one matrix each. The copies hold the factors'
    // values of the moment: call it before each training forward (LoRATraining::begin_forward; a
    // CUDA graph that captures it refreshes them on every replay) and clear_cast_factors() once the
    // step's backward is done, before the factors change, so no other forward reads stale copies.
    void refresh_cast_factors(at::ScalarType dtype);
    void clear_cast_factors();
    bool cast_factors_live() const { return cast_live_; }

  private:
    // The seed tensor on the adapters' device, handed to every layer (created on first use).
    at::Tensor& dropout_seed_tensor(int rank, int world_size);

    LoRAConfig config_;
    std::vector<Entry> entries_;
    at::Tensor dropout_seed_;                    // [1] int64
    int dropout_rank_ = -1, dropout_world_ = 0;  // the layout the layers were last given
    // refresh_cast_factors' buffers: per layer taking them (index into entries_), A's and B's copy.
    struct CastFactors {
        std::size_t entry;
        at::Tensor down, up;
    };
    std::vector<CastFactors> cast_;
    std::vector<at::Tensor> cast_to_, cast_from_;  // the copies and their factors, in one list each
    bool cast_live_ = false;
};

// Attaches a LoRA (or DoRA) layer to every targeted layer of `root`. Throws UsageError when no
// module matches, when a match is not an adaptable Linear/Conv2d (listing them), or for a bad
// config (rank < 1, dropout outside [0, 1), grouped or non-zero-padded convs). Then lays out the
// frozen weights of every q/k/v group it adapted back to back (pack_lora_projection_groups in
// lora_qkv.h: same parameters and names, new storage) for the fused q/k/v path.
LoRAAdapters inject_lora(torch::nn::Module& root, const LoRAConfig& config);

}  // namespace dtune::models
