// Joint-attention inputs on the GPU (see qk_norm_rope_kernels.h). Composite, the same work is a
// contiguous copy of each strided q/k slice, an RMS norm forward and backward per stream, a cat per
// tensor and a rotary pass each way; here one launch each way. Each row (token, head) of D elements
// is held by `lanes` = D / V threads, V elements (16 bytes) each; the row's sums go round the lanes
// by xor shuffles. Every thread of a warp runs the same loop trips (rows past the end compute on
// zeros and store nothing), so the shuffles never see a lane that left.
#include <cstdint>

#include "models/cuda/kernel_utils.cuh"
#include "models/cuda/qk_norm_rope_kernels.h"

namespace dtune::models::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBackwardBlocks = 1024;  // bounds the weight-gradient partial sums
constexpr int kRows = 2;                      // rows per lane group and trip, where the heads allow

__device__ __forceinline__ float lanes_sum(float v, int lanes) {
    for (int o = lanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Where one row lives: its stream, the position in the stream, and the joint indices.
struct RowAt {
    int stream;
    int64_t b, s, local, h;
};

__device__ __forceinline__ RowAt locate(const JointQKVStreams& in, int64_t row, int64_t seq, int64_t heads) {
    RowAt r;
    r.h = row % heads;
    const int64_t bs = row / heads;
    r.s = bs % seq;
    r.b = bs / seq;
    r.stream = in.streams == 2 && r.s >= in.seq[0] ? 1 : 0;
    r.local = r.stream == 1 ? r.s - in.seq[0] : r.s;
    return r;
}

template <typename T>
__device__ __forceinline__ const T* source(const JointQKVStreams& in, const RowAt& r, int which,
                                           int64_t dim) {
    return static_cast<const T*>(in.src[r.stream][which]) + r.b * in.batch_stride[r.stream][which] +
           r.local * in.token_stride[r.stream][which] + r.h * dim;
}

template <int V>
__device__ __forceinline__ void load_floats(const float* p, float (&v)[V]) {
#pragma unroll
    for (int k = 0; k < V; k += 4) {
        const float4 f = *reinterpret_cast<const float4*>(p + k);
        v[k] = f.x;
        v[k + 1] = f.y;
        v[k + 2] = f.z;
        v[k + 3] = f.w;
    }
}

// rsqrt(mean(x²) + eps) of the row whose V elements this lane holds (every lane gets it).
template <int V>
__device__ __forceinline__ float row_rstd(const float (&x)[V], int lanes, int64_t dim, float eps) {
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < V; ++k) ss += x[k] * x[k];
    return rsqrtf(lanes_sum(ss, lanes) / static_cast<float>(dim) + eps);
}

// The tables of a token (its stream's norm weight, cos and sin at its joint position), this lane's part.
template <int V>
struct RowTables {
    float w[V], c[V], n[V];
};

template <int V>
__device__ __forceinline__ void load_tables(const JointQKVStreams& in, const RowAt& r, int which,
                                            const float* cos, const float* sin, int64_t dim, int64_t d0,
                                            RowTables<V>& t) {
    load_floats<V>(in.weight[r.stream][which] + d0, t.w);
    load_floats<V>(cos + r.s * dim + d0, t.c);
    load_floats<V>(sin + r.s * dim + d0, t.n);
}

// blockIdx.y: 0 = q, 1 = k (normalised and rotated), 2 = v (copied). Each lane group takes R
// consecutive rows per trip: R heads of one token (heads % R == 0), so they share the token's
// tables, and every load is issued before the first row's sums go round the lanes.
template <typename T, int V, int R>
__global__ void __launch_bounds__(kThreads)
    joint_forward_kernel(JointQKVStreams in, const float* __restrict__ cos, const float* __restrict__ sin,
                         T* out_q, T* out_k, T* out_v, int64_t batch, int64_t seq, int64_t heads, int64_t dim,
                         int lanes, float eps) {
    const int which = blockIdx.y;
    T* out = which == 0 ? out_q : which == 1 ? out_k : out_v;
    const int group = threadIdx.x / lanes, lane = threadIdx.x % lanes, rows_per_block = kThreads / lanes;
    const int64_t rows = batch * seq * heads, d0 = static_cast<int64_t>(lane) * V, step = rows_per_block * R;
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * step; base < rows;
         base += static_cast<int64_t>(gridDim.x) * step) {
        const int64_t row = base + group * R;  // the first of R; all or none in range
        const bool ok = row < rows;
        const RowAt at = locate(in, ok ? row : 0, seq, heads);
        const T* src = source<T>(in, at, which, dim) + d0;
        Pack<T, V> x[R];
#pragma unroll
        for (int i = 0; i < R; ++i) x[i] = *reinterpret_cast<const Pack<T, V>*>(src + i * dim);
        T* dst = out + row * dim + d0;
        if (which == 2) {  // uniform across the block
#pragma unroll
            for (int i = 0; i < R; ++i)
                if (ok) *reinterpret_cast<Pack<T, V>*>(dst + i * dim) = x[i];
            continue;
        }
        RowTables<V> t;
        load_tables<V>(in, at, which, cos, sin, dim, d0, t);
#pragma unroll
        for (int i = 0; i < R; ++i) {
            float f[V];
#pragma unroll
            for (int k = 0; k < V; ++k) f[k] = to_float(x[i].v[k]);
            const float rstd = row_rstd<V>(f, lanes, dim, eps);
            Pack<T, V> o;
#pragma unroll
            for (int k = 0; k < V; k += 2) {
                const float a = to_float(from_float<T>(f[k] * rstd * t.w[k]));  // the norm's stored output
                const float b = to_float(from_float<T>(f[k + 1] * rstd * t.w[k + 1]));
                o.v[k] = from_float<T>(a * t.c[k] - b * t.n[k]);
                o.v[k + 1] = from_float<T>(b * t.c[k + 1] + a * t.n[k + 1]);
            }
            if (ok) *reinterpret_cast<Pack<T, V>*>(dst + i * dim) = o;
        }
    }
}

