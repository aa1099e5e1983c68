// Fused channels-last GroupNorm (+ input bias, + SiLU) and bias + residual add for inference. NHWC
// keeps each pixel's channels contiguous, so a group's statistics are partial sums over pixel rows:
//   1. stats:    a [bpn, n] grid; each block sums x + in_bias and its square per channel over its
//                slice of pixels (float, 16-byte loads), then writes one float2 per channel;
//   2. finalize: one block per (group, sample) combines the group's partials in double (mean,
//                variance -> rstd) and folds rstd, the affine weights and the input bias into a
//                per-(sample, channel) scale and shift;
//   3. apply:    y = x * scale + shift (then SiLU), rounded once to the storage type.
// Two reads and one write of x, against ATen's composite (input bias add, NHWC->NCHW copy, moments,
// normalise, SiLU, copy back) which reads and writes it several times.
// The backward (training, no input bias) has the same three steps: per-block channel sums of dz and
// dz * x_hat (dz: the output gradient through SiLU, whose input is recomputed from x), per-(sample,
// channel) coefficients so that dx = A dz + B x + C, and the pass that writes dx: two reads of dy and
// x and one write of dx, where ATen's GroupNorm and SiLU backward read and write 8 tensors' worth.
// A block covers a pixel row of up to 256 channel packs (512 with the wider block: SDXL's 2560-channel
// up-block inputs).
#include <atomic>
#include <cstdint>

#include "models/cuda/group_norm_kernels.h"
#include "models/cuda/kernel_utils.cuh"

