// Counter-based dropout (see hash_dropout.h): one custom autograd function whose forward and
// backward are the same masked scale.
#include "models/common/hash_dropout.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include "core/error.h"
#include "models/common/hash_dropout_math.h"

#ifdef DTUNE_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>

#include "models/common/cuda_launch.h"
#include "models/cuda/hash_dropout_kernels.h"
#endif

namespace dtune::models {
namespace {

namespace math = hash_dropout_math;

struct Rule {
    uint64_t salt;
    uint32_t threshold;
    float scale;
    int64_t index_offset;
};

// in and out contiguous (same layout), on the CPU; seed a CPU int64 scalar. add: out += masked in,
// rounded once as the CUDA kernel does.
void cpu_apply(const at::Tensor& in, at::Tensor& out, uint64_t seed, const Rule& r, bool add = false) {
    const uint64_t key = math::layer_key(seed, r.salt);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.scalar_type(), "hash_dropout_cpu", [&] {
        using opmath = at::opmath_type<scalar_t>;
        const scalar_t* src = in.const_data_ptr<scalar_t>();
        scalar_t* dst = out.mutable_data_ptr<scalar_t>();
        const opmath scale = static_cast<opmath>(r.scale);
        at::parallel_for(0, in.numel(), 4096, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) {
                const bool kept = math::keep(key, static_cast<uint64_t>(r.index_offset + i), r.threshold);
                const opmath v = kept ? static_cast<opmath>(src[i]) * scale : opmath(0);
                dst[i] = static_cast<scalar_t>(add ? static_cast<opmath>(dst[i]) + v : v);
            }
        });
    });
}

// Masked scale of `x` laid out in `format` (forward: x; backward: the incoming gradient).
at::Tensor masked_scale(const at::Tensor& x, const at::Tensor& seed, const Rule& r, at::MemoryFormat format) {
    const at::Tensor in = x.contiguous(format);
    at::Tensor out = at::empty_like(in, in.options(), format);
    if (in.numel() == 0) return out;
#ifdef DTUNE_WITH_CUDA_KERNELS
    if (in.is_cuda()) {
        const c10::cuda::CUDAGuard guard(in.device());
        check_launch(
            cuda::hash_dropout(in.const_data_ptr(), out.mutable_data_ptr(), in.numel(),
                               seed.const_data_ptr<int64_t>(), r.salt, r.index_offset, r.threshold, r.scale,
                               kernel_dtype(in.scalar_type(), "hash_dropout"), current_stream_of(in)),
            "hash_dropout", "forward");
        return out;
    }
#endif
    if (in.is_cpu()) {
        cpu_apply(in, out, static_cast<uint64_t>(seed.item<int64_t>()), r);
        return out;
    }
    // Another device, or CUDA without the kernels: the same rule through the CPU.
    at::Tensor host_out = at::empty_like(in, in.options().device(at::kCPU), format);
    cpu_apply(in.cpu(), host_out, static_cast<uint64_t>(seed.item<int64_t>()), r);
    return host_out.to(in.device());
}

// dst += masked scale of src: one pass on CUDA. dst and src alike (shape, dtype, device), dst
// contiguous.
void masked_scale_add(at::Tensor& dst, const at::Tensor& src, const at::Tensor& seed, const Rule& r) {
    const at::Tensor in = src.contiguous();
    if (in.numel() == 0) return;
#ifdef DTUNE_WITH_CUDA_KERNELS
    if (in.is_cuda()) {
        const c10::cuda::CUDAGuard guard(in.device());
        check_launch(cuda::hash_dropout_add(
                         in.const_data_ptr(), dst.mutable_data_ptr(), in.numel(),
                         seed.const_data_ptr<int64_t>(), r.salt, r.index_offset, r.threshold, r.scale,
                         kernel_dtype(in.scalar_type(), "hash_dropout"), current_stream_of(in)),
                     "hash_dropout", "add");
        return;
    }
#endif
    if (in.is_cpu()) {
        cpu_apply(in, dst, static_cast<uint64_t>(seed.item<int64_t>()), r, /*add=*/true);
        return;
    }
    at::Tensor host = dst.cpu();
    cpu_apply(in.cpu(), host, static_cast<uint64_t>(seed.item<int64_t>()), r, /*add=*/true);
    dst.copy_(host);
}

struct HashDropoutFunction : public torch::autograd::Function<HashDropoutFunction> {
    static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                              const at::Tensor& seed, int64_t salt, double p, int64_t index_offset) {
        const at::MemoryFormat format = x.suggest_memory_format();
        // The seed is refreshed in place every step, after this step's backward: kept as data, not
        // as a saved variable (whose version check would see the next step's refresh).
        ctx->saved_data["seed"] = seed;
        ctx->saved_data["salt"] = salt;
        ctx->saved_data["p"] = p;
        ctx->saved_data["offset"] = index_offset;
        ctx->saved_data["channels_last"] = format == at::MemoryFormat::ChannelsLast;
        return masked_scale(x, seed, rule(salt, p, index_offset), format);
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const auto& d = ctx->saved_data;
        const at::MemoryFormat format =
            d.at("channels_last").toBool() ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
        const at::Tensor gx =
            masked_scale(grads[0], d.at("seed").toTensor(),
                         rule(d.at("salt").toInt(), d.at("p").toDouble(), d.at("offset").toInt()), format);
        return {gx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    static Rule rule(int64_t salt, double p, int64_t offset) {
        return Rule{static_cast<uint64_t>(salt), math::threshold_for(p), static_cast<float>(1.0 / (1.0 - p)),
                    offset};
    }
};

void check_args(const at::Tensor& x, const at::Tensor& seed, double p) {
    DTUNE_CHECK(p >= 0.0 && p < 1.0, "hash_dropout: p must be in [0, 1) (got ", p, ")");
    DTUNE_CHECK(seed.defined() && seed.numel() == 1 && seed.scalar_type() == at::kLong,
                "hash_dropout: the seed must be one int64 element");
    DTUNE_CHECK(seed.device() == x.device(), "hash_dropout: the seed is on ", seed.device().str(),
                " but the input on ", x.device().str());
}

}  // namespace

at::Tensor hash_dropout(const at::Tensor& x, const at::Tensor& seed, uint64_t salt, double p,
                        int64_t index_offset) {
    check_args(x, seed, p);
    if (p == 0.0) return x;
    return HashDropoutFunction::apply(x, seed, static_cast<int64_t>(salt), p, index_offset);
}

at::Tensor hash_dropout_no_grad(const at::Tensor& x, const at::Tensor& seed, uint64_t salt, double p,
                                int64_t index_offset) {
    check_args(x, seed, p);
    if (p == 0.0) return x;
    return masked_scale(x, seed, HashDropoutFunction::rule(static_cast<int64_t>(salt), p, index_offset),
                        x.suggest_memory_format());
}

void hash_dropout_add_(at::Tensor& dst, const at::Tensor& src, const at::Tensor& seed, uint64_t salt,
                       double p, int64_t index_offset) {
    check_args(src, seed, p);
    DTUNE_CHECK(
        dst.sizes() == src.sizes() && dst.scalar_type() == src.scalar_type() &&
            dst.device() == src.device() && dst.is_contiguous(),
        "hash_dropout_add_: dst must be a contiguous tensor shaped like src, of its dtype and device");
    if (p == 0.0) {
        dst.add_(src);
        return;
    }
    masked_scale_add(dst, src, seed, HashDropoutFunction::rule(static_cast<int64_t>(salt), p, index_offset));
}

}  // namespace dtune::models
