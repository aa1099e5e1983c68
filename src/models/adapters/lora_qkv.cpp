// Fused q/k/v projections with LoRA adapters (see lora_qkv.h): the weight layout, the checks that
// pick the fused path and its autograd function.
#include "models/adapters/lora_qkv.h"

#include <torch/torch.h>

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <string>

#include "core/error.h"
#include "core/fused_env.h"
#include "models/adapters/lora.h"
#include "models/common/epilogue_linear.h"
#include "models/common/lora_dropout.h"
#include "models/common/quantize.h"

namespace dtune::models {
namespace {

// DTUNE_FUSED_QKV. On by default: with lora_dropout's group kernels an SDXL LoRA batch-4 step on an
// H200 took 157.5-158.0 against 158.9-159.9 ms layer by layer.
FusedPathSwitch fused_qkv_switch{"DTUNE_FUSED_QKV", "q/k/v LoRA layers as one function", "one by one"};

// The tensors as one view along dim 0 when they lie back to back in one storage, in order, each
// contiguous and alike in dtype, device and trailing sizes; undefined otherwise. No autograd: for
// frozen weights.
at::Tensor rows_view(const std::vector<const at::Tensor*>& parts) {
    const at::Tensor& first = *parts.front();
    if (!first.defined() || first.dim() < 1 || !first.has_storage()) return {};
    const int64_t row_numel = first.size(0) > 0 ? first.numel() / first.size(0) : 0;
    int64_t rows = 0;
    for (const at::Tensor* p : parts) {
        if (!p->defined() || p->scalar_type() != first.scalar_type() || p->device() != first.device() ||
            p->dim() != first.dim() || p->sizes().slice(1) != first.sizes().slice(1) || !p->is_contiguous() ||
            !p->has_storage() || !p->storage().is_alias_of(first.storage()) ||
            p->storage_offset() != first.storage_offset() + rows * row_numel)
            return {};
        rows += p->size(0);
    }
    std::vector<int64_t> sizes = first.sizes().vec(), strides(sizes.size(), 1);
    sizes[0] = rows;
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d)
        strides[d] = strides[d + 1] * sizes[d + 1];
    const at::NoGradGuard no_grad;
    return first.as_strided(sizes, strides, first.storage_offset());
}

// Gradients g_i [N, out_i] as one [N, Σ out_i] view when they are column slices of one buffer in
// order (SDPA's memory-efficient backward allocates q/k/v's gradients so when q/k/v are such
// slices); undefined otherwise.
at::Tensor packed_columns(const std::vector<at::Tensor>& g) {
    int64_t total = 0;
    for (const at::Tensor& t : g) {
        if (!t.defined()) return {};
        total += t.size(1);
    }
    const at::Tensor& first = g.front();
    int64_t col = 0;
    for (const at::Tensor& t : g) {
        if (t.scalar_type() != first.scalar_type() || t.size(0) != first.size(0) || t.stride(1) != 1 ||
            t.stride(0) != total || !t.has_storage() || !t.storage().is_alias_of(first.storage()) ||
            t.storage_offset() != first.storage_offset() + col)
            return {};
        col += t.size(1);
    }
    return first.as_strided({first.size(0), total}, {total, 1}, first.storage_offset());
}

// The adapters' up-projections B_i [out, r] stacked as [n, out, r] (a view where they already lie
// back to back), for batched GEMMs over the group: with one output width and one scale, the up-
// projections, g·B and the factor gradients gᵀ·h are each one strided-batched GEMM over the
// adapters' column slices, reading and writing them in place.
at::Tensor stacked_ups(const std::vector<at::Tensor>& bs) {
    std::vector<const at::Tensor*> parts;
    parts.reserve(bs.size());
    for (const at::Tensor& b : bs) parts.push_back(&b);
    const at::Tensor rows = rows_view(parts);
    const int64_t n = static_cast<int64_t>(bs.size());
    return rows.defined() ? rows.view({n, bs.front().size(0), bs.front().size(1)}) : at::stack(bs);
}

// Columns [i·w, (i+1)·w) of t [N, n·w], for i < n, as a batch [n, N, w] (a view).
at::Tensor column_batch(const at::Tensor& t, int64_t n) {
    return t.view({t.size(0), n, t.size(1) / n}).transpose(0, 1);
}

// The common scale of the adapters, or nullopt where they differ.
std::optional<double> common_scale(const std::vector<double>& scales) {
    for (const double s : scales)
        if (s != scales.front()) return std::nullopt;
    return scales.front();
}

// What the fused function needs besides x and the factors.
struct FusedSpec {
    at::Tensor weight, bias;  // [Σ out, in] and [Σ out] (or undefined): views of the packed buffer
    at::Tensor weight_scale;  // [Σ out] float32 for a quantised group (common/quantize.h), else undefined
    std::vector<int64_t> outs;
    int64_t rank = 0;
    std::vector<double> scales;
    std::vector<LoRALayer::InputDropout> dropouts;
    // The layers' compute-dtype copies of the factors (LoRAAdapters::refresh_cast_factors) where
    // every layer has them: A_1..A_n as one [n·r, in] view when they lie back to back, and each B.
    at::Tensor a_cast;
    std::vector<at::Tensor> b_casts;
};

std::optional<FusedSpec> fused_spec(const at::Tensor& x, const ProjectionGroup& group) {
    // The cheap test first: most groups outside LoRA training carry no adapter.
    if (group.size() < 2 || !group.front()->adapter() || !fused_qkv_lora_enabled()) return std::nullopt;
    FusedSpec s;
    const bool bias = group.front()->bias.defined();
    const bool quantized = group.front()->weight_scale.defined();
    for (const AdaptableLinearImpl* l : group) {
        const auto* lora = dynamic_cast<const LoRALayer*>(l->adapter());
        if (!lora || !lora->takes_whole_forward(x) || l->weight_scale.defined() != quantized ||
            l->bias.defined() != bias || (s.rank > 0 && lora->rank() != s.rank))
            return std::nullopt;
        s.rank = lora->rank();
        s.outs.push_back(l->weight.size(0));
        s.scales.push_back(lora->scale());
        s.dropouts.push_back(lora->input_dropout(x));
    }
    std::vector<const at::Tensor*> a_casts;
    for (const AdaptableLinearImpl* l : group) {
        const auto* lora = static_cast<const LoRALayer*>(l->adapter());
        if (!lora->cast_down().defined() || !lora->cast_up().defined()) {
            s.b_casts.clear();
            a_casts.clear();
            break;
        }
        a_casts.push_back(&lora->cast_down());
        s.b_casts.push_back(lora->cast_up());
    }
    if (!a_casts.empty()) s.a_cast = rows_view(a_casts);
    s.weight = packed_weight(group);
    if (bias) s.bias = packed_bias(group);
    if (quantized) s.weight_scale = packed_weight_scale(group);
    if (!s.weight.defined() || (bias && !s.bias.defined()) || (quantized && !s.weight_scale.defined()))
        return std::nullopt;
    return s;
}

// The n projections of x (see lora_qkv.h). Autograd inputs: x, then A_1..A_n, B_1..B_n (edges 0,
// 1..n, n+1..2n); backward returns one entry per forward argument, the factors flattened.
struct LoRAProjectionsFunction : public torch::autograd::Function<LoRAProjectionsFunction> {
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                  at::TensorList factors, const FusedSpec& spec) {
        const int64_t n = static_cast<int64_t>(spec.outs.size()), r = spec.rank;
        const auto device = x.device().type();
        const auto ct = at::autocast::is_autocast_enabled(device) ? at::autocast::get_autocast_dtype(device)
                                                                  : x.scalar_type();
        const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
        const at::Tensor x2 = x.reshape({-1, x.size(-1)}).to(ct);  // [N, in]
        // [Σ out, in] in the compute dtype; a quantised group is read as stored (quantize.h: the fp8
        // GEMM, or dequantised per use), here and in backward, never saved dense.
        const bool quantized = spec.weight_scale.defined();
        const at::Tensor wc = quantized ? at::Tensor() : spec.weight.to(ct);
        // [n·r, in]: A_1; ...; A_n, the layers' copies where they are in the compute dtype
        const at::Tensor ac = spec.a_cast.defined() && spec.a_cast.scalar_type() == ct
                                  ? spec.a_cast
                                  : at::cat(factors.slice(0, n)).to(ct);
        bool drop = false;
        for (const auto& d : spec.dropouts) drop = drop || d.seed.defined();
        at::Tensor h;  // [N, n·r]: adapter i's (masked x)·A_iᵀ in columns i·r .. (i+1)·r
        std::vector<at::Tensor> keeps(n);  // the masks' decisions where the kernel records them
        if (!drop) {
            h = at::mm(x2, ac.t());
        } else {
            h = at::empty({x2.size(0), n * r}, x2.options());
            for (int64_t i = 0; i < n; ++i) {
                at::Tensor hi = h.narrow(1, i * r, r);
                const auto& d = spec.dropouts[i];  // the mask read inside the product (lora_dropout.h)
                lora_masked_down_out(hi, x2, ac.narrow(0, i * r, r), {d.seed, d.salt, d.p, d.index_offset},
                                     &keeps[i]);
            }
        }
        std::vector<at::Tensor> saved{x2, wc, ac, h};
        std::vector<at::Tensor> bcs;  // [out_i, r] in the compute dtype
        for (int64_t i = 0; i < n; ++i) {
            const bool copied =
                i < static_cast<int64_t>(spec.b_casts.size()) && spec.b_casts[i].scalar_type() == ct;
            bcs.push_back(copied ? spec.b_casts[i] : factors[n + i].to(ct));
        }
        // y = x·Wᵀ + b + Σ s_i·h_i·B_iᵀ. Where cuBLASLt takes it (add_linear_), the up-projections
        // are written first and the base GEMM adds itself and the bias onto them in its epilogue;
        // else the base GEMM first and each up-projection added onto its columns.
        const int64_t total = std::accumulate(spec.outs.begin(), spec.outs.end(), int64_t{0});
        at::Tensor y;
        const at::Tensor bias = spec.bias.defined() ? spec.bias.to(ct) : at::Tensor();
        // With one scale and one width the up-projections are one batched GEMM over y's column
        // slices (b3 saved for the backward's g·B the same way).
        const std::optional<double> scale = common_scale(spec.scales);
        const bool same_outs = std::all_of(spec.outs.begin(), spec.outs.end(),
                                           [&](int64_t o) { return o == spec.outs.front(); });
        const at::Tensor b3 = scale && same_outs ? stacked_ups(bcs) : at::Tensor();  // [n, out, r]
        if (!quantized && add_linear_applies(x2, wc, bias)) {
            y = at::empty({x2.size(0), total}, x2.options());
            if (b3.defined()) {
                at::Tensor y3 = column_batch(y, n);
                at::baddbmm_out(y3, y3, column_batch(h, n), b3.transpose(1, 2), 0.0, *scale);
            } else {
                for (int64_t i = 0, c = 0; i < n; c += spec.outs[i], ++i) {
                    at::Tensor yi = y.narrow(1, c, spec.outs[i]);
                    at::addmm_out(yi, yi, h.narrow(1, i * r, r), bcs[i].t(), 0.0, spec.scales[i]);
                }
            }
            if (!add_linear_(y, x2, wc, bias)) y.add_(at::addmm(bias, x2, wc.t()));  // no cuBLASLt algorithm
        } else {
            y = quantized        ? quantized_linear_no_grad(x2, spec.weight, spec.weight_scale, spec.bias, ct)
                : bias.defined() ? at::addmm(bias, x2, wc.t())
                                 : at::mm(x2, wc.t());
            if (b3.defined()) {
                at::Tensor y3 = column_batch(y, n);
                y3.baddbmm_(column_batch(h, n), b3.transpose(1, 2), 1.0, *scale);
            } else {
                for (int64_t i = 0, c = 0; i < n; c += spec.outs[i], ++i)
                    y.narrow(1, c, spec.outs[i])
                        .addmm_(h.narrow(1, i * r, r), bcs[i].t(), 1.0, spec.scales[i]);
            }
        }
        std::vector<int64_t> a_dtypes, b_dtypes;
        saved.push_back(b3);
        for (int64_t i = 0; i < n; ++i) {
            saved.push_back(bcs[i]);
            a_dtypes.push_back(static_cast<int64_t>(factors[i].scalar_type()));
            b_dtypes.push_back(static_cast<int64_t>(factors[n + i].scalar_type()));
            const auto& d = spec.dropouts[i];
            if (!d.seed.defined()) continue;
            const std::string k = std::to_string(i);
            ctx->saved_data["drop_seed" + k] = d.seed;
            ctx->saved_data["drop_salt" + k] = static_cast<int64_t>(d.salt);
            ctx->saved_data["drop_p" + k] = d.p;
            ctx->saved_data["drop_offset" + k] = d.index_offset;
            // The backward kernels read the decisions instead of hashing every element again.
            if (keeps[i].defined()) ctx->saved_data["drop_keep" + k] = keeps[i];
        }
        ctx->save_for_backward(saved);
        if (quantized) {
            ctx->saved_data["q_weight"] = spec.weight;
            ctx->saved_data["q_scale"] = spec.weight_scale;
        }
        ctx->saved_data["outs"] = spec.outs;
        ctx->saved_data["rank"] = r;
        ctx->saved_data["scales"] = spec.scales;
        ctx->saved_data["drop"] = drop;
        ctx->saved_data["a_dtypes"] = a_dtypes;
        ctx->saved_data["b_dtypes"] = b_dtypes;
        ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
        ctx->saved_data["x_sizes"] = x.sizes().vec();
        auto sizes = x.sizes().vec();
        sizes.back() = total;
        return y.view(sizes).split_with_sizes(spec.outs, -1);  // views: column slices of y
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        const at::Tensor &x2 = saved[0], &wc = saved[1], &ac = saved[2], &h = saved[3], &b3 = saved[4];
        const auto outs = ctx->saved_data["outs"].toIntVector();
        const auto scales = ctx->saved_data["scales"].toDoubleVector();
        const auto a_dtypes = ctx->saved_data["a_dtypes"].toIntVector();
        const auto b_dtypes = ctx->saved_data["b_dtypes"].toIntVector();
        const int64_t n = static_cast<int64_t>(outs.size()), r = ctx->saved_data["rank"].toInt();
        const bool drop = ctx->saved_data["drop"].toBool();
        std::vector<LoRADropoutMask> drops(n);
        for (int64_t i = 0; drop && i < n; ++i) {
            const std::string k = std::to_string(i);
            if (!ctx->saved_data.count("drop_seed" + k)) continue;
            drops[i] = {ctx->saved_data["drop_seed" + k].toTensor(),
                        static_cast<uint64_t>(ctx->saved_data["drop_salt" + k].toInt()),
                        ctx->saved_data["drop_p" + k].toDouble(), ctx->saved_data["drop_offset" + k].toInt()};
            if (ctx->saved_data.count("drop_keep" + k))
                drops[i].keep = ctx->saved_data["drop_keep" + k].toTensor();
        }
        const int64_t rows = x2.size(0);
        std::vector<at::Tensor> g(n);  // [N, out_i]; undefined: that output was not used
        for (int64_t i = 0; i < n; ++i)
            if (grads[i].defined()) g[i] = grads[i].reshape({-1, outs[i]}).to(x2.scalar_type());
        // s_i·g_i·B_i into columns i·r .. of gh [N, n·r] (zero for an unused output): one batched
        // GEMM where the gradients lie side by side in one buffer.
        const at::Tensor g_cat = packed_columns(g);
        const bool batched = b3.defined() && g_cat.defined();
        at::Tensor gh = at::empty({rows, n * r}, x2.options());
        if (batched) {
            at::Tensor gh3 = column_batch(gh, n);
            at::baddbmm_out(gh3, gh3, column_batch(g_cat, n), b3, 0.0, scales.front());
        } else {
            for (int64_t i = 0; i < n; ++i) {
                at::Tensor ghi = gh.narrow(1, i * r, r);
                if (g[i].defined())
                    at::addmm_out(ghi, ghi, g[i], saved[5 + i], 0.0, scales[i]);
                else
                    ghi.zero_();
            }
        }
        at::Tensor dx;
        if (ctx->needs_input_grad(0)) {
            const bool quantized = ctx->saved_data.count("q_weight") > 0;
            const at::Tensor q_weight = quantized ? ctx->saved_data["q_weight"].toTensor() : at::Tensor(),
                             q_scale = quantized ? ctx->saved_data["q_scale"].toTensor() : at::Tensor();
            if (g_cat.defined()) {
                // [N, in]: Σ g_i·W_i as one GEMM, K = Σ out
                dx = quantized ? quantized_linear_input_grad(g_cat, q_weight, q_scale, x2.scalar_type())
                               : at::mm(g_cat, wc);
            } else if (quantized) {
                int64_t row = 0;  // layer by layer, summed (the fp8 GEMM writes no accumulation)
                for (int64_t i = 0; i < n; ++i) {
                    const int64_t first = row;
                    row += outs[i];
                    if (!g[i].defined()) continue;
                    const at::Tensor di =
                        quantized_linear_input_grad(g[i], q_weight.narrow(0, first, outs[i]),
                                                    q_scale.narrow(0, first, outs[i]), x2.scalar_type());
                    dx = dx.defined() ? dx.add_(di) : di;
                }
                if (!dx.defined()) dx = at::zeros({rows, x2.size(1)}, x2.options());
            } else {
                // Accumulated in the GEMMs' epilogue: no gradient sum, and no copy into a g_cat
                // (which would move as many bytes as the sum it replaces).
                int64_t row = 0;
                for (int64_t i = 0; i < n; ++i) {
                    const at::Tensor wi = wc.narrow(0, row, outs[i]);
                    row += outs[i];
                    if (!g[i].defined()) continue;
                    if (dx.defined())
                        dx.addmm_(g[i], wi);
                    else
                        dx = at::mm(g[i], wi);
                }
                if (!dx.defined()) dx = at::zeros({rows, x2.size(1)}, x2.options());
            }
            if (!drop) {
                dx.addmm_(gh, ac);  // + Σ s_i·g_i·B_i·A_i, K = n·r
            } else {
                lora_masked_up_add_group_(dx, gh, ac, drops);  // + Σ mask_i(s_i·g_i·B_i·A_i), one pass
            }
            dx = dx.to(static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt()))
                     .view(ctx->saved_data["x_sizes"].toIntVector());
        }
        // Factor gradients straight into their (float32) dtype where the GEMM can write it (CUDA).
        const bool out_dtype = x2.is_cuda() && x2.scalar_type() != at::kFloat;
        const auto a_dtype = [&](int64_t i) { return static_cast<at::ScalarType>(a_dtypes[i]); };
        const auto b_dtype = [&](int64_t i) { return static_cast<at::ScalarType>(b_dtypes[i]); };
        torch::autograd::variable_list out(2 * n + 2);
        out[0] = dx;
        bool same_a_dtype = true, any_a = false, all_a = true;
        for (int64_t i = 0; i < n; ++i) {
            same_a_dtype = same_a_dtype && a_dtype(i) == a_dtype(0);
            const bool wanted = ctx->needs_input_grad(1 + i) && g[i].defined();
            any_a = any_a || wanted;
            all_a = all_a && wanted;
        }
        if (any_a && !drop && same_a_dtype) {
            // [n·r, in]: every dA in one GEMM (all adapters read the same input)
            const at::Tensor da =
                out_dtype ? at::mm(gh.t(), x2, a_dtype(0)) : at::mm(gh.t(), x2).to(a_dtype(0));
            for (int64_t i = 0; i < n; ++i)
                if (ctx->needs_input_grad(1 + i) && g[i].defined()) out[1 + i] = da.narrow(0, i * r, r);
        } else if (any_a && all_a) {
            // Every adapter's dA from one pass over x2 (each through its own mask)
            std::vector<at::ScalarType> dtypes;
            for (int64_t i = 0; i < n; ++i) dtypes.push_back(a_dtype(i));
            const std::vector<at::Tensor> das = lora_masked_down_grad_group(gh, x2, drops, dtypes);
            for (int64_t i = 0; i < n; ++i) out[1 + i] = das[i];
        } else if (any_a) {
            for (int64_t i = 0; i < n; ++i) {
                if (!(ctx->needs_input_grad(1 + i) && g[i].defined())) continue;
                const at::Tensor ghi = gh.narrow(1, i * r, r);
                // adapter i's input mask (none: x2 itself)
                out[1 + i] = lora_masked_down_grad(ghi, x2, drops[i], a_dtype(i));
            }
        }
        bool all_b = true, same_b_dtype = true;
        for (int64_t i = 0; i < n; ++i) {
            all_b = all_b && ctx->needs_input_grad(1 + n + i);
            same_b_dtype = same_b_dtype && b_dtype(i) == b_dtype(0);
        }
        if (batched && all_b && same_b_dtype) {
            // dB_i = s·g_iᵀ·h_i for every adapter in one batched GEMM, [n, out, r], each reading its
            // columns of g and h in place.
            const double s = scales.front();
            const at::Tensor gt = column_batch(g_cat, n).transpose(1, 2), h3 = column_batch(h, n);
            const at::Tensor db =
                out_dtype ? at::baddbmm(at::empty({n, outs[0], r}, x2.options().dtype(b_dtype(0))), gt, h3,
                                        b_dtype(0), 0.0, s)
                          : at::bmm(gt, h3).mul_(s).to(b_dtype(0));
            for (int64_t i = 0; i < n; ++i) out[1 + n + i] = db[i];
            return out;
        }
        for (int64_t i = 0; i < n; ++i) {
            if (!(ctx->needs_input_grad(1 + n + i) && g[i].defined())) continue;
            const at::Tensor hi = h.narrow(1, i * r, r);
            out[1 + n + i] = out_dtype ? at::addmm(at::empty({outs[i], r}, x2.options().dtype(b_dtype(i))),
                                                   g[i].t(), hi, b_dtype(i), 0.0, scales[i])
                                       : at::mm(g[i].t(), hi).mul_(scales[i]).to(b_dtype(i));
        }
        return out;
    }
};

