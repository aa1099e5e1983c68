// LoRA's masked adapter products (see lora_dropout.h): the CUDA kernels where they apply, else the
// composite ops the fused LoRA functions used before the kernels.
#include "models/common/lora_dropout.h"

#include <atomic>
#include <cstdlib>
#include <optional>

#include "core/error.h"
#include "core/fused_env.h"
#include "models/common/hash_dropout.h"
#include "models/common/hash_dropout_math.h"

#ifdef DTUNE_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>

#include "models/common/cuda_launch.h"
#include "models/cuda/lora_dropout_kernels.h"
#endif

namespace dtune::models {
namespace {

// Read on first use (not during static initialisation: a bad value must reach the CLI as a
// UsageError naming the variable).
LoRADropoutKernels initial_mode() {
    const char* v = std::getenv("DTUNE_LORA_DROPOUT_KERNELS");
    // Unset: tensor cores only (173 against 177 ms on an H200, BENCHMARKS.md).
    if (v == nullptr || *v == '\0') return LoRADropoutKernels::kTensorCores;
    const std::optional<bool> on = parse_fused_kernels_value(v);
    DTUNE_CHECK_AS(
        UsageError, on.has_value(), "DTUNE_LORA_DROPOUT_KERNELS=", v,
        " is not a choice: leave it unset (LoRA dropout read inside the adapter's kernels for "
        "bf16 and fp16), or use 1 (float32 too) or 0 (a masked copy of the input, then the GEMMs)");
    return *on ? LoRADropoutKernels::kAll : LoRADropoutKernels::kOff;
}

std::atomic<LoRADropoutKernels>& kernels_mode() {
    static std::atomic<LoRADropoutKernels> mode{initial_mode()};
    return mode;
}

bool active(const LoRADropoutMask& m) {
    return m.seed.defined() && m.p > 0.0;
}

#ifdef DTUNE_WITH_CUDA_KERNELS
// The mask as the kernels read it: one int64 seed on x's device, p in (0, 1).
bool kernel_mask_ok(const LoRADropoutMask& m, const at::Tensor& x) {
    return active(m) && m.p < 1.0 && m.seed.numel() == 1 && m.seed.scalar_type() == at::kLong &&
           m.seed.device() == x.device();
}

// The rule for operands x (or dx) [N, in]; the recorded decisions ride along where they match x.
cuda::DropoutRule rule_of(const LoRADropoutMask& m, const at::Tensor& x) {
    cuda::DropoutRule rule{m.seed.const_data_ptr<int64_t>(), m.salt, m.index_offset,
                           hash_dropout_math::threshold_for(m.p), static_cast<float>(1.0 / (1.0 - m.p))};
    const at::Tensor& k = m.keep;
    if (k.defined() && k.scalar_type() == at::kByte && k.device() == x.device() && k.is_contiguous() &&
        k.sizes() == at::IntArrayRef{x.size(0), x.size(1) / 8})
        rule.keep_in = k.const_data_ptr<uint8_t>();
    return rule;
}

bool aligned16(const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

// gh or h: [N, r] in x2's dtype on its device, unit column stride.
bool rows_ok(const at::Tensor& t, const at::Tensor& x2, int64_t r) {
    return t.dim() == 2 && t.size(0) == x2.size(0) && t.size(1) == r && t.scalar_type() == x2.scalar_type() &&
           t.device() == x2.device() && (t.stride(1) == 1 || r == 1) && t.stride(0) >= r;
}

// x2 (or dx) as the kernels read it, in a dtype the mode gives them. The mask's own argument errors
// are left to hash_dropout's checks on the composite path.
bool input_ok(const at::Tensor& x2) {
    const auto t = x2.scalar_type();
    if (!(x2.is_cuda() && x2.dim() == 2 && x2.is_contiguous() && x2.size(0) >= cuda::kLoRADropoutMinRows &&
          x2.size(1) % 8 == 0 && (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf) && aligned16(x2) &&
          lora_dropout_kernels_enabled()))
        return false;
    if (kernels_mode() == LoRADropoutKernels::kAll) return true;
    return cuda::lora_dropout_tensor_cores(kernel_dtype(t, "lora_dropout_kernels_take"), x2.get_device());
}

// The rules of a group of `count` adapters of rank r that read x (or write dx) [N, in] with gh
// [N, count·r], where the tensor-core group kernels take them (16-bit x, every mask active, at most
// kLoRAMaxGroup adapters); nullopt otherwise: the caller goes adapter by adapter.
std::optional<cuda::DropoutRules> group_rules(const at::Tensor& x, const at::Tensor& gh, int64_t count,
                                              int64_t r, const std::vector<LoRADropoutMask>& masks,
                                              const char* what) {
    if (!(count <= cuda::kLoRAMaxGroup && r <= cuda::kLoRADropoutMaxRank && input_ok(x) &&
          x.scalar_type() != at::kFloat && rows_ok(gh, x, count * r) &&
          cuda::lora_dropout_tensor_cores(kernel_dtype(x.scalar_type(), what), x.get_device())))
        return std::nullopt;
    cuda::DropoutRules rules;
    rules.count = static_cast<int>(count);
    for (int64_t i = 0; i < count; ++i) {
        if (!kernel_mask_ok(masks[i], x)) return std::nullopt;
        rules.rule[i] = rule_of(masks[i], x);
    }
    return rules;
}
#endif

}  // namespace

void set_lora_dropout_kernels(LoRADropoutKernels mode) {
    kernels_mode() = mode;
}

LoRADropoutKernels lora_dropout_kernels_mode() {
    return kernels_mode();
}

bool lora_dropout_kernels_enabled() {
    return kernels_mode() != LoRADropoutKernels::kOff && fused_kernels_allowed();
}

bool lora_dropout_kernels_take(const at::Tensor& x2, const at::Tensor& a) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    return input_ok(x2) && a.dim() == 2 && a.is_contiguous() && a.scalar_type() == x2.scalar_type() &&
           a.device() == x2.device() && a.size(1) == x2.size(1) && a.size(0) >= 1 &&
           a.size(0) <= cuda::kLoRADropoutMaxRank && aligned16(a);
#else
    (void)x2;
    (void)a;
    return false;
#endif
}

at::Tensor lora_masked_down(const at::Tensor& x2, const at::Tensor& a, const LoRADropoutMask& m,
                            at::Tensor* keep) {
    at::Tensor h = at::empty({x2.size(0), a.size(0)}, x2.options());
    lora_masked_down_out(h, x2, a, m, keep);
    return h;
}

void lora_masked_down_out(at::Tensor& h, const at::Tensor& x2, const at::Tensor& a, const LoRADropoutMask& m,
                          at::Tensor* keep) {
    if (keep != nullptr) *keep = at::Tensor();
#ifdef DTUNE_WITH_CUDA_KERNELS
    if (kernel_mask_ok(m, x2) && lora_dropout_kernels_take(x2, a) && rows_ok(h, x2, a.size(0))) {
        const c10::cuda::CUDAGuard guard(x2.device());
        const cuda::KernelDtype kt = kernel_dtype(x2.scalar_type(), "lora_masked_down");
        cuda::DropoutRule rule = rule_of(m, x2);
        rule.keep_in = nullptr;
        if (keep != nullptr && cuda::lora_dropout_tensor_cores(kt, x2.get_device())) {
            *keep = at::empty({x2.size(0), x2.size(1) / 8}, x2.options().dtype(at::kByte));
            rule.keep_out = keep->mutable_data_ptr<uint8_t>();
        }
        check_launch(
            cuda::lora_masked_down(x2.const_data_ptr(), a.const_data_ptr(), h.mutable_data_ptr(), h.stride(0),
                                   x2.size(0), x2.size(1), a.size(0), rule, kt, current_stream_of(x2)),
            "lora_masked_down", "forward");
        return;
    }
#endif
    const at::Tensor xd = active(m) ? hash_dropout_no_grad(x2, m.seed, m.salt, m.p, m.index_offset) : x2;
    at::mm_out(h, xd, a.t());
}

at::Tensor lora_masked_down_grad(const at::Tensor& gh, const at::Tensor& x2, const LoRADropoutMask& m,
                                 at::ScalarType out_dtype) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    const int64_t r = gh.size(1);
    if (kernel_mask_ok(m, x2) && r >= 1 && r <= cuda::kLoRADropoutMaxRank && input_ok(x2) &&
        rows_ok(gh, x2, r)) {
        const c10::cuda::CUDAGuard guard(x2.device());
        const int64_t n = x2.size(0), k = x2.size(1);
        at::Tensor da = at::empty({r, k}, x2.options().dtype(at::kFloat));
        const cuda::KernelDtype kt = kernel_dtype(x2.scalar_type(), "lora_masked_down_grad");
        at::Tensor partials =
            at::empty({cuda::lora_masked_down_grad_splits(n, k, kt), r, k}, x2.options().dtype(at::kFloat));
        check_launch(
            cuda::lora_masked_down_grad(gh.const_data_ptr(), gh.stride(0), x2.const_data_ptr(),
                                        partials.mutable_data_ptr<float>(), da.mutable_data_ptr<float>(), n,
                                        k, r, rule_of(m, x2), kt, current_stream_of(x2)),
            "lora_masked_down_grad", "backward");
        return da.to(out_dtype);
    }
#endif
    const at::Tensor xd = active(m) ? hash_dropout_no_grad(x2, m.seed, m.salt, m.p, m.index_offset) : x2;
    // Straight into the factor's dtype where the GEMM can write it (CUDA).
    const bool direct = gh.is_cuda() && gh.scalar_type() != at::kFloat;
    return direct ? at::mm(gh.t(), xd, out_dtype) : at::mm(gh.t(), xd).to(out_dtype);
}

