// LoRA / DoRA layers: forward, merge/unmerge and injection by module-name patterns (PEFT's rules).
#include "models/adapters/lora.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <atomic>
#include <cmath>
#include <optional>
#include <regex>
#include <variant>

#include "core/error.h"
#include "core/fused_env.h"
#include "core/log.h"
#include "models/adapters/lora_qkv.h"
#include "models/common/hash_dropout.h"
#include "models/common/lora_dropout.h"
#include "models/common/quantize.h"

namespace dtune::models {
namespace {

// Holds one factor under the name "weight", so the tree names read "<layer>.lora_A.weight".
class LoRAFactorImpl : public torch::nn::Module {
  public:
    explicit LoRAFactorImpl(at::Tensor w) { weight = register_parameter("weight", std::move(w)); }
    at::Tensor weight;
};

bool ends_with(const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string joined(const std::vector<std::string>& items, std::size_t limit = 20) {
    std::string out;
    for (std::size_t i = 0; i < items.size() && i < limit; ++i) out += "\n    " + items[i];
    if (items.size() > limit) out += str("\n    ... and ", items.size() - limit, " more");
    return out;
}

std::atomic<bool> g_fused_lora{true};

LoRADropoutMask mask_of(const LoRALayer::InputDropout& d) {
    return {d.seed, d.salt, d.p, d.index_offset};
}

// y = x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ for a frozen W (and b) and trainable A [r, in], B [out, r]. Computes
// in the autocast dtype (else x's); saves x, W, the cast factors and h = x·Aᵀ. Autograd inputs:
// x, A, B (edges 0, 1, 2 for needs_input_grad; backward returns one entry per forward argument).
struct LoRALinearFunction : public torch::autograd::Function<LoRALinearFunction> {
    // The frozen base weight and bias ride outside autograd's inputs (an undefined bias cannot be an
    // input, and neither needs a gradient).
    // The adapter's input dropout (hash_dropout.h), when the layer has one: the mask is applied to
    // the adapter branch only and read inside the adapter's products on CUDA (common/lora_dropout.h:
    // no masked copy of x; DTUNE_LORA_DROPOUT_KERNELS=0 makes the copy). Backward hashes it
    // again, or, where the tensor-core kernel recorded the decisions in forward (one bit per
    // element), reads those.
    using Dropout = LoRALayer::InputDropout;
    struct Frozen {
        at::Tensor weight, bias;
        Dropout dropout;
        at::Tensor weight_scale;    // defined: `weight` is quantised (common/quantize.h)
        at::Tensor a_cast, b_cast;  // A and B already in the compute dtype (LoRALayer::set_cast_factors)
    };
    // t in dtype `ct`: the ready copy where it is one, else a cast.
    static at::Tensor in_dtype(const at::Tensor& t, const at::Tensor& ready, at::ScalarType ct) {
        const bool usable = ready.defined() && ready.scalar_type() == ct && ready.sizes() == t.sizes() &&
                            ready.device() == t.device();
        return usable ? ready : t.to(ct);
    }
    static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const Frozen& base,
                              const at::Tensor& a, const at::Tensor& b, double scale) {
        const at::Tensor &w = base.weight, &bias = base.bias;
        const auto device = x.device().type();
        const auto ct = at::autocast::is_autocast_enabled(device) ? at::autocast::get_autocast_dtype(device)
                                                                  : x.scalar_type();
        const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
        const at::Tensor x2 = x.reshape({-1, x.size(-1)}).to(ct);
        const at::Tensor ac = in_dtype(a, base.a_cast, ct), bc = in_dtype(b, base.b_cast, ct);
        // A quantised base is dequantised again in backward rather than saved dense.
        const bool quantized = base.weight_scale.defined();
        const at::Tensor wc = quantized ? at::Tensor() : w.to(ct);
        at::Tensor y = quantized        ? quantized_linear_no_grad(x2, w, base.weight_scale, bias, ct)
                       : bias.defined() ? at::addmm(bias.to(ct), x2, wc.t())
                                        : at::mm(x2, wc.t());  // [N, out]
        at::Tensor keep;  // the mask's decisions, where the kernel records them (lora_dropout.h)
        const at::Tensor h = base.dropout.seed.defined()
                                 ? lora_masked_down(x2, ac, mask_of(base.dropout), &keep)
                                 : at::mm(x2, ac.t());  // [N, r]
        y.addmm_(h, bc.t(), 1.0, scale);
        ctx->save_for_backward({x2, wc, ac, bc, h});
        if (quantized) {
            ctx->saved_data["q_weight"] = w;
            ctx->saved_data["q_scale"] = base.weight_scale;
        }
        ctx->saved_data["scale"] = scale;
        if (base.dropout.seed.defined()) {
            ctx->saved_data["drop_seed"] = base.dropout.seed;
            ctx->saved_data["drop_salt"] = static_cast<int64_t>(base.dropout.salt);
            ctx->saved_data["drop_p"] = base.dropout.p;
            ctx->saved_data["drop_offset"] = base.dropout.index_offset;
            if (keep.defined()) ctx->saved_data["drop_keep"] = keep;
        }
        ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
        ctx->saved_data["x_sizes"] = x.sizes().vec();
        ctx->saved_data["a_dtype"] = static_cast<int64_t>(a.scalar_type());
        ctx->saved_data["b_dtype"] = static_cast<int64_t>(b.scalar_type());
        auto sizes = x.sizes().vec();
        sizes.back() = w.size(0);
        return y.view(sizes);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        const at::Tensor &x2 = saved[0], &wc = saved[1], &ac = saved[2], &bc = saved[3], &h = saved[4];
        const double s = ctx->saved_data["scale"].toDouble();
        auto dtype = [&](const char* key) {
            return static_cast<at::ScalarType>(ctx->saved_data[key].toInt());
        };
        Dropout drop;
        LoRADropoutMask mask;
        if (ctx->saved_data.count("drop_seed")) {
            drop.seed = ctx->saved_data["drop_seed"].toTensor();
            drop.salt = static_cast<uint64_t>(ctx->saved_data["drop_salt"].toInt());
            drop.p = ctx->saved_data["drop_p"].toDouble();
            drop.index_offset = ctx->saved_data["drop_offset"].toInt();
            mask = mask_of(drop);
            if (ctx->saved_data.count("drop_keep")) mask.keep = ctx->saved_data["drop_keep"].toTensor();
        }
        const at::Tensor g = grads[0].reshape({-1, bc.size(0)}).to(x2.scalar_type());  // [N, out]
        const at::Tensor gh =
            at::addmm(at::empty({g.size(0), h.size(1)}, g.options()), g, bc, 0.0, s);  // s·g·B
        at::Tensor dx, da, db;
        if (ctx->needs_input_grad(0)) {
            // [N, in]; a quantised base is read as stored (dequantised, or the fp8 GEMM)
            dx = wc.defined()
                     ? at::mm(g, wc)
                     : quantized_linear_input_grad(g, ctx->saved_data["q_weight"].toTensor(),
                                                   ctx->saved_data["q_scale"].toTensor(), g.scalar_type());
            if (drop.seed.defined())
                lora_masked_up_add_(dx, gh, ac, mask);  // + mask(s·g·B·A), one pass
            else
                dx.addmm_(gh, ac);  // + s·g·B·A
            dx = dx.to(dtype("x_dtype")).view(ctx->saved_data["x_sizes"].toIntVector());
        }
        // Factor gradients straight into their (float32) dtype where the GEMM can write it (CUDA).
        const bool out_dtype = g.is_cuda() && g.scalar_type() != at::kFloat;
        if (ctx->needs_input_grad(1) && drop.seed.defined())
            da = lora_masked_down_grad(gh, x2, mask, dtype("a_dtype"));  // ghᵀ·(masked x)
        else if (ctx->needs_input_grad(1))
            da = out_dtype ? at::mm(gh.t(), x2, dtype("a_dtype")) : at::mm(gh.t(), x2).to(dtype("a_dtype"));
        if (ctx->needs_input_grad(2))
            db = out_dtype ? at::addmm(at::empty({g.size(1), h.size(1)}, g.options().dtype(dtype("b_dtype"))),
                                       g.t(), h, dtype("b_dtype"), 0.0, s)
                           : at::mm(g.t(), h).mul_(s).to(dtype("b_dtype"));
        return {dx, at::Tensor(), da, db, at::Tensor()};
    }
};

void check_config(const LoRAConfig& c) {
    DTUNE_CHECK_AS(UsageError, c.rank >= 1, "lora_rank must be >= 1 (got ", c.rank, ")");
    DTUNE_CHECK_AS(UsageError, c.dropout >= 0.0 && c.dropout < 1.0, "lora_dropout must be in [0, 1) (got ",
                   c.dropout, ")");
    DTUNE_CHECK_AS(UsageError, !c.target_modules.empty() || !c.target_regex.empty(),
                   "no LoRA target modules given; use e.g. to_k,to_q,to_v,to_out.0");
}

// PEFT's conv LoRA reuses the base conv's geometry; we support the plain case the UNet uses.
bool conv_supported(const AdaptableConv2dImpl& conv) {
    const auto& o = conv.options;
    return std::holds_alternative<torch::ExpandingArray<2>>(o.padding()) && o.groups() == 1 &&
           std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode());
}

}  // namespace

