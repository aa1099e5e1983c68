// Host-side helpers for calling the fused kernels of models/cuda/ from torch code (only where the
// kernels were built: DTUNE_WITH_CUDA_KERNELS).
#pragma once

#ifdef DTUNE_WITH_CUDA_KERNELS
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

#include <stdexcept>
#include <string>

#include "models/cuda/kernel_dtype.h"

namespace dtune::models {

// The kernels' code for a tensor dtype; `who` names the caller in the error for other dtypes.
inline cuda::KernelDtype kernel_dtype(at::ScalarType t, const char* who) {
    switch (t) {
        case at::kFloat: return cuda::KernelDtype::kFloat;
        case at::kBFloat16: return cuda::KernelDtype::kBFloat16;
        case at::kHalf: return cuda::KernelDtype::kHalf;
        default: throw std::invalid_argument(std::string(who) + ": no CUDA kernel for " + c10::toString(t));
    }
}

// Throws when a launcher returned a CUDA error code.
inline void check_launch(int err, const char* who, const char* what) {
    if (err != 0)
        throw std::runtime_error(std::string(who) + ": " + what + " kernel launch failed (CUDA error " +
                                 std::to_string(err) + ")");
}

// The current stream of `t`'s device, as the launchers take it.
inline void* current_stream_of(const at::Tensor& t) {
    return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

}  // namespace dtune::models
#endif
