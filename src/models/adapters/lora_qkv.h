// Fused projections of one input: an attention's q, k and v (or a cross-attention's k and v) with a
// LoRA adapter on each, as one autograd function.
//
// Unfused, each of the three adapted layers runs its own base GEMM and adapter, and autograd sums
// the three input gradients with two extra passes over [N, in]. Fused:
//   forward:  y = x·[Wq;Wk;Wv]ᵀ (+ [bq;bk;bv]) in one GEMM, then per adapter y_i += s_i·(x_i·A_iᵀ)·B_iᵀ
//             into its column slice (addmm epilogue), where x_i is x under adapter i's own dropout
//             mask (the same salt and index offset as its unfused path); without dropout the down
//             projections are one GEMM over the stacked A's (rank n·r). With biased 16-bit layers on
//             CUDA (Flux) the order turns: each y_i = s_i·(x_i·A_iᵀ)·B_iᵀ is written first and the base
//             GEMM adds x·Wᵀ + b onto them in its cuBLASLt epilogue (common/epilogue_linear.h), one pass
//             over y fewer. Returns the n slices.
//   backward: dx = Σ g_i·W_i as GEMMs accumulating into one buffer (one GEMM with K = Σ out_i when
//             the gradients arrive packed side by side), plus the adapters' terms (one GEMM over the
//             stacked A's without dropout); dA, dB per adapter as the single-layer function.
// Values equal the unfused path's up to float rounding (tests/models/test_lora_qkv_unit.cpp).
//
// Invariant the fused path needs and checks on every call: the group's frozen base weights (and
// biases) lie back to back in one buffer. pack_projection_group() lays them out so by making the
// layers' own `weight` / `bias` parameters views into one [Σ out, in] tensor; they stay registered
// under their names (state_dict, checkpoints and exports are unchanged). inject_lora() packs every
// group whose layers it adapted. A quantised group (base_model_precision, common/quantize.h) is laid
// out the same way with its `weight_scale` buffers, and its one GEMM each way is quantised too (the
// fp8 GEMM where it applies). Anything that replaces a weight's storage afterwards (module.to() to
// another device or dtype, quantising after injection, ZeRO-3's flat buffers) just makes the check
// fail and the group run unfused. So do a group quantised in part, DoRA, other adapter types,
// unequal ranks, trainable bases and inference (no gradients recorded).
//
// The switch: set_fused_qkv_lora() (tests, benchmarks) over DTUNE_FUSED_QKV (read once, on first
// use: 1/on/true or unset turns the fused path on, 0/off/false runs q/k/v one by one); also off
// whenever fused_lora_enabled() is (set_fused_lora(false), DTUNE_FUSED_KERNELS=0).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "models/common/adaptable.h"

namespace torch::nn {
class Module;
}

namespace dtune::models {

// The Linear layers of one module that read the same input, in output order (e.g. to_q, to_k,
// to_v). Pointers into the module's own children: valid while the module lives.
using ProjectionGroup = std::vector<AdaptableLinearImpl*>;

// A module whose forward feeds groups of its Linear layers one input each (the attention blocks).
// inject_lora() packs these groups' weights; the module's forward runs each through project_group().
class ProjectionGroupHost {
  public:
    virtual ~ProjectionGroupHost() = default;
    virtual std::vector<ProjectionGroup> projection_groups() = 0;
};

void set_fused_qkv_lora(bool enabled);
// The switch above and fused_lora_enabled().
bool fused_qkv_lora_enabled();

// Lays the group's weights (and biases, when every layer has one) out back to back in one new
// buffer and points the parameters at their slices (values unchanged, one copy now). Returns true
// when the group is packed afterwards (already packed: nothing is copied), false when it cannot be
// and is left as it was: fewer than two layers, a trainable weight, different input sizes, dtypes
// or devices, or a bias or a quantisation on some layers only.
bool pack_projection_group(const ProjectionGroup& group);
// Packs every group of `root`'s ProjectionGroupHost modules whose layers all carry a linear LoRA
// adapter (no DoRA) of one rank; returns how many groups are packed.
int64_t pack_lora_projection_groups(torch::nn::Module& root);

// The [Σ out, in] weight (or [Σ out] bias, for which = 1) of a packed group, as one view; undefined
// when the tensors do not lie back to back (or, for biases, when any layer has none).
at::Tensor packed_weight(const ProjectionGroup& group);
at::Tensor packed_bias(const ProjectionGroup& group);
// The [Σ out] float32 weight_scale of a packed quantised group; undefined as above.
at::Tensor packed_weight_scale(const ProjectionGroup& group);

// Whether project_group(x, group) takes the fused function: the switch is on, every layer's
// adapter is a LoRALayer taking its own fused training path for x (takes_whole_forward), the ranks
// are equal, and the group is packed.
bool projection_group_fuses(const at::Tensor& x, const ProjectionGroup& group);

// Each layer's output for x ([..., out_i]), fused where projection_group_fuses(x, group), else
// layer by layer (exactly each layer's own forward).
std::vector<at::Tensor> project_group(const at::Tensor& x, const ProjectionGroup& group);

}  // namespace dtune::models