LoRAInit parse_lora_init(const std::string& value) {
    if (value == "default" || value == "true" || value.empty()) return LoRAInit::kDefault;
    if (value == "gaussian") return LoRAInit::kGaussian;
    throw UsageError(str("lora_init_type '", value,
                         "' is not implemented; use 'default' (kaiming-uniform A, zero B) or 'gaussian'"));
}

LoRALayer::LoRALayer(AdaptableLinearImpl& host, int64_t rank, double alpha, const LoRAConfig& config,
                     at::Generator* init_generator)
    : kind_(Kind::kLinear),
      host_(&host),
      base_weight_(&host.weight),
      base_bias_(&host.bias),
      base_scale_(&host.weight_scale),
      base_dense_dtype_(&host.dense_dtype),
      rank_(rank),
      alpha_(alpha),
      dropout_(config.dropout),
      rslora_(config.use_rslora) {
    const int64_t out = host.weight.size(0), in = host.weight.size(1);
    create(host, {rank, in}, {out, rank}, config, init_generator);
}

LoRALayer::LoRALayer(AdaptableConv2dImpl& host, int64_t rank, double alpha, const LoRAConfig& config,
                     at::Generator* init_generator)
    : kind_(Kind::kConv2d),
      host_(&host),
      base_weight_(&host.weight),
      base_bias_(&host.bias),
      base_scale_(&host.weight_scale),
      base_dense_dtype_(&host.dense_dtype),
      rank_(rank),
      alpha_(alpha),
      dropout_(config.dropout),
      rslora_(config.use_rslora) {
    const auto& o = host.options;
    const auto* padding = std::get_if<torch::ExpandingArray<2>>(&o.padding());
    DTUNE_CHECK_AS(UsageError, conv_supported(host),
                   "LoRA on a Conv2d needs groups=1 and explicit zero padding; exclude this layer from the "
                   "LoRA targets");
    stride_ = std::vector<int64_t>(o.stride()->begin(), o.stride()->end());
    padding_ = std::vector<int64_t>((*padding)->begin(), (*padding)->end());
    dilation_ = std::vector<int64_t>(o.dilation()->begin(), o.dilation()->end());
    const auto w = host.weight.sizes();  // [out, in, kh, kw]
    create(host, {rank, w[1], w[2], w[3]}, {w[0], rank, 1, 1}, config, init_generator);
}

