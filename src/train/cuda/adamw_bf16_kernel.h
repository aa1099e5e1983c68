// Launcher of the fused adamw_bf16 bucket update (adamw_bf16_kernel.cu), callable from code built
// without nvcc. Every array is a flat bf16 bucket of n elements. Built only where CMake found nvcc
// (DTUNE_WITH_CUDA_KERNELS).
#pragma once

#include <cstdint>

namespace dtune::train::cuda {

// Where a step's random numbers come from: torch's Philox state for this call, as
// at::PhiloxCudaState carries it (values outside a CUDA graph capture, device pointers inside one).
struct PhiloxArgs {
    uint64_t seed = 0, offset = 0;
    const int64_t* seed_ptr = nullptr;    // captured: read at replay
    const int64_t* offset_ptr = nullptr;  // captured: read at replay, plus offset_intragraph
    uint64_t offset_intragraph = 0;
    bool captured = false;
};

struct AdamWBF16Args {
    float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-6f;
    float one_minus_beta1 = 0.1f, one_minus_beta2 = 1e-3f;  // computed in double by the caller, as ATen
    bool simpletuner_momentum = true;
    const float* scale = nullptr;  // device scalar: -lr * sqrt(1 - beta2^t)
    float grad_clamp = 0;          // > 0: each gradient element is clamped to [-grad_clamp, grad_clamp] first
    const float* found_inf = nullptr;  // fp16: device scalar; the launch leaves everything as it was when 1
};

// A run of at most kAdamWBF16ChunkElements of one parameter's elements: its gradient and weight
// (bf16, contiguous, on the device) and where they sit in the bucket's flat state arrays.
struct AdamWBF16Chunk {
    const void* grad = nullptr;
    void* weight = nullptr;
    int64_t offset = 0;  // elements into the bucket
    int64_t numel = 0;
};

constexpr int64_t kAdamWBF16ChunkElements = int64_t{1} << 20;
// Chunks per launch: they travel in the kernel's arguments (4 KB at most), so a step needs no
// device-side table (nothing to upload, nothing a CUDA graph would have to keep alive).
constexpr int kAdamWBF16MaxChunks = 100;
struct AdamWBF16Chunks {
    AdamWBF16Chunk chunk[kAdamWBF16MaxChunks];
    int count = 0;
};

// One launch over up to kAdamWBF16MaxChunks chunks of a bucket (adamw_bf16.cpp's header comment
// gives the formulas): each chunk's gradient is read, its weight updated in place, and exp_avg,
// exp_avg_sq and shift (flat bf16 arrays of the bucket) at its offset updated. Each element uses
// four 16-bit random numbers of its own, from a hash of the call's Philox seed and offset and the
// element's index in the bucket: a bucket's launches share one `rng` (an offset increment of 4),
// and results do not depend on how the bucket is cut into chunks. Returns the launch's
// cudaError_t (0 = success).
int adamw_bf16_chunks_step(const AdamWBF16Chunks& batch, void* exp_avg, void* exp_avg_sq, void* shift,
                           const AdamWBF16Args& args, const PhiloxArgs& rng, void* stream);

}  // namespace dtune::train::cuda