std::vector<const at::Tensor*> weights_of(const ProjectionGroup& group) {
    std::vector<const at::Tensor*> out;
    for (const AdaptableLinearImpl* l : group) out.push_back(&l->weight);
    return out;
}

std::vector<const at::Tensor*> biases_of(const ProjectionGroup& group) {
    std::vector<const at::Tensor*> out;
    for (const AdaptableLinearImpl* l : group) out.push_back(&l->bias);
    return out;
}

// Copies the tensors into one buffer and points each at its rows (unless already back to back).
void pack_rows(const std::vector<at::Tensor*>& parts) {
    if (rows_view({parts.begin(), parts.end()}).defined()) return;
    std::vector<at::Tensor> values;
    values.reserve(parts.size());
    // fp8 weights travel as bytes (concatenation is not defined for every float8 type and device).
    const at::ScalarType dtype = parts.front()->scalar_type();
    const bool bytes = at::isFloat8Type(dtype);
    for (const at::Tensor* p : parts)
        values.push_back(bytes ? p->contiguous().view(at::kByte) : p->contiguous());
    const at::Tensor buffer = bytes ? at::cat(values, 0).view(dtype) : at::cat(values, 0);
    int64_t row = 0;
    for (at::Tensor* p : parts) {
        const int64_t n = p->size(0);
        p->set_data(buffer.narrow(0, row, n));
        row += n;
    }
}

}  // namespace

