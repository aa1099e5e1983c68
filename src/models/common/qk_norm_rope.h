// The attention inputs of a joint (text + image) transformer block as Flux.1 forms them, as one op:
// each stream's q and k normalised per head by an RMS norm with the stream's own weight, the
// streams concatenated along the sequence (text first), then q and k rotated (rope.h).
//
// On the GPU (bf16, fp16 or float32; head size a multiple of one 16-byte pack) one kernel does all of
// it each way (cuda/qk_norm_rope_kernels.h), reading the projections in place, including column
// slices of one packed q/k/v GEMM output, and handing each stream's three input gradients back side
// by side in one buffer, so that a fused q/k/v projection's backward takes them as one GEMM
// (adapters/lora_qkv.h). Values equal the composite ops' up to float rounding: the normalised value and
// the rotated-back gradient are rounded to the dtype where the composite stores them. Elsewhere
// (CPU, other sizes or layouts, no nvcc, DTUNE_FUSED_KERNELS=0 or the switch below off) the
// composite ops: at::rms_norm, at::cat and rotary_embedding.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <vector>

namespace dtune::models {

// One stream's projections, each [B, S_i, H·D] (any token stride, last dimension contiguous for the
// fused path), and its q and k norms' weights [D].
struct QKVStream {
    at::Tensor q, k, v;
    at::Tensor q_weight, k_weight;
};

// q, k, v [B, S, H, D] (S = Σ S_i, streams in order; contiguous on the fused path): q and k
// RMS-normalised over D (eps) in their dtype with the weight cast to it, then rotated by (cos, sin)
// [S, D]; v the streams' v side by side. One or two streams of one dtype and batch.
std::array<at::Tensor, 3> joint_qk_norm_rope(const std::vector<QKVStream>& streams, int64_t heads, double eps,
                                             const at::Tensor& cos, const at::Tensor& sin);

// The composite ops, always: the reference of the fused path.
std::array<at::Tensor, 3> joint_qk_norm_rope_composite(const std::vector<QKVStream>& streams, int64_t heads,
                                                       double eps, const at::Tensor& cos,
                                                       const at::Tensor& sin);

// DTUNE_FUSED_QK_NORM_ROPE (read once, on first use: 1/on/true or unset = the kernels where they
// apply, 0/off/false = the composite ops); set_fused_qk_norm_rope overrides it (tests, benchmarks).
// Also off whenever DTUNE_FUSED_KERNELS=0.
void set_fused_qk_norm_rope(bool enabled);
bool fused_qk_norm_rope_enabled();

}  // namespace dtune::models