void LoRALayer::create(torch::nn::Module& host, at::IntArrayRef down_shape, at::IntArrayRef up_shape,
                       const LoRAConfig& config, at::Generator* init_generator) {
    torch::NoGradGuard no_grad;
    const auto options = base_weight_->options().dtype(base_dtype()).requires_grad(false);
    at::Tensor a = at::empty(down_shape, options);
    if (init_generator) {
        // The same distributions, drawn in float32 on the CPU from the seeded generator.
        at::Tensor draw = at::empty(down_shape, at::kFloat);
        const double fan_in = static_cast<double>(a.numel() / rank_);  // in · kh · kw
        if (config.init == LoRAInit::kGaussian)
            draw.normal_(0.0, 1.0 / static_cast<double>(rank_), *init_generator);
        else
            draw.uniform_(-1.0 / std::sqrt(fan_in), 1.0 / std::sqrt(fan_in), *init_generator);
        a.copy_(draw);
    } else if (config.init == LoRAInit::kGaussian) {
        a.normal_(0.0, 1.0 / static_cast<double>(rank_));
    } else {
        torch::nn::init::kaiming_uniform_(a, std::sqrt(5.0));  // uniform on ±1/√fan_in
    }
    down_ = host.register_module("lora_A", std::make_shared<LoRAFactorImpl>(a))->weight;
    up_ = host.register_module("lora_B", std::make_shared<LoRAFactorImpl>(at::zeros(up_shape, options)))
              ->weight;
    if (config.use_dora) {
        at::Tensor norm = weight_norm(at::zeros(base_weight_->sizes(), options));  // B = 0: ‖W‖ per channel
        at::Tensor m = kind_ == Kind::kLinear ? norm.reshape({-1}) : norm.reshape({1, -1, 1, 1});
        magnitude_ = host.register_parameter("lora_magnitude_vector", m.clone());
    }
}

