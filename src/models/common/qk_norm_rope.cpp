// Joint q/k norm + rotary embedding (see qk_norm_rope.h): the composite ops, and the CUDA kernels
// behind one autograd function that saves the stream's q and k inputs (the norm's statistics are
// recomputed in the backward) and the rotation tables.
#include "models/common/qk_norm_rope.h"

#include <torch/autograd.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "core/error.h"
#include "core/fused_env.h"
#include "models/common/rope.h"

#ifdef DTUNE_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>

#include "models/common/cuda_launch.h"
#include "models/cuda/qk_norm_rope_kernels.h"
#endif

namespace dtune::models {
namespace {

FusedPathSwitch qk_norm_rope_switch{"DTUNE_FUSED_QK_NORM_ROPE",
                                    "q/k norm, concatenation and rotary embedding as one kernel",
                                    "the composite ops"};

#ifdef DTUNE_WITH_CUDA_KERNELS
constexpr int kInputsPerStream = 5;  // q, k, v, q weight, k weight (float32)

// The kernels' view of the streams; inputs as JointFunction takes them.
cuda::JointQKVStreams describe(at::TensorList inputs) {
    cuda::JointQKVStreams d;
    d.streams = static_cast<int>(inputs.size() / kInputsPerStream);
    for (int st = 0; st < d.streams; ++st) {
        const at::Tensor* t = inputs.data() + st * kInputsPerStream;
        d.seq[st] = t[0].size(1);
        for (int i = 0; i < 3; ++i) {
            d.src[st][i] = t[i].const_data_ptr();
            d.batch_stride[st][i] = t[i].stride(0);
            d.token_stride[st][i] = t[i].stride(1);
        }
        for (int i = 0; i < 2; ++i) d.weight[st][i] = t[3 + i].const_data_ptr<float>();
    }
    return d;
}

struct JointFunction : public torch::autograd::Function<JointFunction> {
    // inputs: per stream q, k, v [B, S_i, H·D] and the q/k norm weights as float32 [D].
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                  at::TensorList inputs, const at::Tensor& cos,
                                                  const at::Tensor& sin, int64_t heads, double eps) {
        const at::Tensor& q0 = inputs[0];
        const int64_t b = q0.size(0), dim = q0.size(2) / heads, s = cos.size(0);
        const auto options = q0.options();
        std::vector<at::Tensor> out;
        for (int i = 0; i < 3; ++i) out.push_back(at::empty({b, s, heads, dim}, options));
        const cuda::JointQKVStreams d = describe(inputs);
        void* const outs[3] = {out[0].data_ptr(), out[1].data_ptr(), out[2].data_ptr()};
        const c10::cuda::CUDAGuard guard(q0.device());
        check_launch(cuda::joint_qk_norm_rope_forward(
                         d, cos.const_data_ptr<float>(), sin.const_data_ptr<float>(), outs, b, heads, dim,
                         static_cast<float>(eps), kernel_dtype(q0.scalar_type(), "joint q/k norm"),
                         current_stream_of(q0)),
                     "joint q/k norm + rotary embedding", "forward");
        std::vector<at::Tensor> saved;  // per stream q, k, q weight, k weight; then cos, sin
        for (int st = 0; st < d.streams; ++st)
            for (int i : {0, 1, 3, 4}) saved.push_back(inputs[st * kInputsPerStream + i]);
        saved.push_back(cos);
        saved.push_back(sin);
        ctx->save_for_backward(saved);
        ctx->saved_data["heads"] = heads;
        ctx->saved_data["eps"] = eps;
        return out;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        const int64_t heads = ctx->saved_data["heads"].toInt();
        const double eps = ctx->saved_data["eps"].toDouble();
        const int streams = static_cast<int>((saved.size() - 2) / 4);
        const at::Tensor &cos = saved[saved.size() - 2], &sin = saved[saved.size() - 1];
        const at::Tensor& q0 = saved[0];
        const int64_t b = q0.size(0), inner = q0.size(2), dim = inner / heads, s = cos.size(0);
        // The kernels' input view again: v is not read by the backward, q stands in for its pointer.
        std::vector<at::Tensor> inputs;
        for (int st = 0; st < streams; ++st) {
            const at::Tensor* t = saved.data() + st * 4;
            inputs.insert(inputs.end(), {t[0], t[1], t[0], t[2], t[3]});
        }
        const cuda::JointQKVStreams d = describe(inputs);
        std::vector<at::Tensor> g(3);
        for (int i = 0; i < 3; ++i)
            g[i] = grads[i].defined() ? grads[i].to(q0.scalar_type()).contiguous()
                                      : at::zeros({b, s, heads, dim}, q0.options());
        const void* const gp[3] = {g[0].const_data_ptr(), g[1].const_data_ptr(), g[2].const_data_ptr()};
        std::vector<at::Tensor> grad_in;
        void* gin[cuda::kJointQKVMaxStreams] = {};
        for (int st = 0; st < streams; ++st) {
            grad_in.push_back(at::empty({b, d.seq[st], 3 * inner}, q0.options()));
            gin[st] = grad_in.back().data_ptr();
        }
        bool weight_grads = false;
        for (int st = 0; st < streams; ++st)
            weight_grads = weight_grads || ctx->needs_input_grad(st * kInputsPerStream + 3) ||
                           ctx->needs_input_grad(st * kInputsPerStream + 4);
        const auto dtype = kernel_dtype(q0.scalar_type(), "joint q/k norm");
        at::Tensor dweight;  // [2 (q, k), streams, blocks, D] partial sums
        if (weight_grads)
            dweight = at::empty({2, streams, cuda::joint_qkv_backward_blocks(b, s, heads, dim, dtype), dim},
                                q0.options().dtype(at::kFloat));
        const c10::cuda::CUDAGuard guard(q0.device());
        check_launch(cuda::joint_qk_norm_rope_backward(
                         d, cos.const_data_ptr<float>(), sin.const_data_ptr<float>(), gp, gin,
                         weight_grads ? dweight.mutable_data_ptr<float>() : nullptr, b, heads, dim,
                         static_cast<float>(eps), dtype, current_stream_of(q0)),
                     "joint q/k norm + rotary embedding", "backward");
        const at::Tensor dw = weight_grads ? dweight.sum(2) : at::Tensor();  // [2, streams, D]
        torch::autograd::variable_list out;
        for (int st = 0; st < streams; ++st) {
            for (int i = 0; i < 3; ++i) out.push_back(grad_in[st].narrow(2, i * inner, inner));
            for (int i = 0; i < 2; ++i)
                out.push_back(ctx->needs_input_grad(st * kInputsPerStream + 3 + i) ? dw[i][st]
                                                                                   : at::Tensor());
        }
        out.resize(out.size() + 4);  // cos, sin, heads, eps
        return out;
    }
};

// The fused path's input list, or nullopt when the kernels do not take these tensors.
std::optional<std::vector<at::Tensor>> fused_inputs(const std::vector<QKVStream>& streams, int64_t heads,
                                                    const at::Tensor& cos, const at::Tensor& sin) {
    if (!fused_qk_norm_rope_enabled() || streams.empty() ||
        static_cast<int>(streams.size()) > cuda::kJointQKVMaxStreams)
        return std::nullopt;
    const at::Tensor& q0 = streams.front().q;
    const auto dtype = q0.scalar_type();
    if (!q0.is_cuda() || q0.dim() != 3 || heads < 1 || q0.size(2) % heads != 0 ||
        (dtype != at::kBFloat16 && dtype != at::kHalf && dtype != at::kFloat))
        return std::nullopt;
    const int64_t dim = q0.size(2) / heads;
    int64_t seq = 0;
    std::vector<at::Tensor> inputs;
    for (const QKVStream& st : streams) {
        for (const at::Tensor* t : {&st.q, &st.k, &st.v}) {
            if (!t->defined() || t->device() != q0.device() || t->scalar_type() != dtype || t->dim() != 3 ||
                t->size(0) != q0.size(0) || t->size(1) != st.q.size(1) || t->size(2) != q0.size(2) ||
                t->stride(2) != 1)
                return std::nullopt;
            inputs.push_back(*t);
        }
        for (const at::Tensor* w : {&st.q_weight, &st.k_weight}) {
            if (!w->defined() || w->dim() != 1 || w->size(0) != dim || w->device() != q0.device())
                return std::nullopt;
            inputs.push_back(w->to(dtype).to(at::kFloat).contiguous());  // the composite's weight rounding
        }
        seq += st.q.size(1);
    }
    if (cos.dim() != 2 || cos.size(0) != seq || cos.size(1) != dim || sin.sizes() != cos.sizes() ||
        cos.device() != q0.device() || sin.device() != q0.device())
        return std::nullopt;
    return inputs;
}
#endif

}  // namespace