namespace dtune::models::cuda {
namespace {

constexpr int kThreads = 256;

constexpr int kWideThreads = 512;

// The end of a statistics kernel: the block's threads hold per-channel sums (s, q) over their pixel
// rows; they are added up row by row (a fixed order) and written as the block's float2 partials of
// its lane's V channels, out = partial + ((n * bpn + b) * c + lane * V).
template <int V>
__device__ __forceinline__ void write_block_partials(const float (&s)[V], const float (&q)[V], float2* sums,
                                                     int lane, int lanes, int row, int rows, float2* out) {
#pragma unroll
    for (int k = 0; k < V; ++k) sums[threadIdx.x * V + k] = make_float2(s[k], q[k]);
    __syncthreads();
    if (row != 0) return;
#pragma unroll
    for (int k = 0; k < V; ++k) {
        float2 t = make_float2(0.f, 0.f);
        for (int i = 0; i < rows; ++i) {
            const float2 u = sums[(i * lanes + lane) * V + k];
            t.x += u.x;
            t.y += u.y;
        }
        out[k] = t;
    }
}

template <typename T, int V, int kBlock>
__global__ void __launch_bounds__(kBlock)
    gn_stats_kernel(const T* __restrict__ x, const float* __restrict__ in_bias, bool per_sample, int64_t hw,
                    int c, int bpn, float2* __restrict__ partial) {
    __shared__ float2 sums[kBlock * V];
    const int n = blockIdx.y, b = blockIdx.x;
    const int lanes = c / V, rows = kBlock / lanes;  // lanes per pixel, pixels per iteration
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
    write_block_partials<V>(s, q, sums, lane, lanes, row, rows,
                            partial + (static_cast<int64_t>(n) * bpn + b) * c + lane * V);
}

constexpr int kFinalizeThreads = 256;
constexpr int kMaxGroupChannels = 1024;  // group_norm_nhwc_supported keeps c / groups within it

// The sums of one (sample n, group g) over the statistics blocks, per channel of the group: chan[ch]
// (shared, [cg]) = sum over b of partial[(n * bpn + b) * c + g * cg + ch], in double. Every thread of
// the block takes part: with few channels per group, several threads share a channel's blocks.
__device__ void sum_group_partials(const float2* __restrict__ partial, int n, int g, int c, int cg, int bpn,
                                   double2* chan, double2* red) {
    const int t = threadIdx.x;
    const int64_t base = static_cast<int64_t>(n) * bpn * c + static_cast<int64_t>(g) * cg;
    if (cg <= kFinalizeThreads) {
        const int ways = kFinalizeThreads / cg, ch = t % cg, way = t / cg;
        double sx = 0, sy = 0;
        if (way < ways)
            for (int b = way; b < bpn; b += ways) {
                const float2 v = partial[base + static_cast<int64_t>(b) * c + ch];
                sx += v.x;
                sy += v.y;
            }
        red[t] = make_double2(sx, sy);
        __syncthreads();
        if (t < cg) {
            double2 sum = make_double2(0, 0);
            for (int w = 0; w < ways; ++w) {
                sum.x += red[w * cg + t].x;
                sum.y += red[w * cg + t].y;
            }
            chan[t] = sum;
        }
    } else {
        for (int ch = t; ch < cg; ch += kFinalizeThreads) {
            double sx = 0, sy = 0;
            for (int b = 0; b < bpn; ++b) {
                const float2 v = partial[base + static_cast<int64_t>(b) * c + ch];
                sx += v.x;
                sy += v.y;
            }
            chan[ch] = make_double2(sx, sy);
        }
    }
    __syncthreads();
}

// One block per (group, sample): the group's mean and variance (-> rstd) in double, folded with the
// affine weights and the input bias into a per-(sample, channel) scale and shift.
__global__ void __launch_bounds__(kFinalizeThreads)
    gn_finalize_kernel(const float2* __restrict__ partial, const float* __restrict__ in_bias, bool per_sample,
                       const float* __restrict__ weight, const float* __restrict__ bias, int64_t hw, int c,
                       int groups, int bpn, double eps, float* __restrict__ scale, float* __restrict__ shift,
                       float2* __restrict__ mean_rstd) {
    __shared__ double2 chan[kMaxGroupChannels];
    __shared__ double2 red[kFinalizeThreads];
    __shared__ double stat[2];
    const int g = blockIdx.x, n = blockIdx.y, cg = c / groups;
    sum_group_partials(partial, n, g, c, cg, bpn, chan, red);
    if (threadIdx.x == 0) {
        double sum = 0, sum_sq = 0;
        for (int ch = 0; ch < cg; ++ch) {
            sum += chan[ch].x;
            sum_sq += chan[ch].y;
        }
        const double count = static_cast<double>(hw) * cg, mean = sum / count;
        const double var = fmax(sum_sq / count - mean * mean, 0.0);
        stat[0] = mean;
        stat[1] = rsqrt(var + eps);
        if (mean_rstd)
            mean_rstd[static_cast<int64_t>(n) * groups + g] =
                make_float2(static_cast<float>(stat[0]), static_cast<float>(stat[1]));
    }
    __syncthreads();
    const double mean = stat[0], rstd = stat[1];
    for (int ch = g * cg + threadIdx.x; ch < (g + 1) * cg; ch += blockDim.x) {
        const double a = rstd * (weight ? weight[ch] : 1.f);
        const double add = in_bias ? in_bias[(per_sample ? static_cast<int64_t>(n) * c : 0) + ch] : 0.f;
        scale[static_cast<int64_t>(n) * c + ch] = static_cast<float>(a);
        shift[static_cast<int64_t>(n) * c + ch] =
            static_cast<float>((bias ? bias[ch] : 0.f) + (add - mean) * a);
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

// The GroupNorm output's gradient dz from the block output's dy: through SiLU (input z) when it
// follows the norm.
template <bool kSilu>
__device__ __forceinline__ float act_grad(float dy, float z) {
    if (!kSilu) return dy;
    const float sig = 1.f / (1.f + expf(-z));
    return dy * sig * (1.f + z * (1.f - sig));
}

// Per-block sums over its pixels, per channel, of dz and dz * x_hat.
template <typename T, int V, int kBlock, bool kSilu>
__global__ void __launch_bounds__(kBlock)
    gn_bwd_stats_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                        const float2* __restrict__ mean_rstd, const float* __restrict__ in_bias,
                        bool per_sample, const float* __restrict__ weight, const float* __restrict__ bias,
                        int64_t hw, int c, int groups, int bpn, float2* __restrict__ partial) {
    __shared__ float2 sums[kBlock * V];
    const int n = blockIdx.y, b = blockIdx.x, cg = c / groups;
    const int lanes = c / V, rows = kBlock / lanes;
    const int lane = threadIdx.x % lanes, row = threadIdx.x / lanes;
    const int64_t per = (hw + bpn - 1) / bpn, begin = b * per, end = min(hw, begin + per);
    float s1[V], s2[V], mu[V], r[V], a[V], sh[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
        const int ch = lane * V + k;
        const float2 mr = mean_rstd[static_cast<int64_t>(n) * groups + ch / cg];
        // With an input bias the norm saw x + in_bias: measured from x, the mean moves by it.
        mu[k] = mr.x - (in_bias ? in_bias[(per_sample ? static_cast<int64_t>(n) * c : 0) + ch] : 0.f);
        r[k] = mr.y;
        a[k] = r[k] * (weight ? weight[ch] : 1.f);
        sh[k] = (bias ? bias[ch] : 0.f) - mu[k] * a[k];
        s1[k] = s2[k] = 0.f;
    }
    if (row < rows) {
        const int64_t base = static_cast<int64_t>(n) * hw * c + lane * V;
        for (int64_t p = begin + row; p < end; p += rows) {
            const Pack<T, V> g = *reinterpret_cast<const Pack<T, V>*>(dy + base + p * c);
            const Pack<T, V> v = *reinterpret_cast<const Pack<T, V>*>(x + base + p * c);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const float xf = to_float(v.v[k]);
                const float dz = act_grad<kSilu>(to_float(g.v[k]), xf * a[k] + sh[k]);
                s1[k] += dz;
                s2[k] += dz * (xf - mu[k]) * r[k];
            }
        }
    }
    write_block_partials<V>(s1, s2, sums, lane, lanes, row, rows,
                            partial + (static_cast<int64_t>(n) * bpn + b) * c + lane * V);
}

// One block per (group, sample): each group's mean of dx_hat = weight * dz (m1) and of
// dx_hat * x_hat (m2), then per channel coef = {a, shift, B, C}: z = a x + shift (the forward's),
// dx = a dz + B x + C with B = -rstd^2 m2 and C = rstd^2 m2 mean - rstd m1. Also the affine
// gradients' per-sample sums.
__global__ void __launch_bounds__(kFinalizeThreads)
    gn_bwd_finalize_kernel(const float2* __restrict__ partial, const float2* __restrict__ mean_rstd,
                           const float* __restrict__ in_bias, bool per_sample,
                           const float* __restrict__ weight, const float* __restrict__ bias, int64_t hw,
                           int c, int groups, int bpn, float* __restrict__ dweight_nc,
                           float* __restrict__ dbias_nc, float4* __restrict__ coef) {
    __shared__ double2 chan[kMaxGroupChannels];
    __shared__ double2 red[kFinalizeThreads];
    __shared__ double stat[2];
    const int g = blockIdx.x, n = blockIdx.y, cg = c / groups;
    sum_group_partials(partial, n, g, c, cg, bpn, chan, red);
    for (int k = threadIdx.x; k < cg; k += blockDim.x) {
        const int64_t nc = static_cast<int64_t>(n) * c + g * cg + k;
        if (dweight_nc) dweight_nc[nc] = static_cast<float>(chan[k].y);
        if (dbias_nc) dbias_nc[nc] = static_cast<float>(chan[k].x);
    }
    if (threadIdx.x == 0) {
        double m1 = 0, m2 = 0;
        for (int k = 0; k < cg; ++k) {
            const double w = weight ? weight[g * cg + k] : 1.0;
            m1 += w * chan[k].x;
            m2 += w * chan[k].y;
        }
        const double count = static_cast<double>(hw) * cg;
        stat[0] = m1 / count;
        stat[1] = m2 / count;
    }
    __syncthreads();
    const float2 mr = mean_rstd[static_cast<int64_t>(n) * groups + g];
    const double rstd = mr.y, m1 = stat[0], m2 = stat[1];
    const double bx = -rstd * rstd * m2;
    for (int ch = g * cg + threadIdx.x; ch < (g + 1) * cg; ch += blockDim.x) {
        // The mean as seen from x (the norm's input less in_bias): z = a x + shift, dx = a dz + B x + C.
        const double mean =
            mr.x - (in_bias ? in_bias[(per_sample ? static_cast<int64_t>(n) * c : 0) + ch] : 0.f);
        const double cx = rstd * rstd * m2 * mean - rstd * m1;
        const double a = rstd * (weight ? weight[ch] : 1.f);
        const double shift = (bias ? bias[ch] : 0.f) - mean * a;
        coef[static_cast<int64_t>(n) * c + ch] = make_float4(static_cast<float>(a), static_cast<float>(shift),
                                                             static_cast<float>(bx), static_cast<float>(cx));
    }
}

template <typename T, int V, bool kSilu>
__global__ void gn_bwd_apply_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx,
                                    const float4* __restrict__ coef, int64_t hwc, int c, int64_t packs) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < packs;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t e = i * V, n = e / hwc;
        const int64_t off = n * c + e % c;
        const Pack<T, V> g = *reinterpret_cast<const Pack<T, V>*>(dy + e);
        const Pack<T, V> v = *reinterpret_cast<const Pack<T, V>*>(x + e);
        Pack<T, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const float4 q = coef[off + k];
            const float xf = to_float(v.v[k]);
            const float dz = act_grad<kSilu>(to_float(g.v[k]), xf * q.x + q.y);
            o.v[k] = from_float<T>(q.x * dz + q.z * xf + q.w);
        }
        *reinterpret_cast<Pack<T, V>*>(dx + e) = o;
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
    const dim3 grid(bpn, static_cast<unsigned>(a.n));
    if (c / V <= kThreads)
        gn_stats_kernel<T, V, kThreads>
            <<<grid, kThreads, 0, s>>>(x, a.in_bias, a.in_bias_per_sample, a.hw, c, bpn, partial);
    else
        gn_stats_kernel<T, V, kWideThreads>
            <<<grid, kWideThreads, 0, s>>>(x, a.in_bias, a.in_bias_per_sample, a.hw, c, bpn, partial);
    gn_finalize_kernel<<<dim3(static_cast<unsigned>(a.groups), static_cast<unsigned>(a.n)), kFinalizeThreads,
                         0, s>>>(partial, a.in_bias, a.in_bias_per_sample, a.weight, a.bias, a.hw, c,
                                 static_cast<int>(a.groups), bpn, a.eps, scale, shift,
                                 reinterpret_cast<float2*>(a.mean_rstd));
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
    if (a.c % kVec == 0 && a.c / kVec <= kWideThreads && aligned16(a.x) && aligned16(a.out))
        launch_gn<T, kVec>(a, s);
    else if (a.c <= kWideThreads)
        launch_gn<T, 1>(a, s);
    else
        return static_cast<int>(cudaErrorInvalidValue);
    return static_cast<int>(cudaGetLastError());
}

