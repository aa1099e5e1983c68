// Launcher of the counter-based dropout kernel (cuda/hash_dropout_kernels.cu), callable from code
// built without nvcc. `in` and `out` are `n` contiguous elements; `seed` points at one int64 on the
// device (read by the kernel, so a CUDA graph replays with whatever the seed holds then); element i
// is hashed as index `index_offset + i`. Built only with DTUNE_WITH_CUDA_KERNELS.
#pragma once

#include <cstdint>

#include "models/cuda/kernel_dtype.h"

namespace dtune::models::cuda {

// Returns the launch's cudaError_t as an int (0 = success).
int hash_dropout(const void* in, void* out, int64_t n, const int64_t* seed, uint64_t salt,
                 int64_t index_offset, uint32_t threshold, float scale, KernelDtype dtype, void* stream);

// out[i] += masked, scaled in[i] (one rounding to the dtype), with hash_dropout's mask.
int hash_dropout_add(const void* in, void* out, int64_t n, const int64_t* seed, uint64_t salt,
                     int64_t index_offset, uint32_t threshold, float scale, KernelDtype dtype, void* stream);

}  // namespace dtune::models::cuda
