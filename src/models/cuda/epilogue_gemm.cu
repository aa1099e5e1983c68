// cuBLASLt GEMMs with epilogues (see epilogue_gemm.h). cuBLASLt is column-major: the row-major
// d [m, n] = a · b is computed as dᵀ [n, m] = bᵀ · aᵀ, so cuBLASLt's first operand is b and its
// second a, and the per-column bias of d is cuBLASLt's per-row bias.
#include <cublasLt.h>

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
        if (e != GemmEpilogue::kDGelu &&
            !ok(cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias,
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

struct AlgoCache {
    std::mutex mutex;
    std::map<PlanKey, std::pair<bool, cublasLtMatmulAlgo_t>> algos;  // false: none found
};

AlgoCache& algo_cache() {
    static AlgoCache cache;
    return cache;
}

// The cached algorithm for g (asking cuBLASLt's heuristic the first time): nullptr when none.
const cublasLtMatmulAlgo_t* algo_for(const GemmArgs& g, GemmEpilogue e, KernelDtype dtype,
                                     cublasLtHandle_t handle, const Plan& plan) {
    AlgoCache& cache = algo_cache();
    const PlanKey key = key_of(g, e, dtype);
    const std::lock_guard<std::mutex> lock(cache.mutex);
    auto it = cache.algos.find(key);
    if (it == cache.algos.end()) {
        std::pair<bool, cublasLtMatmulAlgo_t> found{false, {}};
        Preference pref;
        const uint64_t workspace = kEpilogueGemmWorkspace;
        const uint32_t align_b = alignment_of(g.b), align_a = alignment_of(g.a), align_d = alignment_of(g.d);
        cublasLtMatmulHeuristicResult_t result{};
        int count = 0;
        if (plan.status == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulPreferenceCreate(&pref.desc) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulPreferenceSetAttribute(pref.desc, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                 &workspace, sizeof(workspace)) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulPreferenceSetAttribute(pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                 &align_b, sizeof(align_b)) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulPreferenceSetAttribute(pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                 &align_a, sizeof(align_a)) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulPreferenceSetAttribute(pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                 &align_d, sizeof(align_d)) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulPreferenceSetAttribute(pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                 &align_d, sizeof(align_d)) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulAlgoGetHeuristic(handle, plan.op.desc, plan.lb.desc, plan.la.desc, plan.ld.desc,
                                           plan.ld.desc, pref.desc, 1, &result,
                                           &count) == CUBLAS_STATUS_SUCCESS &&
            count > 0 && result.state == CUBLAS_STATUS_SUCCESS)
            found = {true, result.algo};
        it = cache.algos.emplace(key, found).first;
    }
    return it->second.first ? &it->second.second : nullptr;
}

}  // namespace

int epilogue_gemm(const GemmArgs& g, GemmEpilogue epilogue, KernelDtype dtype, void* lt_handle,
                  void* workspace, void* stream) {
    const auto handle = static_cast<cublasLtHandle_t>(lt_handle);
    const Plan plan(g, epilogue, dtype);
    const cublasLtMatmulAlgo_t* algo = algo_for(g, epilogue, dtype, handle, plan);
    if (algo == nullptr) return plan.status != CUBLAS_STATUS_SUCCESS ? plan.status : kEpilogueGemmUnsupported;
    const float alpha = 1.0f, beta = g.accumulate ? 1.0f : 0.0f;
    return cublasLtMatmul(handle, plan.op.desc, &alpha, g.b, plan.lb.desc, g.a, plan.la.desc, &beta, g.d,
                          plan.ld.desc, g.d, plan.ld.desc, algo, workspace, kEpilogueGemmWorkspace,
                          static_cast<cudaStream_t>(stream));
}

}  // namespace dtune::models::cuda