void lora_masked_up_add_(at::Tensor& dx, const at::Tensor& gh, const at::Tensor& a,
                         const LoRADropoutMask& m) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    if (kernel_mask_ok(m, dx) && dx.sizes() == at::IntArrayRef{gh.size(0), a.size(1)} &&
        lora_dropout_kernels_take(dx, a) && rows_ok(gh, dx, a.size(0))) {
        const c10::cuda::CUDAGuard guard(dx.device());
        check_launch(cuda::lora_masked_up_add(
                         dx.mutable_data_ptr(), gh.const_data_ptr(), gh.stride(0), a.const_data_ptr(),
                         dx.size(0), dx.size(1), a.size(0), rule_of(m, dx),
                         kernel_dtype(dx.scalar_type(), "lora_masked_up_add_"), current_stream_of(dx)),
                     "lora_masked_up_add_", "backward");
        return;
    }
#endif
    if (active(m))
        hash_dropout_add_(dx, at::mm(gh, a), m.seed, m.salt, m.p, m.index_offset);  // one pass
    else
        dx.addmm_(gh, a);
}

std::vector<at::Tensor> lora_masked_down_grad_group(const at::Tensor& gh, const at::Tensor& x2,
                                                    const std::vector<LoRADropoutMask>& masks,
                                                    const std::vector<at::ScalarType>& out_dtypes) {
    const auto count = static_cast<int64_t>(masks.size());
    DTUNE_CHECK(count >= 1 && out_dtypes.size() == masks.size() && gh.dim() == 2 && gh.size(1) % count == 0,
                "lora_masked_down_grad_group: gh ", gh.sizes(), " does not hold ", count,
                " adapters of one rank (with ", out_dtypes.size(), " output dtypes)");
    const int64_t r = gh.size(1) / count;
    std::vector<at::Tensor> out;
#ifdef DTUNE_WITH_CUDA_KERNELS
    if (const auto rules = group_rules(x2, gh, count, r, masks, "lora_masked_down_grad_group")) {
        const c10::cuda::CUDAGuard guard(x2.device());
        const int64_t n = x2.size(0), k = x2.size(1);
        const cuda::KernelDtype kt = kernel_dtype(x2.scalar_type(), "lora_masked_down_grad_group");
        at::Tensor da = at::empty({count * r, k}, x2.options().dtype(at::kFloat));
        at::Tensor partials = at::empty({cuda::lora_masked_down_grad_splits(n, k, kt), count * r, k},
                                        x2.options().dtype(at::kFloat));
        check_launch(cuda::lora_masked_down_grad_group(gh.const_data_ptr(), gh.stride(0), x2.const_data_ptr(),
                                                       partials.mutable_data_ptr<float>(),
                                                       da.mutable_data_ptr<float>(), n, k, r, *rules, kt,
                                                       current_stream_of(x2)),
                     "lora_masked_down_grad_group", "backward");
        for (int64_t i = 0; i < count; ++i) out.push_back(da.narrow(0, i * r, r).to(out_dtypes[i]));
        return out;
    }
#endif
    for (int64_t i = 0; i < count; ++i)
        out.push_back(lora_masked_down_grad(gh.narrow(1, i * r, r), x2, masks[i], out_dtypes[i]));
    return out;
}

