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
};

// One step over a bucket (adamw_bf16.cpp's header comment gives the formulas): reads grad and
// weights, updates exp_avg, exp_avg_sq and shift in place, and writes the new weights over
// `weights`. Each element uses 4 of its own Philox numbers (one per stochastic rounding), so the
// call consumes an offset increment of 4. Returns the launch's cudaError_t (0 = success).
int adamw_bf16_bucket_step(const void* grad, void* weights, void* exp_avg, void* exp_avg_sq, void* shift,
                           int64_t n, const AdamWBF16Args& args, const PhiloxArgs& rng, void* stream);

}  // namespace dtune::train::cuda
