// cuBLASLt GEMMs with epilogues (see epilogue_gemm.h). cuBLASLt is column-major: the row-major
// d [m, n] = a · b is computed as dᵀ [n, m] = bᵀ · aᵀ, so cuBLASLt's first operand is b and its
// second a, and the per-column bias of d is cuBLASLt's per-row bias.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "models/cuda/epilogue_gemm.h"

namespace dtune::models::cuda {
namespace {

// Descriptors that destroy themselves.
struct MatmulDesc {
    cublasLtMatmulDesc_t desc = nullptr;
    ~MatmulDesc() {
        if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
    }
};
struct Layout {
    cublasLtMatrixLayout_t desc = nullptr;
    ~Layout() {
        if (desc != nullptr) cublasLtMatrixLayoutDestroy(desc);
    }
};
struct Preference {
    cublasLtMatmulPreference_t desc = nullptr;
    ~Preference() {
        if (desc != nullptr) cublasLtMatmulPreferenceDestroy(desc);
    }
};

// The largest power of two up to 256 that divides the address (cuBLASLt's alignment preferences).
uint32_t alignment_of(const void* p) {
    const auto v = reinterpret_cast<uintptr_t>(p);
    uint32_t a = 256;
    while (a > 1 && v % a != 0) a /= 2;
    return a;
}

cublasLtEpilogue_t lt_epilogue(GemmEpilogue e) {
    switch (e) {
        case GemmEpilogue::kNone: return CUBLASLT_EPILOGUE_DEFAULT;
        case GemmEpilogue::kBias: return CUBLASLT_EPILOGUE_BIAS;
        case GemmEpilogue::kGeluBias: return CUBLASLT_EPILOGUE_GELU_BIAS;
        case GemmEpilogue::kGeluAuxBias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
        case GemmEpilogue::kDGelu: return CUBLASLT_EPILOGUE_DGELU;
    }
    return CUBLASLT_EPILOGUE_DEFAULT;
}

// Everything the descriptors depend on; the pointers enter through their alignment only.
using PlanKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, int, int,
                           uint32_t, uint32_t, uint32_t, uint32_t, bool>;

PlanKey key_of(const GemmArgs& g, GemmEpilogue e, KernelDtype dtype) {
    return {g.m,
            g.n,
            g.k,
            g.lda,
            g.ldb,
            g.ldd,
            g.ldaux,
            g.b_nk,
            static_cast<int>(e),
            static_cast<int>(dtype),
            alignment_of(g.a),
            alignment_of(g.b),
            alignment_of(g.d),
            alignment_of(g.aux),
            g.accumulate};
}

// The descriptors of one call (the epilogue's pointers set from g).
struct Plan {
    MatmulDesc op;
    Layout lb, la, ld;  // cuBLASLt's A (our b), B (our a), C = D
    cublasStatus_t status = CUBLAS_STATUS_SUCCESS;

    Plan(const GemmArgs& g, GemmEpilogue e, KernelDtype dtype) {
        const cudaDataType_t t = dtype == KernelDtype::kHalf ? CUDA_R_16F : CUDA_R_16BF;
        const auto ok = [&](cublasStatus_t s) {
            if (status == CUBLAS_STATUS_SUCCESS) status = s;
            return status == CUBLAS_STATUS_SUCCESS;
        };
        if (dtype == KernelDtype::kFloat) {
            status = static_cast<cublasStatus_t>(kEpilogueGemmUnsupported);
            return;
        }
        const cublasOperation_t ta = g.b_nk ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
        const cublasLtEpilogue_t epi = lt_epilogue(e);
        if (!ok(cublasLtMatmulDescCreate(&op.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F)) ||
            !ok(cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta))) ||
            !ok(cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb))) ||
            !ok(cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi))))
            return;
        const bool bias =
            e == GemmEpilogue::kBias || e == GemmEpilogue::kGeluBias || e == GemmEpilogue::kGeluAuxBias;
        if (bias && !ok(cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias,
                                                       sizeof(g.bias))))
            return;
        if (e == GemmEpilogue::kGeluAuxBias || e == GemmEpilogue::kDGelu) {
            const int64_t ldaux = g.ldaux;
            if (!ok(cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux,
                                                   sizeof(g.aux))) ||
                !ok(cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ldaux,
                                                   sizeof(ldaux))))
                return;
        }
        const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
        // b: [n, k] row-major is column-major [k, n] read transposed; [k, n] row-major is [n, k].
        if (!ok(g.b_nk ? cublasLtMatrixLayoutCreate(&lb.desc, t, u(g.k), u(g.n), g.ldb)
                       : cublasLtMatrixLayoutCreate(&lb.desc, t, u(g.n), u(g.k), g.ldb)) ||
            !ok(cublasLtMatrixLayoutCreate(&la.desc, t, u(g.k), u(g.m), g.lda)) ||
            !ok(cublasLtMatrixLayoutCreate(&ld.desc, t, u(g.n), u(g.m), g.ldd)))
            return;
    }
};

