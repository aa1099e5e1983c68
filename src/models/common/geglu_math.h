// The element math of the fused GEGLU (out = h * gelu(g), exact erf GELU as diffusers' GEGLU), shared
// by the CPU loop (common/geglu.cpp) and the CUDA kernels (cuda/geglu_kernels.cu) so both compute
// the same formulas. T is the arithmetic type: float for float/bf16/fp16 tensors, double for double.
#pragma once

#include <math.h>

#if defined(__CUDACC__)
#define DTUNE_HOST_DEVICE __host__ __device__
#else
#define DTUNE_HOST_DEVICE
#endif

namespace dtune::models::geglu_math {

// erf/exp picked by precision (the C functions exist on the host and in device code).
DTUNE_HOST_DEVICE inline float erf_of(float x) {
    return erff(x);
}
DTUNE_HOST_DEVICE inline double erf_of(double x) {
    return erf(x);
}
DTUNE_HOST_DEVICE inline float exp_of(float x) {
    return expf(x);
}
DTUNE_HOST_DEVICE inline double exp_of(double x) {
    return exp(x);
}

// gelu(x) = x * Phi(x), Phi the standard normal CDF.
template <typename T>
DTUNE_HOST_DEVICE inline T gelu(T x) {
    return T(0.5) * x * (T(1) + erf_of(x * T(0.70710678118654752440)));
}

// d gelu / dx = Phi(x) + x * phi(x), phi the standard normal density.
template <typename T>
DTUNE_HOST_DEVICE inline T gelu_grad(T x) {
    const T cdf = T(0.5) * (T(1) + erf_of(x * T(0.70710678118654752440)));
    const T pdf = exp_of(T(-0.5) * x * x) * T(0.39894228040143267794);
    return cdf + x * pdf;
}

}  // namespace dtune::models::geglu_math