void lora_masked_up_add_group_(at::Tensor& dx, const at::Tensor& gh, const at::Tensor& a,
                               const std::vector<LoRADropoutMask>& masks) {
    const auto count = static_cast<int64_t>(masks.size());
    DTUNE_CHECK(
        count >= 1 && gh.dim() == 2 && gh.size(1) % count == 0 && a.dim() == 2 && a.size(0) == gh.size(1),
        "lora_masked_up_add_group_: gh ", gh.sizes(), " and a ", a.sizes(), " do not hold ", count,
        " adapters of one rank");
    const int64_t r = gh.size(1) / count;
#ifdef DTUNE_WITH_CUDA_KERNELS
    const bool a_ok = dx.sizes() == at::IntArrayRef{gh.size(0), a.size(1)} && a.is_contiguous() &&
                      a.scalar_type() == dx.scalar_type() && a.device() == dx.device() && aligned16(a);
    const auto rules =
        a_ok ? group_rules(dx, gh, count, r, masks, "lora_masked_up_add_group_") : std::nullopt;
    if (rules) {
        const c10::cuda::CUDAGuard guard(dx.device());
        check_launch(cuda::lora_masked_up_add_group(
                         dx.mutable_data_ptr(), gh.const_data_ptr(), gh.stride(0), a.const_data_ptr(),
                         dx.size(0), dx.size(1), r, *rules,
                         kernel_dtype(dx.scalar_type(), "lora_masked_up_add_group_"), current_stream_of(dx)),
                     "lora_masked_up_add_group_", "backward");
        return;
    }
#endif
    for (int64_t i = 0; i < count; ++i)
        lora_masked_up_add_(dx, gh.narrow(1, i * r, r), a.narrow(0, i * r, r), masks[i]);
}

}  // namespace dtune::models
