// A frozen MLP with a tanh-GELU as one autograd function whose GELU lives in the GEMMs' epilogues:
//   gelu_mlp(x, in, out)             = out(gelu_tanh(in(x)))            (a Flux double block's ff)
//   concat_gelu_mlp(a, x, in, out)   = out(cat([a, gelu_tanh(in(x))]))  (a Flux single block: the
//                                      attention output a beside the MLP activation)
// On the GPU (bf16/fp16, CUDA kernels built) with both Linear layers plain and frozen (no adapter,
// no quantisation, weight and bias without gradients): the input projection writes the activation
// through cuBLASLt's GELU epilogue and keeps the pre-activation for the backward; the output
// projection runs as two GEMMs along its input (the activation's columns, then a's accumulated), so
// nothing is concatenated; the backward's GEMM against the output projection returns the
// pre-activation's gradient through the GELU-derivative epilogue. That removes the separate GELU
// passes (forward and backward) over the widest activation of the block, and only the
// pre-activation is saved, as before. Everything else (CPU, float32, an adapter or a quantised or
// trainable weight on either layer, DTUNE_FUSED_GELU_GEMM=0, DTUNE_FUSED_KERNELS=0) runs the layers'
// own forward with at::gelu / concat_gelu_tanh: the same values up to float rounding (the epilogue
// rounds once, after the GELU, where the composite rounds the pre-activation first).
#pragma once

#include <ATen/ATen.h>

#include "models/common/adaptable.h"

namespace dtune::models {

// x [..., in.in_features] -> [..., out.out_features]
// values_unused: the caller differentiates through the output but never reads its values (a
// checkpointed block's recomputation, whose MLP output only enters a gated residual with a gate
// that needs no gradient). The output projection is then not computed: an unwritten tensor comes
// back with the same backward (which never reads the output). The fused path also writes only the
// pre-activation; the composite does so where the output layer is frozen without an adapter (plain
// or quantised) and still runs the input projection and GELU.
at::Tensor gelu_mlp(const at::Tensor& x, AdaptableLinearImpl& in, AdaptableLinearImpl& out,
                    bool values_unused = false);
// a [..., da], x [..., in.in_features] with the same leading sizes -> [..., out.out_features]
// (out reads da + in.out_features features).
at::Tensor concat_gelu_mlp(const at::Tensor& a, const at::Tensor& x, AdaptableLinearImpl& in,
                           AdaptableLinearImpl& out, bool values_unused = false);

// out(z), or, where values_unused, out is frozen without an adapter (plain or quantised) and z needs
// a gradient, an unwritten tensor of out's shape and dtype whose backward is out's input gradient
// (the composite MLP's output projection, and a single block's when its MLP does not fuse).
at::Tensor output_projection(const at::Tensor& z, AdaptableLinearImpl& out, bool values_unused);

// How many output projections values_unused has left out in this process (tests, profiling).
int64_t gelu_mlp_unread_projections();

// DTUNE_FUSED_GELU_GEMM (read once, on first use: unset or 1 = the epilogue GEMMs where they apply,
// 0 = the composite); set_fused_gelu_gemm overrides it (tests, benchmarks).
void set_fused_gelu_gemm(bool enabled);
bool fused_gelu_gemm_enabled();

// Whether the fused path takes x, the layers and a concatenated input of width da (0 for gelu_mlp)
// now; concat_gelu_mlp also checks that a has x's leading sizes, dtype and device.
bool gelu_mlp_fuses(int64_t da, const at::Tensor& x, const AdaptableLinearImpl& in,
                    const AdaptableLinearImpl& out);

}  // namespace dtune::models