void set_fused_lora(bool enabled) {
    g_fused_lora = enabled;
}
bool fused_lora_enabled() {
    return g_fused_lora && fused_kernels_allowed();
}

bool LoRALayer::takes_whole_forward(const at::Tensor& x) const {
    // Dropout rides in the fused function when its mask is the seeded hash (recomputable in backward).
    const bool unfusable_drop = dropout_ > 0.0 && host_->is_training() && !dropout_seed_.defined();
    // Without grad only in training: a checkpointed block's first forward then runs the same kernels
    // (and gives the same values) as its recomputation; inference keeps the plain ops.
    return fused_lora_enabled() && enabled_ && kind_ == Kind::kLinear && !merged_ && !magnitude_.defined() &&
           !unfusable_drop && (at::GradMode::is_enabled() || host_->is_training()) &&
           (down_.requires_grad() || up_.requires_grad()) && !base_weight_->requires_grad() &&
           !(base_bias_->defined() && base_bias_->requires_grad()) && x.numel() > 0 && x.dim() >= 2;
}

at::Tensor LoRALayer::InputDropout::apply(const at::Tensor& t) const {
    return seed.defined() ? hash_dropout_no_grad(t, seed, salt, p, index_offset) : t;
}

void LoRALayer::InputDropout::add_to(at::Tensor& dst, const at::Tensor& t) const {
    hash_dropout_add_(dst, t, seed, salt, p, index_offset);
}

LoRALayer::InputDropout LoRALayer::input_dropout(const at::Tensor& x) const {
    if (!(dropout_ > 0.0 && host_->is_training())) return {};
    // The mask indexes the flattened [N, in] input, which is x's own order (x is contiguous in
    // the attention and feed-forward projections; reshape copies it otherwise).
    return {dropout_seed_, dropout_salt_, dropout_, dropout_rank_ * x.numel()};
}

at::Tensor LoRALayer::forward_whole(const at::Tensor& x) {
    LoRALinearFunction::Frozen frozen{*base_weight_, *base_bias_, input_dropout(x), *base_scale_};
    frozen.a_cast = cast_down_;
    frozen.b_cast = cast_up_;
    return LoRALinearFunction::apply(x, frozen, down_, up_, scale());
}

