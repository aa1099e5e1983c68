// A frozen GELU MLP with the activation in the GEMM epilogues (see gelu_mlp.h): the eligibility
// check, the composite path and the autograd function over the cuBLASLt GEMMs.
#include "models/common/gelu_mlp.h"

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>

#include <atomic>

#include "core/fused_env.h"
#include "models/common/concat_gelu.h"
#include "models/common/epilogue_linear.h"
#include "models/common/quantize.h"

#ifdef DTUNE_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#endif

namespace dtune::models {
namespace {

FusedPathSwitch gelu_gemm_switch{"DTUNE_FUSED_GELU_GEMM", "the MLP GELU in the GEMM epilogues (cuBLASLt)",
                                 "separate GELU kernels"};

std::atomic<int64_t> skipped_projections{0};

// The frozen output layer of a composite MLP (plain or quantised weight, no adapter).
struct FrozenOut {
    at::Tensor weight, scale;
};

// out(z) for a caller that never reads the values (see concat_gelu_mlp's values_unused): an
// unwritten output of the layer's dtype and shape whose backward is the layer's own input gradient
// (a quantised layer's through quantized_linear_input_grad, as QuantizedLinearFunction computes it).
struct UnreadProjectionFunction : public torch::autograd::Function<UnreadProjectionFunction> {
    static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& z,
                              const FrozenOut& w) {
        const auto device = z.device().type();
        const at::ScalarType ct = at::autocast::is_autocast_enabled(device)
                                      ? at::autocast::get_autocast_dtype(device)
                                      : z.scalar_type();
        ctx->saved_data["weight"] = w.weight;
        ctx->saved_data["scale"] = w.scale.defined() ? w.scale : at::Tensor();
        ctx->saved_data["z_dtype"] = static_cast<int64_t>(z.scalar_type());
        ctx->saved_data["z_sizes"] = z.sizes().vec();
        auto sizes = z.sizes().vec();
        sizes.back() = w.weight.size(0);
        skipped_projections.fetch_add(1, std::memory_order_relaxed);
        return at::empty(sizes, z.options().dtype(ct));
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
        const at::Tensor weight = ctx->saved_data["weight"].toTensor(),
                         scale = ctx->saved_data["scale"].toTensor();
        const at::Tensor g2 = grads[0].reshape({-1, weight.size(0)});
        const at::Tensor dz = scale.defined()
                                  ? quantized_linear_input_grad(g2, weight, scale, g2.scalar_type())
                                  : at::mm(g2, weight.to(g2.scalar_type()));
        const auto z_dtype = static_cast<at::ScalarType>(ctx->saved_data["z_dtype"].toInt());
        return {dz.to(z_dtype).view(ctx->saved_data["z_sizes"].toIntVector()),
                at::Tensor()};  // + the weights
    }
};

at::Tensor composite(const at::Tensor& a, const at::Tensor& x, AdaptableLinearImpl& in,
                     AdaptableLinearImpl& out, bool values_unused) {
    const at::Tensor h = in.forward(x);
    return output_projection(a.defined() ? concat_gelu_tanh(a, h) : at::gelu(h, "tanh"), out, values_unused);
}

#ifdef DTUNE_WITH_CUDA_KERNELS
using cuda::GemmArgs;
using cuda::GemmEpilogue;

// The forward's GEMM: act = gelu(x·W_inᵀ + b_in), pre = x·W_inᵀ + b_in (when `pre` is defined).
GemmArgs input_gemm(const at::Tensor& x2, const at::Tensor& w_in, const at::Tensor& b_in, at::Tensor& act,
                    at::Tensor& pre) {
    GemmArgs g = linear_gemm_args(x2, w_in, b_in, act);
    g.aux = pre.defined() ? pre.mutable_data_ptr() : nullptr;
    g.ldaux = pre.defined() ? pre.stride(0) : 0;
    return g;
}

// The backward's GEMM: d_pre = (g·W_out[:, da:]) ⊙ gelu'(pre).
GemmArgs dgelu_gemm(const at::Tensor& g2, const at::Tensor& w_out, int64_t da, at::Tensor& d_pre,
                    const at::Tensor& pre) {
    GemmArgs g;
    g.a = g2.const_data_ptr();
    g.lda = g2.stride(0);
    g.b = static_cast<const char*>(w_out.const_data_ptr()) + da * w_out.element_size();
    g.ldb = w_out.stride(0);
    g.b_nk = false;
    g.d = d_pre.mutable_data_ptr();
    g.ldd = d_pre.stride(0);
    g.aux = const_cast<void*>(pre.const_data_ptr());
    g.ldaux = pre.stride(0);
    g.m = g2.size(0);
    g.n = pre.size(1);
    g.k = w_out.size(0);
    return g;
}

// out = cat([a, gelu(x·W_inᵀ + b_in)])·W_outᵀ + b_out. Inputs x, a and the four frozen tensors;
// gradients for x and a. Without a concatenated input, a is an empty 1-d placeholder (autograd takes
// no undefined inputs): da = 0. `values_unused` (see concat_gelu_mlp): out is left unwritten and
// the input GEMM writes only the pre-activation the backward reads; the backward is the same.
struct GeluMlpFunction : public torch::autograd::Function<GeluMlpFunction> {
    static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& a,
                              const at::Tensor& w_in, const at::Tensor& b_in, const at::Tensor& w_out,
                              const at::Tensor& b_out, bool values_unused) {
        const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
        const c10::cuda::CUDAGuard guard(x.device());
        const bool has_a = a.dim() == x.dim();
        const int64_t da = has_a ? a.size(-1) : 0, f = w_in.size(0);
        const at::Tensor x2 = x.reshape({-1, x.size(-1)});
        const int64_t rows = x2.size(0);
        const bool grad = ctx != nullptr && (x.requires_grad() || a.requires_grad());
        at::Tensor pre = grad ? at::empty({rows, f}, x.options()) : at::Tensor();
        at::Tensor act;  // gelu(x·W_inᵀ + b_in), unless only the backward's pre-activation is wanted
        if (values_unused && grad) {
            at::Tensor none;
            if (!run_epilogue_gemm(input_gemm(x2, w_in, b_in, pre, none), GemmEpilogue::kBias, x, "gelu_mlp"))
                pre = at::addmm(b_in, x2, w_in.t());
        } else {
            act = at::empty({rows, f}, x.options());
            const GemmArgs g = input_gemm(x2, w_in, b_in, act, pre);
            const GemmEpilogue e = grad ? GemmEpilogue::kGeluAuxBias : GemmEpilogue::kGeluBias;
            if (!run_epilogue_gemm(g, e, x, "gelu_mlp")) {  // no algorithm for this alignment: two passes
                const at::Tensor h = at::addmm(b_in, x2, w_in.t());
                act = at::gelu(h, "tanh");
                if (grad) pre = h;
            }
        }
        // The output projection split along its input: the activation's columns with the bias, then
        // a's accumulated onto them (no concatenated copy of a and the activation).
        at::Tensor out;
        if (values_unused && grad) {
            skipped_projections.fetch_add(1, std::memory_order_relaxed);
            out = at::empty({rows, w_out.size(0)}, x.options());
        } else {
            out = at::addmm(b_out, act, w_out.narrow(1, da, f).t());
            if (da > 0) out.addmm_(a.reshape({rows, da}), w_out.narrow(1, 0, da).t());
        }
        if (ctx != nullptr) {
            ctx->save_for_backward({pre, w_in, w_out});
            ctx->saved_data["da"] = da;
            ctx->saved_data["x_sizes"] = x.sizes().vec();
            ctx->saved_data["a_sizes"] = a.sizes().vec();
        }
        auto sizes = x.sizes().vec();
        sizes.back() = w_out.size(0);
        return out.view(sizes);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        const at::Tensor &pre = saved[0], &w_in = saved[1], &w_out = saved[2];
        const int64_t da = ctx->saved_data["da"].toInt();
        const c10::cuda::CUDAGuard guard(pre.device());
        const at::Tensor g2 = grads[0].reshape({-1, w_out.size(0)}).to(pre.scalar_type()).contiguous();
        torch::autograd::variable_list out(7);  // + the non-tensor `values_unused`
        if (da > 0 && ctx->needs_input_grad(1))
            out[1] = at::mm(g2, w_out.narrow(1, 0, da)).view(ctx->saved_data["a_sizes"].toIntVector());
        if (ctx->needs_input_grad(0)) {
            at::Tensor d_pre = at::empty_like(pre);
            const GemmArgs g = dgelu_gemm(g2, w_out, da, d_pre, pre);
            if (!run_epilogue_gemm(g, GemmEpilogue::kDGelu, pre, "gelu_mlp"))  // the product, then GELU'
                d_pre = at::gelu_backward(at::mm(g2, w_out.narrow(1, da, pre.size(1))), pre, "tanh");
            out[0] = at::mm(d_pre, w_in).view(ctx->saved_data["x_sizes"].toIntVector());
        }
        return out;
    }
};

