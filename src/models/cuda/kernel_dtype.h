// The element type of a fused kernel's tensors, as the launchers in models/cuda/*.h take it (they
// are called from code built without nvcc, so no CUDA types appear in their signatures).
#pragma once

namespace dtune::models::cuda {

enum class KernelDtype { kFloat, kBFloat16, kHalf };

}  // namespace dtune::models::cuda