template <typename T, int V, bool kSilu>
void launch_gn_backward(const GroupNormNhwcBackwardArgs& a, cudaStream_t s) {
    const int bpn = blocks_per_sample(a.n, a.hw, a.sm_count), c = static_cast<int>(a.c);
    const int groups = static_cast<int>(a.groups);
    auto* coef = reinterpret_cast<float4*>(a.workspace);  // [n, c] (16-byte aligned: the workspace's start)
    auto* partial = reinterpret_cast<float2*>(a.workspace + 4 * a.n * a.c);
    const auto* dy = static_cast<const T*>(a.dy);
    const auto* x = static_cast<const T*>(a.x);
    const auto* mr = reinterpret_cast<const float2*>(a.mean_rstd);
    const dim3 grid(bpn, static_cast<unsigned>(a.n));
    if (c / V <= kThreads)
        gn_bwd_stats_kernel<T, V, kThreads, kSilu><<<grid, kThreads, 0, s>>>(
            dy, x, mr, a.in_bias, a.in_bias_per_sample, a.weight, a.bias, a.hw, c, groups, bpn, partial);
    else
        gn_bwd_stats_kernel<T, V, kWideThreads, kSilu><<<grid, kWideThreads, 0, s>>>(
            dy, x, mr, a.in_bias, a.in_bias_per_sample, a.weight, a.bias, a.hw, c, groups, bpn, partial);
    gn_bwd_finalize_kernel<<<dim3(static_cast<unsigned>(groups), static_cast<unsigned>(a.n)),
                             kFinalizeThreads, 0, s>>>(partial, mr, a.in_bias, a.in_bias_per_sample, a.weight,
                                                       a.bias, a.hw, c, groups, bpn, a.dweight_nc, a.dbias_nc,
                                                       coef);
    const int64_t packs = a.n * a.hw * a.c / V;
    gn_bwd_apply_kernel<T, V, kSilu><<<blocks_for(packs, kThreads), kThreads, 0, s>>>(
        dy, x, static_cast<T*>(a.dx), coef, a.hw * a.c, c, packs);
}