// What the cache holds for one key: cuBLASLt's candidates, best first by its heuristic, and the one
// the calls take (the first, until epilogue_gemm_tune has timed them).
struct Candidates {
    int count = 0;  // 0: no algorithm
    cublasLtMatmulAlgo_t algo[kEpilogueGemmCandidates] = {};
    int chosen = 0;
    bool tuned = false;
};

struct AlgoCache {
    std::mutex mutex;
    std::map<PlanKey, Candidates> entries;
};

AlgoCache& algo_cache() {
    static AlgoCache cache;
    return cache;
}

// The heuristic's candidates for g (asked once per key).
Candidates ask_heuristic(const GemmArgs& g, cublasLtHandle_t handle, const Plan& plan) {
    Candidates c;
    if (plan.status != CUBLAS_STATUS_SUCCESS) return c;
    Preference pref;
    const uint64_t workspace = kEpilogueGemmWorkspace;
    const uint32_t align_b = alignment_of(g.b), align_a = alignment_of(g.a), align_d = alignment_of(g.d);
    cublasLtMatmulHeuristicResult_t results[kEpilogueGemmCandidates] = {};
    int count = 0;
    if (cublasLtMatmulPreferenceCreate(&pref.desc) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulPreferenceSetAttribute(pref.desc, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                             sizeof(workspace)) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulPreferenceSetAttribute(pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_b,
                                             sizeof(align_b)) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulPreferenceSetAttribute(pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_a,
                                             sizeof(align_a)) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulPreferenceSetAttribute(pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d,
                                             sizeof(align_d)) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulPreferenceSetAttribute(pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                                             sizeof(align_d)) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulAlgoGetHeuristic(handle, plan.op.desc, plan.lb.desc, plan.la.desc, plan.ld.desc,
                                       plan.ld.desc, pref.desc, kEpilogueGemmCandidates, results,
                                       &count) != CUBLAS_STATUS_SUCCESS)
        return c;
    for (int i = 0; i < count; ++i)
        if (results[i].state == CUBLAS_STATUS_SUCCESS) c.algo[c.count++] = results[i].algo;
    return c;
}

// The cache's entry for g, asking the heuristic the first time (a copy: the caller holds no lock).
Candidates candidates_for(const GemmArgs& g, GemmEpilogue e, KernelDtype dtype, cublasLtHandle_t handle,
                          const Plan& plan) {
    AlgoCache& cache = algo_cache();
    const PlanKey key = key_of(g, e, dtype);
    const std::lock_guard<std::mutex> lock(cache.mutex);
    auto it = cache.entries.find(key);
    if (it == cache.entries.end()) it = cache.entries.emplace(key, ask_heuristic(g, handle, plan)).first;
    return it->second;
}

// One run of candidate `algo` writing `d` (g.d unless tuning an accumulating GEMM).
cublasStatus_t run_algo(const GemmArgs& g, const Plan& plan, const cublasLtMatmulAlgo_t& algo, void* d,
                        cublasLtHandle_t handle, void* workspace, cudaStream_t stream) {
    const float alpha = 1.0f, beta = g.accumulate ? 1.0f : 0.0f;
    return cublasLtMatmul(handle, plan.op.desc, &alpha, g.b, plan.lb.desc, g.a, plan.la.desc, &beta, g.d,
                          plan.ld.desc, d, plan.ld.desc, &algo, workspace, kEpilogueGemmWorkspace, stream);
}