void set_fused_qk_norm_rope(bool enabled) {
    qk_norm_rope_switch.set(enabled);
}

bool fused_qk_norm_rope_enabled() {
    return qk_norm_rope_switch.enabled();
}

std::array<at::Tensor, 3> joint_qk_norm_rope_composite(const std::vector<QKVStream>& streams, int64_t heads,
                                                       double eps, const at::Tensor& cos,
                                                       const at::Tensor& sin) {
    DTUNE_CHECK_AS(UsageError,
                   !streams.empty() && streams.front().q.dim() == 3 && streams.front().q.size(2) % heads == 0,
                   "joint q/k norm: expected one or more streams of [B, S, heads·D] projections (heads ",
                   heads, ")");
    const int64_t dim = streams.front().q.size(2) / heads;
    std::vector<at::Tensor> q, k, v;
    for (const QKVStream& st : streams) {
        const auto split = [&](const at::Tensor& t) {
            return t.unflatten(-1, {heads, dim});
        };  // [B, S_i, H, D]
        q.push_back(at::rms_norm(split(st.q), {dim}, st.q_weight.to(st.q.scalar_type()), eps));
        k.push_back(at::rms_norm(split(st.k), {dim}, st.k_weight.to(st.k.scalar_type()), eps));
        v.push_back(split(st.v));
    }
    const auto join = [](const std::vector<at::Tensor>& parts) {
        return parts.size() == 1 ? parts.front() : at::cat(parts, 1);
    };
    return {rotary_embedding(join(q), cos, sin), rotary_embedding(join(k), cos, sin), join(v)};
}

std::array<at::Tensor, 3> joint_qk_norm_rope(const std::vector<QKVStream>& streams, int64_t heads, double eps,
                                             const at::Tensor& cos, const at::Tensor& sin) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    if (auto inputs = fused_inputs(streams, heads, cos, sin)) {
        const at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();
        const at::Tensor& q0 = inputs->front();
        const int64_t dim = q0.size(2) / heads;
        if (cuda::joint_qkv_supported(describe(*inputs), c.const_data_ptr<float>(), s.const_data_ptr<float>(),
                                      heads, dim, kernel_dtype(q0.scalar_type(), "joint q/k norm"))) {
            const auto out = JointFunction::apply(at::TensorList(*inputs), c, s, heads, eps);
            return {out[0], out[1], out[2]};
        }
    }
#endif
    return joint_qk_norm_rope_composite(streams, heads, eps, cos, sin);
}

}  // namespace dtune::models
