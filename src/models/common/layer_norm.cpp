// Fused LayerNorm and residual add + LayerNorm (see layer_norm.h).
#include "models/common/layer_norm.h"

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "core/fused_env.h"
#include "models/common/blocks.h"

#ifdef DTUNE_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>

#include "models/common/cuda_launch.h"
#include "models/cuda/group_norm_kernels.h"
#include "models/cuda/layer_norm_kernels.h"
#endif

namespace dtune::models {
namespace {

// set_fused_layer_norm: 0 off, 1 on, -1 (reset_fused_layer_norm): DTUNE_FUSED_LAYER_NORM decides.
std::atomic<int> g_switch{-1};

// DTUNE_FUSED_LAYER_NORM, read once, on first use: unset or "auto" -1 (the kernels where the norm's
// weight and bias take no gradient), 1 on, 0 off.
int env_choice() {
    static const int choice = [] {
        const char* v = std::getenv("DTUNE_FUSED_LAYER_NORM");
        if (!v || *v == '\0' || std::string(v) == "auto") return -1;
        const auto on = parse_fused_kernels_value(v);
        DTUNE_CHECK_AS(UsageError, on.has_value(), "DTUNE_FUSED_LAYER_NORM='", v,
                       "' is not understood; use auto (or unset: where the norm's weights are frozen), "
                       "1 (on/true: everywhere) or 0 (off/false)");
        return *on ? 1 : 0;
    }();
    return choice;
}

// 1 on, 0 off, -1 auto.
int fused_choice() {
    const int chosen = g_switch;
    return chosen < 0 ? env_choice() : chosen;
}

#ifdef DTUNE_WITH_CUDA_KERNELS
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A weight or bias as the kernels read it: float32, or the data's dtype, contiguous and 16-byte
// aligned; other dtypes (and odd layouts) as a float32 copy.
at::Tensor kernel_param(const at::Tensor& p, at::ScalarType data) {
    const bool direct = (p.scalar_type() == at::kFloat || p.scalar_type() == data) && p.is_contiguous() &&
                        reinterpret_cast<uintptr_t>(p.const_data_ptr()) % 16 == 0;
    return direct ? p : p.to(at::kFloat).contiguous();
}

// Runs the forward kernel: h (when b is defined) and y written, (mean, rstd) per row returned.
at::Tensor run_forward(const at::Tensor& a, const at::Tensor& b, at::Tensor& h, at::Tensor& y,
                       const at::Tensor& weight, const at::Tensor& bias, double eps) {
    const c10::cuda::CUDAGuard guard(a.device());
    const int64_t c = a.size(-1), rows = a.numel() / c;
    // The bias in the weight's dtype, so that one flag says how to read both.
    const at::Tensor w = kernel_param(weight, a.scalar_type());
    const at::Tensor bb = bias.scalar_type() == w.scalar_type() ? kernel_param(bias, a.scalar_type())
                                                                : bias.to(w.scalar_type()).contiguous();
    at::Tensor mean_rstd = at::empty({rows, 2}, a.options().dtype(at::kFloat));
    cuda::AddLayerNormArgs args;
    args.a = a.const_data_ptr();
    args.b = b.defined() ? b.const_data_ptr() : nullptr;
    args.h = b.defined() ? h.mutable_data_ptr() : nullptr;
    args.y = y.mutable_data_ptr();
    args.weight = w.const_data_ptr();
    args.bias = bb.const_data_ptr();
    args.params_float = w.scalar_type() == at::kFloat;
    args.mean_rstd = mean_rstd.mutable_data_ptr<float>();
    args.rows = rows, args.c = c, args.eps = eps;
    args.dtype = kernel_dtype(a.scalar_type(), "layer_norm");
    args.sm_count = cuda::current_device_sm_count();
    check_launch(cuda::add_layer_norm(args, current_stream_of(a)), "layer_norm", "forward");
    return mean_rstd;
}

// dh = dh_in + LayerNorm'(dy) at input h; the affine gradients when wanted (weight and bias).
variable_list run_backward(const at::Tensor& dy_in, const at::Tensor& dh_in_raw, const at::Tensor& h,
                           const at::Tensor& mean_rstd, const at::Tensor& weight, const at::Tensor& bias,
                           bool need_w, bool need_b) {
    const c10::cuda::CUDAGuard guard(h.device());
    const int64_t c = h.size(-1), rows = h.numel() / c;
    const int sm_count = cuda::current_device_sm_count();
    const at::Tensor dy = dy_in.defined() ? dy_in.to(h.scalar_type()).contiguous() : at::zeros_like(h);
    const at::Tensor dh_in = dh_in_raw.defined() ? dh_in_raw.to(h.scalar_type()).contiguous() : at::Tensor();
    const at::Tensor w = kernel_param(weight, h.scalar_type());
    at::Tensor dh = at::empty_like(h);
    const bool affine = need_w || need_b;
    const int64_t parts = cuda::add_layer_norm_parts(rows, sm_count);
    at::Tensor dw_part = affine ? at::empty({parts, c}, h.options().dtype(at::kFloat)) : at::Tensor();
    at::Tensor db_part = affine ? at::empty({parts, c}, h.options().dtype(at::kFloat)) : at::Tensor();
    cuda::AddLayerNormBackwardArgs args;
    args.dy = dy.const_data_ptr();
    args.dh_in = dh_in.defined() ? dh_in.const_data_ptr() : nullptr;
    args.h = h.const_data_ptr();
    args.mean_rstd = mean_rstd.const_data_ptr<float>();
    args.weight = w.const_data_ptr();
    args.params_float = w.scalar_type() == at::kFloat;
    args.dh = dh.mutable_data_ptr();
    args.dweight_part = affine ? dw_part.mutable_data_ptr<float>() : nullptr;
    args.dbias_part = affine ? db_part.mutable_data_ptr<float>() : nullptr;
    args.rows = rows, args.c = c;
    args.dtype = kernel_dtype(h.scalar_type(), "layer_norm");
    args.sm_count = sm_count;
    check_launch(cuda::add_layer_norm_backward(args, current_stream_of(h)), "layer_norm", "backward");
    return {dh, need_w ? dw_part.sum(0).to(weight.scalar_type()) : at::Tensor(),
            need_b ? db_part.sum(0).to(bias.scalar_type()) : at::Tensor()};
}

struct LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
    static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& bias, double eps) {
        const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
        at::Tensor none, y = at::empty_like(x);
        const at::Tensor mean_rstd = run_forward(x, {}, none, y, weight, bias, eps);
        ctx->save_for_backward({x, weight, bias, mean_rstd});
        return y;
    }
    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const auto s = ctx->get_saved_variables();
        variable_list g = run_backward(grads[0], {}, s[0], s[3], s[1], s[2], ctx->needs_input_grad(1),
                                       ctx->needs_input_grad(2));
        return {g[0], g[1], g[2], at::Tensor()};
    }
};