bool plain_frozen(const AdaptableLinearImpl& l, const at::Tensor& x) {
    return l.adapter() == nullptr && !l.weight_scale.defined() && l.weight.defined() && l.bias.defined() &&
           !l.weight.requires_grad() && !l.bias.requires_grad() && l.weight.dim() == 2 &&
           l.weight.scalar_type() == x.scalar_type() && l.bias.scalar_type() == x.scalar_type() &&
           l.weight.device() == x.device() && l.bias.device() == x.device() && l.weight.stride(1) == 1 &&
           l.bias.is_contiguous();
}

#endif

}  // namespace

at::Tensor output_projection(const at::Tensor& z, AdaptableLinearImpl& out, bool values_unused) {
    const bool frozen = out.adapter() == nullptr && out.weight.defined() && !out.weight.requires_grad() &&
                        !(out.bias.defined() && out.bias.requires_grad());
    if (values_unused && frozen && at::GradMode::is_enabled() && z.requires_grad())
        return UnreadProjectionFunction::apply(z, FrozenOut{out.weight, out.weight_scale});
    return out.forward(z);
}

int64_t gelu_mlp_unread_projections() {
    return skipped_projections.load(std::memory_order_relaxed);
}

void set_fused_gelu_gemm(bool enabled) {
    gelu_gemm_switch.set(enabled);
}

