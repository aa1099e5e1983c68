// Fused channels-last GroupNorm (+ input bias, + SiLU) and bias + residual add for inference. NHWC
// keeps each pixel's channels contiguous, so a group's statistics are partial sums over pixel rows:
//   1. stats:    a [bpn, n] grid; each block sums x + in_bias and its square per channel over its
//                slice of pixels (float, 16-byte loads), then writes one float2 per channel;
//   2. finalize: one block per sample combines the partials per group in double (mean, variance ->
//                rstd) and folds rstd, the affine weights and the input bias into a per-(sample,
//                channel) scale and shift;
//   3. apply:    y = x * scale + shift (then SiLU), rounded once to the storage type.
// Two reads and one write of x, against ATen's composite (input bias add, NHWC->NCHW copy, moments,
// normalise, SiLU, copy back) which reads and writes it several times.
#include <cstdint>

#include "models/cuda/group_norm_kernels.h"
#include "models/cuda/kernel_utils.cuh"

namespace dtune::models::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    gn_stats_kernel(const T* __restrict__ x, const float* __restrict__ in_bias, bool per_sample, int64_t hw,
                    int c, int bpn, float2* __restrict__ partial) {
    __shared__ float2 sums[kThreads * V];
    const int n = blockIdx.y, b = blockIdx.x;
    const int lanes = c / V, rows = kThreads / lanes;  // lanes per pixel, pixels per iteration
    const int lane = threadIdx.x % lanes, row = threadIdx.x / lanes;
    const int64_t per = (hw + bpn - 1) / bpn, begin = b * per, end = min(hw, begin + per);
    float s[V], q[V], add[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
        s[k] = q[k] = 0.f;
        add[k] = in_bias ? in_bias[(per_sample ? static_cast<int64_t>(n) * c : 0) + lane * V + k] : 0.f;
    }
    if (row < rows) {
        const T* base = x + static_cast<int64_t>(n) * hw * c + lane * V;
        for (int64_t p = begin + row; p < end; p += rows) {
            const Pack<T, V> v = *reinterpret_cast<const Pack<T, V>*>(base + p * c);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const float f = to_float(v.v[k]) + add[k];
                s[k] += f;
                q[k] += f * f;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < V; ++k) sums[threadIdx.x * V + k] = make_float2(s[k], q[k]);
    __syncthreads();
    if (row == 0) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
            float2 t = make_float2(0.f, 0.f);
            for (int r = 0; r < rows; ++r) {
                const float2 u = sums[(r * lanes + lane) * V + k];
                t.x += u.x;
                t.y += u.y;
            }
            partial[(static_cast<int64_t>(n) * bpn + b) * c + lane * V + k] = t;
        }
    }
}

__global__ void gn_finalize_kernel(const float2* __restrict__ partial, const float* __restrict__ in_bias,
                                   bool per_sample, const float* __restrict__ weight,
                                   const float* __restrict__ bias, int64_t hw, int c, int groups, int bpn,
                                   double eps, float* __restrict__ scale, float* __restrict__ shift) {
    const int n = blockIdx.x, cg = c / groups;
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
        double sum = 0, sum_sq = 0;
        for (int b = 0; b < bpn; ++b)
            for (int ch = g * cg; ch < (g + 1) * cg; ++ch) {
                const float2 t = partial[(static_cast<int64_t>(n) * bpn + b) * c + ch];
                sum += t.x;
                sum_sq += t.y;
            }
        const double count = static_cast<double>(hw) * cg, mean = sum / count;
        const double var = fmax(sum_sq / count - mean * mean, 0.0), rstd = rsqrt(var + eps);
        for (int ch = g * cg; ch < (g + 1) * cg; ++ch) {
            const double a = rstd * (weight ? weight[ch] : 1.f);
            const double add = in_bias ? in_bias[(per_sample ? static_cast<int64_t>(n) * c : 0) + ch] : 0.f;
            scale[static_cast<int64_t>(n) * c + ch] = static_cast<float>(a);
            shift[static_cast<int64_t>(n) * c + ch] =
                static_cast<float>((bias ? bias[ch] : 0.f) + (add - mean) * a);
        }
    }
}

template <typename T, int V, bool kSilu>
__global__ void gn_apply_kernel(const T* __restrict__ x, T* __restrict__ out, const float* __restrict__ scale,
                                const float* __restrict__ shift, int64_t hwc, int c, int64_t packs) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < packs;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t e = i * V, n = e / hwc;
        const int64_t off = n * c + e % c;
        const Pack<T, V> v = *reinterpret_cast<const Pack<T, V>*>(x + e);
        Pack<T, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            float y = to_float(v.v[k]) * scale[off + k] + shift[off + k];
            if (kSilu) y = y / (1.f + expf(-y));
            o.v[k] = from_float<T>(y);
        }
        *reinterpret_cast<Pack<T, V>*>(out + e) = o;
    }
}

template <typename T, int V>
__global__ void add_bias_residual_kernel(const T* h, const float* __restrict__ bias, const T* residual,
                                         T* out, int c, int64_t packs, float scale) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < packs;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t e = i * V;
        const int ch = static_cast<int>(e % c);
        const Pack<T, V> a = *reinterpret_cast<const Pack<T, V>*>(h + e);
        Pack<T, V> r{};
        if (residual) r = *reinterpret_cast<const Pack<T, V>*>(residual + e);
        Pack<T, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            float y = to_float(a.v[k]) + (bias ? bias[ch + k] : 0.f);
            if (residual) y += to_float(r.v[k]);
            o.v[k] = from_float<T>(y * scale);
        }
        *reinterpret_cast<Pack<T, V>*>(out + e) = o;
    }
}

