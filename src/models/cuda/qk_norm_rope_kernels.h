// Launchers of the joint-attention input kernels (cuda/qk_norm_rope_kernels.cu), callable from code
// built without nvcc. They turn one or two token streams' q, k and v projections ([B, S_i, H·D]
// rows, any row stride: column slices of one packed q/k/v GEMM output are read in place) into the
// attention's q, k, v [B, S, H, D] (S = Σ S_i, streams in order, contiguous):
//   q, k: RMS norm over D with the stream's weight, rounded to the dtype, then rotated by
//         (cos, sin) [S, D] float32 at the joint position (pairs (2i, 2i + 1), as rope_kernels.h);
//   v:    copied.
// The backward reads the three gradients [B, S, H, D] (contiguous) and writes each stream's input
// gradients side by side into one [B, S_i, 3·H·D] buffer (q at column 0, k at H·D, v at 2·H·D),
// recomputing the norm's statistics from the saved inputs; with `dweight` set it also writes the
// norm weights' gradient as per-block partial sums (summed by the caller). Float math, one rounding
// per stored element, except the rounding of the normalised value and of the rotated-back gradient,
// which mirror the composite ops (rms_norm's output and rope's input gradient are stored tensors).
#pragma once

#include <cstdint>

#include "models/cuda/kernel_dtype.h"

namespace dtune::models::cuda {

constexpr int kJointQKVMaxStreams = 2;

struct JointQKVStreams {
    int streams = 0;
    int64_t seq[kJointQKVMaxStreams] = {};  // S_i
    // [stream][q, k, v]: the first element of each input, its batch and token strides (elements)
    const void* src[kJointQKVMaxStreams][3] = {};
    int64_t batch_stride[kJointQKVMaxStreams][3] = {};
    int64_t token_stride[kJointQKVMaxStreams][3] = {};
    const float* weight[kJointQKVMaxStreams][2] = {};  // [stream][q, k] norm weights, float32 [D]
};

// Whether the kernels take these sizes (D a multiple of one 16-byte pack, at most 32 packs, a power
// of two) and every input pointer and stride keeps 16-byte packs aligned (outputs and gradients are
// new allocations, which are).
bool joint_qkv_supported(const JointQKVStreams& in, const float* cos, const float* sin, int64_t heads,
                         int64_t dim, KernelDtype dtype);

// Blocks the backward launches (the row count of `dweight`'s partial sums).
int64_t joint_qkv_backward_blocks(int64_t batch, int64_t seq, int64_t heads, int64_t dim, KernelDtype dtype);

// Return the launch's cudaError_t as an int (0 = success). out / grad: q, k, v [B, S, H, D].
int joint_qk_norm_rope_forward(const JointQKVStreams& in, const float* cos, const float* sin,
                               void* const out[3], int64_t batch, int64_t heads, int64_t dim, float eps,
                               KernelDtype dtype, void* stream);
// grad_in[stream]: [B, S_i, 3·H·D] contiguous. dweight: null, or float32
// [2 (q, k)][streams][joint_qkv_backward_blocks(...)][D], every entry written.
int joint_qk_norm_rope_backward(const JointQKVStreams& in, const float* cos, const float* sin,
                                const void* const grad[3], void* const grad_in[kJointQKVMaxStreams],
                                float* dweight, int64_t batch, int64_t heads, int64_t dim, float eps,
                                KernelDtype dtype, void* stream);

}  // namespace dtune::models::cuda