bool fused_gelu_gemm_enabled() {
    return gelu_gemm_switch.enabled();
}

bool gelu_mlp_fuses(int64_t da, const at::Tensor& x, const AdaptableLinearImpl& in,
                    const AdaptableLinearImpl& out) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    const auto t = x.scalar_type();
    if (!x.is_cuda() || (t != at::kBFloat16 && t != at::kHalf) || x.dim() < 2 || !x.is_contiguous() ||
        !fused_gelu_gemm_enabled() || !plain_frozen(in, x) || !plain_frozen(out, x))
        return false;
    if (at::autocast::is_autocast_enabled(at::kCUDA) && at::autocast::get_autocast_dtype(at::kCUDA) != t)
        return false;
    const int64_t f = in.weight.size(0);
    return da >= 0 && in.weight.size(1) == x.size(-1) && out.weight.size(1) == da + f && da % 8 == 0 &&
           f % 8 == 0;
#else
    (void)da;
    (void)x;
    (void)in;
    (void)out;
    return false;
#endif
}

at::Tensor gelu_mlp(const at::Tensor& x, AdaptableLinearImpl& in, AdaptableLinearImpl& out,
                    bool values_unused) {
    return concat_gelu_mlp(at::Tensor(), x, in, out, values_unused);
}

at::Tensor concat_gelu_mlp(const at::Tensor& a, const at::Tensor& x, AdaptableLinearImpl& in,
                           AdaptableLinearImpl& out, bool values_unused) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    const bool a_fits = !a.defined() || (a.device() == x.device() && a.scalar_type() == x.scalar_type() &&
                                         a.dim() == x.dim() &&
                                         a.sizes().slice(0, a.dim() - 1) == x.sizes().slice(0, x.dim() - 1));
    if (a_fits && gelu_mlp_fuses(a.defined() ? a.size(-1) : 0, x, in, out)) {
        const at::Tensor a_arg = a.defined() ? a : at::empty({0}, x.options());
        if (!at::GradMode::is_enabled())
            return GeluMlpFunction::forward(nullptr, x, a_arg, in.weight, in.bias, out.weight, out.bias,
                                            false);
        return GeluMlpFunction::apply(x, a_arg, in.weight, in.bias, out.weight, out.bias, values_unused);
    }
#endif
    return composite(a, x, in, out, values_unused);
}

}  // namespace dtune::models