// Events that destroy themselves.
struct Event {
    cudaEvent_t e = nullptr;
    Event() { cudaEventCreate(&e); }
    ~Event() {
        if (e != nullptr) cudaEventDestroy(e);
    }
};

}  // namespace

int epilogue_gemm(const GemmArgs& g, GemmEpilogue epilogue, KernelDtype dtype, void* lt_handle,
                  void* workspace, void* stream) {
    const auto handle = static_cast<cublasLtHandle_t>(lt_handle);
    const Plan plan(g, epilogue, dtype);
    const Candidates c = candidates_for(g, epilogue, dtype, handle, plan);
    if (c.count == 0) return plan.status != CUBLAS_STATUS_SUCCESS ? plan.status : kEpilogueGemmUnsupported;
    return run_algo(g, plan, c.algo[c.chosen], g.d, handle, workspace, static_cast<cudaStream_t>(stream));
}

bool epilogue_gemm_wants_tuning(const GemmArgs& g, GemmEpilogue epilogue, KernelDtype dtype,
                                void* lt_handle) {
    const Plan plan(g, epilogue, dtype);
    const Candidates c = candidates_for(g, epilogue, dtype, static_cast<cublasLtHandle_t>(lt_handle), plan);
    return c.count > 1 && !c.tuned;
}

int epilogue_gemm_tune(const GemmArgs& g, GemmEpilogue epilogue, KernelDtype dtype, void* lt_handle,
                       void* workspace, void* stream, void* scratch_d, EpilogueGemmTuning* report) {
    const auto handle = static_cast<cublasLtHandle_t>(lt_handle);
    const auto s = static_cast<cudaStream_t>(stream);
    const Plan plan(g, epilogue, dtype);
    Candidates c = candidates_for(g, epilogue, dtype, handle, plan);
    if (c.count == 0) return plan.status != CUBLAS_STATUS_SUCCESS ? plan.status : kEpilogueGemmUnsupported;
    if (g.accumulate && scratch_d == nullptr) return static_cast<int>(CUBLAS_STATUS_INVALID_VALUE);
    // An accumulating GEMM reads d and writes the scratch, so d keeps its values; the others write
    // d (and aux) as the call after this one will again.
    void* d = g.accumulate ? scratch_d : g.d;
    constexpr int kRuns = 3;
    float best = -1.0f;
    int chosen = 0;
    if (report != nullptr) *report = EpilogueGemmTuning{};
    for (int i = 0; i < c.count; ++i) {
        float us = -1.0f;  // -1: this candidate failed to run (left out)
        Event start, stop;
        if (run_algo(g, plan, c.algo[i], d, handle, workspace, s) == CUBLAS_STATUS_SUCCESS) {  // warm-up
            bool ok = cudaEventRecord(start.e, s) == cudaSuccess;
            for (int r = 0; ok && r < kRuns; ++r)
                ok = run_algo(g, plan, c.algo[i], d, handle, workspace, s) == CUBLAS_STATUS_SUCCESS;
            float ms = 0.0f;
            if (ok && cudaEventRecord(stop.e, s) == cudaSuccess &&
                cudaEventSynchronize(stop.e) == cudaSuccess &&
                cudaEventElapsedTime(&ms, start.e, stop.e) == cudaSuccess)
                us = 1000.0f * ms / kRuns;
        }
        (void)cudaGetLastError();  // a failed candidate's launch error is not the caller's
        if (report != nullptr) report->us[report->count++] = us;
        if (us >= 0.0f && (best < 0.0f || us < best)) {
            best = us;
            chosen = i;
        }
    }
    if (report != nullptr) report->chosen = chosen;
    AlgoCache& cache = algo_cache();
    const std::lock_guard<std::mutex> lock(cache.mutex);
    Candidates& entry = cache.entries[key_of(g, epilogue, dtype)];
    entry.chosen = chosen;
    entry.tuned = true;
    return best < 0.0f ? static_cast<int>(CUBLAS_STATUS_EXECUTION_FAILED) : 0;
}

}  // namespace dtune::models::cuda