// blockIdx.y and the rows of a trip as the forward. dweight partial sums: [which][stream][blockIdx.x][D].
template <typename T, int V, int R, bool Sums>
__global__ void __launch_bounds__(kThreads)
    joint_backward_kernel(JointQKVStreams in, const float* __restrict__ cos, const float* __restrict__ sin,
                          const T* grad_q, const T* grad_k, const T* grad_v, T* grad_in0, T* grad_in1,
                          float* dweight, int64_t batch, int64_t seq, int64_t heads, int64_t dim, int lanes,
                          float eps) {
    extern __shared__ float partial[];  // [rows_per_block][streams][D], with dweight only
    const int which = blockIdx.y;
    const T* grad = which == 0 ? grad_q : which == 1 ? grad_k : grad_v;
    const int group = threadIdx.x / lanes, lane = threadIdx.x % lanes, rows_per_block = kThreads / lanes;
    const int64_t rows = batch * seq * heads, d0 = static_cast<int64_t>(lane) * V, inner = heads * dim,
                  step = rows_per_block * R;
    // Sums (dweight set): Σ gn · x̂ per stream, in two arrays (a dynamic index would put them on the stack)
    float acc0[Sums ? V : 1] = {}, acc1[Sums ? V : 1] = {};
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * step; base < rows;
         base += static_cast<int64_t>(gridDim.x) * step) {
        const int64_t row = base + group * R;
        const bool ok = row < rows;
        const RowAt r = locate(in, ok ? row : 0, seq, heads);
        const T* gsrc = grad + (ok ? row : 0) * dim + d0;
        const int64_t stream_seq = in.streams == 2 ? (r.stream == 0 ? in.seq[0] : in.seq[1]) : seq;
        T* gin = (r.stream == 0 ? grad_in0 : grad_in1) + (r.b * stream_seq + r.local) * 3 * inner +
                 which * inner + r.h * dim + d0;
        Pack<T, V> g[R], x[R];
#pragma unroll
        for (int i = 0; i < R; ++i) g[i] = *reinterpret_cast<const Pack<T, V>*>(gsrc + i * dim);
        if (which == 2) {
#pragma unroll
            for (int i = 0; i < R; ++i)
                if (ok) *reinterpret_cast<Pack<T, V>*>(gin + i * dim) = g[i];
            continue;
        }
        const T* src = source<T>(in, r, which, dim) + d0;
#pragma unroll
        for (int i = 0; i < R; ++i) x[i] = *reinterpret_cast<const Pack<T, V>*>(src + i * dim);
        RowTables<V> t;
        load_tables<V>(in, r, which, cos, sin, dim, d0, t);
#pragma unroll
        for (int i = 0; i < R; ++i) {
            float f[V], gn[V];
#pragma unroll
            for (int k = 0; k < V; ++k) f[k] = to_float(x[i].v[k]);
            const float rstd = row_rstd<V>(f, lanes, dim, eps);
#pragma unroll
            for (int k = 0; k < V;
                 k += 2) {  // the rotation's transpose, stored as the norm's output gradient
                const float a = to_float(g[i].v[k]), b = to_float(g[i].v[k + 1]);
                gn[k] = to_float(from_float<T>(a * t.c[k] + b * t.n[k + 1]));
                gn[k + 1] = to_float(from_float<T>(b * t.c[k + 1] - a * t.n[k]));
            }
            float dot = 0.0f;
#pragma unroll
            for (int k = 0; k < V; ++k) dot += t.w[k] * gn[k] * (f[k] * rstd);
            const float mean = lanes_sum(dot, lanes) / static_cast<float>(dim);
            Pack<T, V> o;
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const float xhat = f[k] * rstd;
                o.v[k] = from_float<T>(rstd * (t.w[k] * gn[k] - xhat * mean));
                if constexpr (Sums) {
                    if (ok && r.stream == 0) acc0[k] += gn[k] * xhat;
                    if (ok && r.stream == 1) acc1[k] += gn[k] * xhat;
                }
            }
            if (ok) *reinterpret_cast<Pack<T, V>*>(gin + i * dim) = o;
        }
    }
    if constexpr (Sums) {
        if (which == 2) return;
        const int streams = in.streams;
        for (int st = 0; st < streams; ++st)
#pragma unroll
            for (int k = 0; k < V; ++k)
                partial[(group * streams + st) * dim + d0 + k] = st == 0 ? acc0[k] : acc1[k];
        __syncthreads();
        for (int64_t i = threadIdx.x; i < streams * dim; i += kThreads) {
            float sum = 0.0f;
            for (int gi = 0; gi < rows_per_block; ++gi) sum += partial[gi * streams * dim + i];
            const int64_t st = i / dim, d = i % dim;
            dweight[((which * streams + st) * gridDim.x + blockIdx.x) * dim + d] = sum;
        }
    }
}