// Statistics blocks per sample: about four blocks per multiprocessor in all, each over >= 64 pixels.
int blocks_per_sample(int64_t n, int64_t hw, int sm_count) {
    const int64_t want = (4 * static_cast<int64_t>(std::max(sm_count, 1)) + n - 1) / n;
    return static_cast<int>(std::clamp<int64_t>(want, 1, std::max<int64_t>(1, hw / 64)));
}

template <typename T, int V>
void launch_gn(const GroupNormNhwcArgs& a, cudaStream_t s) {
    const int bpn = blocks_per_sample(a.n, a.hw, a.sm_count), c = static_cast<int>(a.c);
    auto* partial = reinterpret_cast<float2*>(a.workspace);
    float* scale = a.workspace + 2 * a.n * bpn * a.c;
    float* shift = scale + a.n * a.c;
    const auto* x = static_cast<const T*>(a.x);
    gn_stats_kernel<T, V><<<dim3(bpn, static_cast<unsigned>(a.n)), kThreads, 0, s>>>(
        x, a.in_bias, a.in_bias_per_sample, a.hw, c, bpn, partial);
    gn_finalize_kernel<<<static_cast<unsigned>(a.n), 32, 0, s>>>(
        partial, a.in_bias, a.in_bias_per_sample, a.weight, a.bias, a.hw, c, static_cast<int>(a.groups), bpn,
        a.eps, scale, shift);
    const int64_t packs = a.n * a.hw * a.c / V;
    auto* out = static_cast<T*>(a.out);
    if (a.silu)
        gn_apply_kernel<T, V, true>
            <<<blocks_for(packs, kThreads), kThreads, 0, s>>>(x, out, scale, shift, a.hw * a.c, c, packs);
    else
        gn_apply_kernel<T, V, false>
            <<<blocks_for(packs, kThreads), kThreads, 0, s>>>(x, out, scale, shift, a.hw * a.c, c, packs);
}

template <typename T>
int dispatch_gn(const GroupNormNhwcArgs& a, cudaStream_t s) {
    constexpr int kVec = 16 / sizeof(T);
    if (a.c % kVec == 0 && a.c / kVec <= kThreads && aligned16(a.x) && aligned16(a.out))
        launch_gn<T, kVec>(a, s);
    else if (a.c <= kThreads)
        launch_gn<T, 1>(a, s);
    else
        return static_cast<int>(cudaErrorInvalidValue);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int dispatch_add(const void* h, const float* bias, const void* residual, void* out, int64_t rows, int64_t c,
                 float scale, cudaStream_t s) {
    constexpr int kVec = 16 / sizeof(T);
    auto* hp = static_cast<const T*>(h);
    auto* rp = static_cast<const T*>(residual);
    auto* op = static_cast<T*>(out);
    const int64_t total = rows * c;
    if (c % kVec == 0 && aligned16(h) && aligned16(out) && (!residual || aligned16(residual)))
        add_bias_residual_kernel<T, kVec><<<blocks_for(total / kVec, kThreads), kThreads, 0, s>>>(
            hp, bias, rp, op, static_cast<int>(c), total / kVec, scale);
    else
        add_bias_residual_kernel<T, 1><<<blocks_for(total, kThreads), kThreads, 0, s>>>(
            hp, bias, rp, op, static_cast<int>(c), total, scale);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

bool group_norm_nhwc_supported(int64_t c, int64_t groups, KernelDtype dtype) {
    const int64_t vec = dtype == KernelDtype::kFloat ? 4 : 8;
    return groups > 0 && c % groups == 0 && (c <= kThreads || (c % vec == 0 && c / vec <= kThreads));
}

int current_device_sm_count() {
    int device = 0, count = 1;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
        return 1;
    return count;
}

int64_t group_norm_nhwc_workspace_floats(int64_t n, int64_t hw, int64_t c, int sm_count) {
    return 2 * n * blocks_per_sample(n, hw, sm_count) * c + 2 * n * c;
}

int group_norm_nhwc(const GroupNormNhwcArgs& args, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    switch (args.dtype) {
        case KernelDtype::kFloat: return dispatch_gn<float>(args, s);
        case KernelDtype::kBFloat16: return dispatch_gn<__nv_bfloat16>(args, s);
        case KernelDtype::kHalf: return dispatch_gn<__half>(args, s);
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

int add_bias_residual_nhwc(const void* h, const float* bias, const void* residual, void* out, int64_t rows,
                           int64_t c, float scale, KernelDtype dtype, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    switch (dtype) {
        case KernelDtype::kFloat: return dispatch_add<float>(h, bias, residual, out, rows, c, scale, s);
        case KernelDtype::kBFloat16:
            return dispatch_add<__nv_bfloat16>(h, bias, residual, out, rows, c, scale, s);
        case KernelDtype::kHalf: return dispatch_add<__half>(h, bias, residual, out, rows, c, scale, s);
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace dtune::models::cuda