void set_fused_qkv_lora(bool enabled) {
    fused_qkv_switch.set(enabled);
}

bool fused_qkv_lora_enabled() {
    return fused_qkv_switch.on() && fused_lora_enabled();
}

at::Tensor packed_weight(const ProjectionGroup& group) {
    return group.empty() ? at::Tensor() : rows_view(weights_of(group));
}

at::Tensor packed_bias(const ProjectionGroup& group) {
    return group.empty() ? at::Tensor() : rows_view(biases_of(group));
}

at::Tensor packed_weight_scale(const ProjectionGroup& group) {
    std::vector<const at::Tensor*> scales;
    for (const AdaptableLinearImpl* l : group) scales.push_back(&l->weight_scale);
    return group.empty() ? at::Tensor() : rows_view(scales);
}

bool pack_projection_group(const ProjectionGroup& group) {
    if (group.size() < 2) return false;
    const AdaptableLinearImpl& first = *group.front();
    const bool bias = first.bias.defined(), quantized = first.weight_scale.defined();
    for (const AdaptableLinearImpl* l : group) {
        const at::Tensor &w = l->weight, &b = l->bias, &sc = l->weight_scale;
        if (!w.defined() || w.dim() != 2 || sc.defined() != quantized || w.requires_grad() ||
            w.size(1) != first.weight.size(1) || w.scalar_type() != first.weight.scalar_type() ||
            w.device() != first.weight.device() || b.defined() != bias)
            return false;
        if (quantized && (sc.dim() != 1 || sc.size(0) != w.size(0) || sc.scalar_type() != at::kFloat ||
                          sc.device() != w.device()))
            return false;
        if (bias && (b.dim() != 1 || b.requires_grad() || b.scalar_type() != first.bias.scalar_type() ||
                     b.device() != first.bias.device()))
            return false;
    }
    const at::NoGradGuard no_grad;
    std::vector<at::Tensor*> weights, biases, scales;
    for (AdaptableLinearImpl* l : group) {
        weights.push_back(&l->weight);
        biases.push_back(&l->bias);
        scales.push_back(&l->weight_scale);
    }
    pack_rows(weights);
    if (bias) pack_rows(biases);
    if (quantized) pack_rows(scales);
    return packed_weight(group).defined() && (!bias || packed_bias(group).defined()) &&
           (!quantized || packed_weight_scale(group).defined());
}