double LoRALayer::scale() const {
    const double r = static_cast<double>(rank_);
    return rslora_ ? alpha_ / std::sqrt(r) : alpha_ / r;
}

void LoRALayer::set_scale(double s) {
    const double r = static_cast<double>(rank_);
    alpha_ = rslora_ ? s * std::sqrt(r) : s * r;
}

at::Tensor LoRALayer::apply_factor(const at::Tensor& x, const at::Tensor& w, bool first) const {
    if (kind_ == Kind::kLinear) return at::linear(x, w);
    if (first) return at::conv2d(x, w, {}, stride_, padding_, dilation_);
    return at::conv2d(x, w);  // 1×1
}

at::Tensor LoRALayer::base_no_bias(const at::Tensor& x) const {
    if (base_scale_->defined()) {
        if (kind_ == Kind::kLinear) return quantized_linear(x, *base_weight_, *base_scale_, {});
        return quantized_conv2d(x, *base_weight_, *base_scale_, {}, stride_, padding_, dilation_, 1);
    }
    if (kind_ == Kind::kLinear) return at::linear(x, *base_weight_);
    return at::conv2d(x, *base_weight_, {}, stride_, padding_, dilation_);
}

at::Tensor LoRALayer::dropout(const at::Tensor& x) {
    if (!dropout_seed_.defined()) return at::dropout(x, dropout_, /*train=*/true);
    // The global-batch place of this rank's rows: offset by rank · numel (batch is the outer axis
    // in both the contiguous and the channels-last layout).
    return hash_dropout(x, dropout_seed_, dropout_salt_, dropout_, dropout_rank_ * x.numel());
}

at::Tensor LoRALayer::delta_weight() const {
    // Conv: B is 1×1, so B∘A is the matrix product of the flattened factors.
    at::Tensor d = at::matmul(up_.flatten(1), down_.flatten(1));  // [out, in·kh·kw]
    return d.view(base_weight_->sizes()) * scale();
}

at::Tensor LoRALayer::weight_norm(const at::Tensor& delta) const {
    // Summed in the wider of the two dtypes (a quantised base is dequantised to it).
    at::Tensor w =
        dense_weight(*base_weight_, *base_scale_, at::promote_types(base_dtype(), delta.scalar_type())) +
        delta;
    at::Tensor n = w.flatten(1).norm(2, {1}, /*keepdim=*/true);  // [out, 1]
    return kind_ == Kind::kLinear ? n : n.view({-1, 1, 1, 1});
}

at::Tensor LoRALayer::forward(const at::Tensor& x, const at::Tensor& base_out) {
    if (merged_ || !enabled_) return base_out;
    const bool drop = dropout_ > 0.0 && host_->is_training();
    const at::Tensor xd = drop ? dropout(x) : x;
    const double s = scale();
    if (!magnitude_.defined() && kind_ == Kind::kLinear) {
        // base_out + s·(x·Aᵀ)·Bᵀ as one GEMM: the sum and the scale ride in addmm's epilogue, which
        // saves two elementwise passes over the layer's output in forward and two in backward.
        const at::Tensor h = at::linear(xd, down_).reshape({-1, rank_});  // [N, r]
        const at::Tensor y = at::addmm(base_out.reshape({-1, base_out.size(-1)}), h, up_.t(), 1.0, s);
        return y.view(base_out.sizes());  // like base_out
    }
    const at::Tensor lora = apply_factor(apply_factor(xd, down_, true), up_, false);  // like base_out
    if (!magnitude_.defined()) return base_out + lora * s;

    // DoRA: the norm is a constant of the step (computed without a graph), as PEFT does.
    at::Tensor norm;
    {
        torch::NoGradGuard no_grad;
        norm = weight_norm(delta_weight()).reshape({-1});  // [out]
    }
    at::Tensor mag = magnitude_.reshape({-1}) / norm;  // [out]
    if (kind_ == Kind::kConv2d) mag = mag.view({1, -1, 1, 1});
    at::Tensor base;
    if (drop) {
        base = base_no_bias(xd);  // the base term sees the same dropped-out input as the adapter
    } else if (base_bias_->defined()) {
        base = base_out - (kind_ == Kind::kLinear ? *base_bias_ : base_bias_->view({1, -1, 1, 1}));
    } else {
        base = base_out;
    }
    return base_out + (mag - 1) * base + mag * lora * s;
}