// Outputs (h, y). Backward: one gradient for a and b alike, dh + LayerNorm'(dy).
struct AddLayerNormFunction : public torch::autograd::Function<AddLayerNormFunction> {
    static variable_list forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b,
                                 const at::Tensor& weight, const at::Tensor& bias, double eps) {
        const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
        at::Tensor h = at::empty_like(a), y = at::empty_like(a);
        const at::Tensor mean_rstd = run_forward(a, b, h, y, weight, bias, eps);
        ctx->save_for_backward({h, weight, bias, mean_rstd});
        return {h, y};
    }
    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const auto s = ctx->get_saved_variables();
        variable_list g = run_backward(grads[1], grads[0], s[0], s[3], s[1], s[2], ctx->needs_input_grad(2),
                                       ctx->needs_input_grad(3));
        // The same tensor for a and b: autograd adds into a gradient in place only when nothing
        // else holds it, which is not the case for a tensor handed out twice.
        return {g[0], g[0], g[1], g[2], at::Tensor()};
    }
};
#endif

}  // namespace

void set_fused_layer_norm(bool enabled) {
    g_switch = enabled ? 1 : 0;
}

void reset_fused_layer_norm() {
    g_switch = -1;
}
bool fused_layer_norm_enabled() {
    return fused_kernels_allowed() && fused_choice() != 0;
}

bool fused_layer_norm_ready(const torch::nn::LayerNormImpl& norm, const at::Tensor& x) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    const auto t = x.scalar_type();
    // Auto: where the affine weights take no gradient (frozen, or no gradient recorded); their
    // gradients' per-block sums made a full fine-tune slower than ATen's (docs/BENCHMARKS.md).
    const bool frozen =
        !at::GradMode::is_enabled() || !((norm.weight.defined() && norm.weight.requires_grad()) ||
                                         (norm.bias.defined() && norm.bias.requires_grad()));
    if (!(fused_layer_norm_enabled() && (fused_choice() == 1 || frozen) && x.is_cuda() && x.dim() >= 1 &&
          x.numel() > 0 && (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf) && x.is_contiguous() &&
          reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 == 0 && norm.weight.defined() &&
          norm.bias.defined() && norm.options.normalized_shape().size() == 1 &&
          norm.options.normalized_shape()[0] == x.size(-1)))
        return false;
    return cuda::add_layer_norm_supported(x.size(-1), kernel_dtype(t, "layer_norm"));
#else
    (void)norm;
    (void)x;
    return false;
#endif
}

at::Tensor layer_norm(torch::nn::LayerNormImpl& norm, const at::Tensor& x) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    if (fused_layer_norm_ready(norm, x))
        return LayerNormFunction::apply(x, norm.weight, norm.bias, norm.options.eps());
#endif
    return norm_forward(norm, x);
}

std::pair<at::Tensor, at::Tensor> add_layer_norm(torch::nn::LayerNormImpl& norm, const at::Tensor& a,
                                                 const at::Tensor& b) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    if (fused_layer_norm_ready(norm, a) && b.scalar_type() == a.scalar_type() && b.sizes() == a.sizes() &&
        b.device() == a.device() && b.is_contiguous() &&
        reinterpret_cast<uintptr_t>(b.const_data_ptr()) % 16 == 0) {
        auto out = AddLayerNormFunction::apply(a, b, norm.weight, norm.bias, norm.options.eps());
        return {out[0], out[1]};
    }
#endif
    at::Tensor h = a + b;
    at::Tensor y = norm_forward(norm, h);
    return {h, y};
}

}  // namespace dtune::models