int64_t pack_lora_projection_groups(torch::nn::Module& root) {
    std::vector<ProjectionGroupHost*> hosts;
    if (auto* h = dynamic_cast<ProjectionGroupHost*>(&root)) hosts.push_back(h);
    for (const auto& m : root.modules(/*include_self=*/false))
        if (auto* h = dynamic_cast<ProjectionGroupHost*>(m.get())) hosts.push_back(h);
    int64_t packed = 0;
    for (ProjectionGroupHost* host : hosts) {
        for (const ProjectionGroup& group : host->projection_groups()) {
            bool adapted = group.size() >= 2;
            int64_t rank = 0;
            for (const AdaptableLinearImpl* l : group) {
                const auto* lora = dynamic_cast<const LoRALayer*>(l->adapter());
                adapted = adapted && lora && lora->kind() == LoRALayer::Kind::kLinear && !lora->use_dora() &&
                          (rank == 0 || lora->rank() == rank);
                if (lora) rank = lora->rank();
            }
            if (adapted && pack_projection_group(group)) ++packed;
        }
    }
    return packed;
}

bool projection_group_fuses(const at::Tensor& x, const ProjectionGroup& group) {
    return fused_spec(x, group).has_value();
}

std::vector<at::Tensor> project_group(const at::Tensor& x, const ProjectionGroup& group) {
    if (std::optional<FusedSpec> spec = fused_spec(x, group)) {
        std::vector<at::Tensor> factors;
        for (AdaptableLinearImpl* l : group) factors.push_back(static_cast<LoRALayer*>(l->adapter())->down());
        for (AdaptableLinearImpl* l : group) factors.push_back(static_cast<LoRALayer*>(l->adapter())->up());
        return LoRAProjectionsFunction::apply(x, at::TensorList(factors), *spec);
    }
    std::vector<at::Tensor> out;
    for (AdaptableLinearImpl* l : group) out.push_back(l->forward(x));
    return out;
}

}  // namespace dtune::models