void LoRALayer::merge() {
    if (merged_) return;
    DTUNE_CHECK_AS(
        UsageError, !base_scale_->defined(),
        "a LoRA cannot be merged into a quantised base layer (base_model_precision); it is applied "
        "alongside the base instead");
    torch::NoGradGuard no_grad;
    const at::Tensor delta = delta_weight().to(base_weight_->scalar_type());
    if (magnitude_.defined()) {
        const at::Tensor norm = weight_norm(delta);
        merged_factor_ = magnitude_.reshape(norm.sizes()).to(norm.scalar_type()) / norm;  // [out, 1(,1,1)]
        base_weight_->copy_((*base_weight_ + delta) * merged_factor_);
    } else {
        base_weight_->add_(delta);
    }
    merged_ = true;
}

void LoRALayer::unmerge() {
    if (!merged_) return;
    torch::NoGradGuard no_grad;
    const at::Tensor delta = delta_weight().to(base_weight_->scalar_type());
    if (magnitude_.defined())
        base_weight_->copy_(*base_weight_ / merged_factor_ - delta);
    else
        base_weight_->sub_(delta);
    merged_factor_ = at::Tensor();
    merged_ = false;
}

void LoRALayer::set_enabled(bool enabled) {
    DTUNE_CHECK(!merged_ || enabled, "a merged LoRA layer cannot be switched off; unmerge it first");
    enabled_ = enabled;
}

LoRAAdapters::LoRAAdapters(LoRAConfig config, std::vector<Entry> entries)
    : config_(std::move(config)), entries_(std::move(entries)) {}

LoRALayer* LoRAAdapters::find(const std::string& module) const {
    for (const auto& e : entries_)
        if (e.module == module) return e.layer.get();
    return nullptr;
}

io::TensorList LoRAAdapters::named_parameters() const {
    io::TensorList out;
    for (const auto& e : entries_) {
        out.emplace_back(e.module + ".lora_A.weight", e.layer->down());
        out.emplace_back(e.module + ".lora_B.weight", e.layer->up());
        if (e.layer->use_dora()) out.emplace_back(e.module + ".lora_magnitude_vector", e.layer->magnitude());
    }
    return out;
}

std::vector<at::Tensor> LoRAAdapters::parameters() const {
    std::vector<at::Tensor> out;
    for (auto& [_, t] : named_parameters()) out.push_back(t);
    return out;
}

at::Tensor& LoRAAdapters::dropout_seed_tensor(int rank, int world_size) {
    const c10::Device device =
        entries_.empty() ? c10::Device(c10::kCPU) : entries_[0].layer->base_weight().device();
    const bool fresh = !dropout_seed_.defined() || dropout_seed_.device() != device;
    if (fresh) dropout_seed_ = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(device));
    // The layers share the tensor (refreshed in place each forward): hand it out again only when it
    // or the rank layout changed, not on every forward.
    if (fresh || rank != dropout_rank_ || world_size != dropout_world_) {
        for (std::size_t i = 0; i < entries_.size(); ++i)
            entries_[i].layer->set_dropout_seed(dropout_seed_, i + 1, rank, world_size);
        dropout_rank_ = rank;
        dropout_world_ = world_size;
    }
    return dropout_seed_;
}

void LoRAAdapters::set_dropout_seed(uint64_t seed, int rank, int world_size) {
    dropout_seed_tensor(rank, world_size).fill_(static_cast<int64_t>(seed));
}

void LoRAAdapters::draw_dropout_seed(int rank, int world_size) {
    dropout_seed_tensor(rank, world_size).random_();  // the device's default generator
}