template <typename T>
constexpr int pack_of() {
    return 16 / sizeof(T);
}

int pack_for(KernelDtype dtype) {
    return dtype == KernelDtype::kFloat ? pack_of<float>() : pack_of<__nv_bfloat16>();
}

// Rows per lane group and trip: kRows heads of one token where the head count allows it.
int rows_per_trip(int64_t heads) {
    return heads % kRows == 0 ? kRows : 1;
}

int64_t forward_blocks(int64_t rows, int rows_per_block, int64_t heads) {
    return blocks_for(rows, rows_per_block * rows_per_trip(heads));
}

template <typename T>
int launch_forward(const JointQKVStreams& in, const float* cos, const float* sin, void* const out[3],
                   int64_t batch, int64_t heads, int64_t dim, float eps, cudaStream_t s) {
    constexpr int V = pack_of<T>();
    const int lanes = static_cast<int>(dim / V);
    int64_t seq = 0;
    for (int i = 0; i < in.streams; ++i) seq += in.seq[i];
    const dim3 grid(static_cast<unsigned>(forward_blocks(batch * seq * heads, kThreads / lanes, heads)), 3);
    T *q = static_cast<T*>(out[0]), *k = static_cast<T*>(out[1]), *v = static_cast<T*>(out[2]);
    if (rows_per_trip(heads) == kRows)
        joint_forward_kernel<T, V, kRows>
            <<<grid, kThreads, 0, s>>>(in, cos, sin, q, k, v, batch, seq, heads, dim, lanes, eps);
    else
        joint_forward_kernel<T, V, 1>
            <<<grid, kThreads, 0, s>>>(in, cos, sin, q, k, v, batch, seq, heads, dim, lanes, eps);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_backward(const JointQKVStreams& in, const float* cos, const float* sin, const void* const grad[3],
                    void* const grad_in[kJointQKVMaxStreams], float* dweight, int64_t batch, int64_t heads,
                    int64_t dim, float eps, cudaStream_t s) {
    constexpr int V = pack_of<T>();
    const int lanes = static_cast<int>(dim / V);
    int64_t seq = 0;
    for (int i = 0; i < in.streams; ++i) seq += in.seq[i];
    const int64_t blocks =
        std::min(forward_blocks(batch * seq * heads, kThreads / lanes, heads), kMaxBackwardBlocks);
    const size_t shared = dweight ? sizeof(float) * (kThreads / lanes) * in.streams * dim : 0;
    const dim3 grid(static_cast<unsigned>(blocks), 3);
    const auto *gq = static_cast<const T*>(grad[0]), *gk = static_cast<const T*>(grad[1]),
               *gv = static_cast<const T*>(grad[2]);
    T *g0 = static_cast<T*>(grad_in[0]), *g1 = static_cast<T*>(in.streams == 2 ? grad_in[1] : grad_in[0]);
    const bool pairs = rows_per_trip(heads) == kRows;
    const auto kernel =
        dweight ? (pairs ? joint_backward_kernel<T, V, kRows, true> : joint_backward_kernel<T, V, 1, true>)
                : (pairs ? joint_backward_kernel<T, V, kRows, false> : joint_backward_kernel<T, V, 1, false>);
    kernel<<<grid, kThreads, shared, s>>>(in, cos, sin, gq, gk, gv, g0, g1, dweight, batch, seq, heads, dim,
                                          lanes, eps);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

bool joint_qkv_supported(const JointQKVStreams& in, const float* cos, const float* sin, int64_t heads,
                         int64_t dim, KernelDtype dtype) {
    const int v = pack_for(dtype);
    const int64_t lanes = dim / v;
    if (in.streams < 1 || in.streams > kJointQKVMaxStreams || heads < 1 || dim % v != 0 || lanes < 1 ||
        lanes > 32 || (lanes & (lanes - 1)) != 0)
        return false;
    if (!aligned16(cos) || !aligned16(sin)) return false;
    for (int st = 0; st < in.streams; ++st) {
        for (int i = 0; i < 3; ++i)
            if (!aligned16(in.src[st][i]) || in.batch_stride[st][i] % v != 0 ||
                in.token_stride[st][i] % v != 0)
                return false;
        for (int i = 0; i < 2; ++i)
            if (!aligned16(in.weight[st][i])) return false;
    }
    return true;
}

int64_t joint_qkv_backward_blocks(int64_t batch, int64_t seq, int64_t heads, int64_t dim, KernelDtype dtype) {
    const int lanes = static_cast<int>(dim / pack_for(dtype));
    return std::min(forward_blocks(batch * seq * heads, kThreads / lanes, heads), kMaxBackwardBlocks);
}

int joint_qk_norm_rope_forward(const JointQKVStreams& in, const float* cos, const float* sin,
                               void* const out[3], int64_t batch, int64_t heads, int64_t dim, float eps,
                               KernelDtype dtype, void* stream) {
    return with_kernel_type(dtype, [&](auto tag) {
        return launch_forward<decltype(tag)>(in, cos, sin, out, batch, heads, dim, eps,
                                             static_cast<cudaStream_t>(stream));
    });
}

int joint_qk_norm_rope_backward(const JointQKVStreams& in, const float* cos, const float* sin,
                                const void* const grad[3], void* const grad_in[kJointQKVMaxStreams],
                                float* dweight, int64_t batch, int64_t heads, int64_t dim, float eps,
                                KernelDtype dtype, void* stream) {
    return with_kernel_type(dtype, [&](auto tag) {
        return launch_backward<decltype(tag)>(in, cos, sin, grad, grad_in, dweight, batch, heads, dim, eps,
                                              static_cast<cudaStream_t>(stream));
    });
}

}  // namespace dtune::models::cuda