template <typename T>
int dispatch_gn_backward(const GroupNormNhwcBackwardArgs& a, cudaStream_t s) {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec =
        a.c % kVec == 0 && a.c / kVec <= kWideThreads && aligned16(a.dy) && aligned16(a.x) && aligned16(a.dx);
    if (!vec && a.c > kWideThreads) return static_cast<int>(cudaErrorInvalidValue);
    if (vec)
        a.silu ? launch_gn_backward<T, kVec, true>(a, s) : launch_gn_backward<T, kVec, false>(a, s);
    else
        a.silu ? launch_gn_backward<T, 1, true>(a, s) : launch_gn_backward<T, 1, false>(a, s);
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
    return groups > 0 && c % groups == 0 && c / groups <= kMaxGroupChannels &&
           (c <= kWideThreads || (c % vec == 0 && c / vec <= kWideThreads));
}

int current_device_sm_count() {
    // Every GroupNorm and LayerNorm call asks: the attribute is read once per device.
    constexpr int kDevices = 64;
    static std::atomic<int> cached[kDevices] = {};
    int device = 0, count = 1;
    if (cudaGetDevice(&device) != cudaSuccess) return 1;
    if (device >= 0 && device < kDevices && cached[device].load(std::memory_order_relaxed) > 0)
        return cached[device].load(std::memory_order_relaxed);
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 1;
    if (device >= 0 && device < kDevices) cached[device].store(count, std::memory_order_relaxed);
    return count;
}

int64_t group_norm_nhwc_workspace_floats(int64_t n, int64_t hw, int64_t c, int sm_count) {
    return 2 * n * blocks_per_sample(n, hw, sm_count) * c + 2 * n * c;
}

int64_t group_norm_nhwc_backward_workspace_floats(int64_t n, int64_t hw, int64_t c, int sm_count) {
    return 4 * n * c + 2 * n * blocks_per_sample(n, hw, sm_count) * c;
}

int group_norm_nhwc_backward(const GroupNormNhwcBackwardArgs& args, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    switch (args.dtype) {
        case KernelDtype::kFloat: return dispatch_gn_backward<float>(args, s);
        case KernelDtype::kBFloat16: return dispatch_gn_backward<__nv_bfloat16>(args, s);
        case KernelDtype::kHalf: return dispatch_gn_backward<__half>(args, s);
    }
    return static_cast<int>(cudaErrorInvalidValue);
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