void LoRAAdapters::refresh_cast_factors(at::ScalarType dtype) {
    auto stale = [&](const CastFactors& c) {  // a new dtype, or the factors moved
        LoRALayer& l = *entries_[c.entry].layer;
        return c.down.scalar_type() != dtype || c.down.device() != l.down().device() ||
               c.up.device() != l.up().device();
    };
    auto slot = [](int64_t numel) { return (numel + 63) / 64 * 64; };
    if (cast_.empty() || stale(cast_.front())) {
        cast_.clear();
        cast_to_.clear();
        cast_from_.clear();
        std::vector<std::size_t> taking;
        int64_t down_numel = 0, up_numel = 0;
        bool one_device = true;
        for (std::size_t i = 0; i < entries_.size(); ++i) {
            LoRALayer& l = *entries_[i].layer;
            if (l.kind() != LoRALayer::Kind::kLinear || l.use_dora()) continue;
            // Factors already in `dtype` (adamw_bf16 trains bf16 factors) are copied too: the copies
            // lie back to back where the parameters do not.
            taking.push_back(i);
            down_numel += slot(l.down().numel());
            up_numel += slot(l.up().numel());
            one_device = one_device && l.down().device() == entries_[taking.front()].layer->down().device() &&
                         l.up().device() == l.down().device();
        }
        // A's copies back to back in one buffer, in adapter order, and B's in another: a q/k/v group's
        // three are then one [3r, in] matrix and one [3, out, r] batch to the fused projections
        // (lora_qkv.h), with no concatenation per forward. Each starts on a 64-element boundary (the
        // kernels' 16-byte loads; r · in is a multiple of 64 for SDXL and Flux, so no gaps there).
        at::Tensor downs, ups;
        if (!taking.empty() && one_device) {
            const auto options = entries_[taking.front()].layer->down().options().dtype(dtype);
            downs = at::empty({down_numel}, options);
            ups = at::empty({up_numel}, options);
        }
        auto place = [&](const at::Tensor& buffer, int64_t& at, const at::Tensor& factor) {
            at::Tensor copy = buffer.defined() ? buffer.narrow(0, at, factor.numel()).view(factor.sizes())
                                               : at::empty_like(factor, factor.options().dtype(dtype));
            at += slot(factor.numel());
            return copy;
        };
        int64_t at_down = 0, at_up = 0;
        for (const std::size_t i : taking) {
            LoRALayer& l = *entries_[i].layer;
            cast_.push_back({i, place(downs, at_down, l.down()), place(ups, at_up, l.up())});
            // The parameters' own handles: set_data on a factor (a dtype or device change) is seen.
            cast_to_.insert(cast_to_.end(), {cast_.back().down, cast_.back().up});
            cast_from_.insert(cast_from_.end(), {l.down(), l.up()});
        }
    }
    if (cast_.empty()) return;
    for (const CastFactors& c : cast_) entries_[c.entry].layer->set_cast_factors(c.down, c.up);
    {
        const at::NoGradGuard no_grad;
        at::_foreach_copy_(cast_to_, cast_from_);
    }
    cast_live_ = true;
}

void LoRAAdapters::clear_cast_factors() {
    for (const CastFactors& c : cast_) entries_[c.entry].layer->set_cast_factors({}, {});
    cast_live_ = false;
}

void LoRAAdapters::merge() {
    for (auto& e : entries_) e.layer->merge();
}

void LoRAAdapters::unmerge() {
    for (auto& e : entries_) e.layer->unmerge();
}

void LoRAAdapters::set_enabled(bool enabled) {
    for (auto& e : entries_) e.layer->set_enabled(enabled);
}

LoRAAdapters inject_lora(torch::nn::Module& root, const LoRAConfig& config) {
    check_config(config);
    std::optional<std::regex> pattern;
    if (!config.target_regex.empty()) {
        try {
            pattern.emplace(config.target_regex);
        } catch (const std::regex_error& e) {
            throw UsageError(str("LoRA target regex '", config.target_regex, "' is invalid: ", e.what()));
        }
    }
    auto targeted = [&](const std::string& name) {
        if (pattern) return std::regex_match(name, *pattern);
        for (const auto& t : config.target_modules)
            if (name == t || ends_with(name, "." + t)) return true;
        return false;
    };

    // First pass: find and check every target, so a bad config leaves the model untouched.
    std::vector<std::pair<std::string, torch::nn::Module*>> found;
    std::vector<std::string> unsupported, adapted;
    for (const auto& item : root.named_modules("", /*include_self=*/false)) {
        if (!targeted(item.key())) continue;
        torch::nn::Module* m = item.value().get();
        auto* linear = dynamic_cast<AdaptableLinearImpl*>(m);
        auto* conv = dynamic_cast<AdaptableConv2dImpl*>(m);
        if (!linear && !conv)
            unsupported.push_back(str(item.key(), " (", m->name(), ")"));
        else if (conv && !conv_supported(*conv))
            unsupported.push_back(str(item.key(), " (Conv2d with groups > 1 or non-zero/implicit padding)"));
        else if ((linear && linear->adapter()) || (conv && conv->adapter()))
            adapted.push_back(item.key());
        else
            found.emplace_back(item.key(), m);
    }
    std::string targets = config.target_regex;
    for (const auto& t : config.target_modules) targets += (targets.empty() ? "" : ",") + t;
    if (!unsupported.empty())
        throw UsageError(str("LoRA targets '", targets, "' match ", unsupported.size(),
                             " module(s) that are not Linear/Conv2d layers:", joined(unsupported),
                             "\n  name Linear/Conv2d layers themselves (e.g. to_out.0, not to_out)"));
    if (found.empty() && adapted.empty())
        throw UsageError(str("LoRA targets '", targets,
                             "' match no module of the model; targets are module-name suffixes such as "
                             "to_q, to_out.0, ff.net.2 or conv1"));
    if (!adapted.empty())
        throw UsageError(str(adapted.size(), " LoRA target layer(s) already carry an adapter:",
                             joined(adapted), "\n  inject LoRA once per model"));

    if (config.freeze_base)
        for (auto& p : root.parameters()) p.set_requires_grad(false);
    std::vector<LoRAAdapters::Entry> entries;
    const double alpha = config.effective_alpha();
    std::optional<at::Generator> init_generator;
    if (config.init_seed) init_generator = at::detail::createCPUGenerator(*config.init_seed);
    at::Generator* gen = init_generator ? &*init_generator : nullptr;
    for (auto& [name, m] : found) {
        std::shared_ptr<LoRALayer> layer;
        if (auto* linear = dynamic_cast<AdaptableLinearImpl*>(m)) {
            layer = std::make_shared<LoRALayer>(*linear, config.rank, alpha, config, gen);
            linear->set_adapter(layer);
        } else {
            auto* conv = dynamic_cast<AdaptableConv2dImpl*>(m);
            layer = std::make_shared<LoRALayer>(*conv, config.rank, alpha, config, gen);
            conv->set_adapter(layer);
        }
        entries.push_back({name, std::move(layer)});
    }
    // q/k/v (and cross-attention k/v) weights back to back, for the fused projections (lora_qkv.h),
    // only when they are on: laying them out copies every such weight. Reading the switch here also
    // refuses a bad DTUNE_FUSED_QKV at setup rather than at the first step.
    const int64_t groups = fused_qkv_lora_enabled() ? pack_lora_projection_groups(root) : 0;
    if (config.dropout > 0.0) (void)lora_dropout_kernels_enabled();  // a bad DTUNE_LORA_DROPOUT_KERNELS, too
    log::info() << "LoRA: " << entries.size() << " layers adapted (rank " << config.rank << ", alpha "
                << alpha << (config.use_dora ? ", DoRA" : "") << ")";
    if (groups > 0) log::debug() << "LoRA: " << groups << " q/k/v groups laid out for the fused projections";
    return LoRAAdapters(config, std::move(entries));
}

}  // namespace dtune::models
