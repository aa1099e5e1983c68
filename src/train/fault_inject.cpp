// DTUNE_INJECT_STEP_ERROR and DTUNE_INJECT_SAVE_ERROR (see fault_inject.h).
#include "train/fault_inject.h"

#include <c10/util/Exception.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "core/error.h"

namespace dtune::train {

namespace {

// `variable`=<kind>:<rank>:<step>: fails as the kind says when (rank, step) match; `where` ends the
// messages ("at step 3", "while saving the checkpoint of step 4").
void inject_error(const char* variable, int rank, int64_t step, const std::string& where) {
    const char* env = std::getenv(variable);
    if (!env || !*env) return;
    const std::string value = env;
    const auto a = value.find(':'), b = value.rfind(':');
    const std::string kind = value.substr(0, a);
    char* end = nullptr;
    const long want_rank = a == b ? -1 : std::strtol(value.c_str() + a + 1, &end, 10);
    const bool rank_ok = a != b && end == value.c_str() + b;
    const long long want_step = b == std::string::npos ? -1 : std::strtoll(value.c_str() + b + 1, &end, 10);
    DTUNE_CHECK_AS(
        UsageError,
        (kind == "cuda" || kind == "error" || kind == "kill") && rank_ok && *end == '\0' && want_step > 0,
        variable, "='", value, "' is not <kind>:<rank>:<step> with kind cuda, error or kill, e.g. cuda:1:3");
    if (want_rank != rank || want_step != step) return;
    if (kind == "kill") {
        // A death nothing in the process can report (as the OOM killer's): the launcher has to.
        std::fprintf(stderr, "injected SIGKILL (%s) on rank %d %s\n", variable, rank, where.c_str());
        std::fflush(stderr);
        ::raise(SIGKILL);
    }
    if (kind == "cuda")
        // The text and type libtorch raises for cudaErrorIllegalAddress (700).
        throw c10::AcceleratorError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, 700,
                                    "CUDA error: an illegal memory access was encountered (injected by " +
                                        std::string(variable) + ")");
    throw std::runtime_error("injected failure (" + std::string(variable) + ") on rank " +
                             std::to_string(rank) + " " + where);
}

}  // namespace

void inject_step_error(int rank, int64_t step) {
    inject_error("DTUNE_INJECT_STEP_ERROR", rank, step, "at step " + std::to_string(step));
}

void inject_save_error(int rank, int64_t step) {
    inject_error("DTUNE_INJECT_SAVE_ERROR", rank, step,
                 "while saving the checkpoint of step " + std::to_string(step));
}

InjectPoint inject_point() {
    const char* env = std::getenv("DTUNE_INJECT_POINT");
    if (!env || !*env || std::string(env) == "step") return InjectPoint::kStep;
    DTUNE_CHECK_AS(UsageError, std::string(env) == "zero3_gather", "DTUNE_INJECT_POINT='", env,
                   "' is not step or zero3_gather");
    return InjectPoint::kZero3Gather;
}

}  // namespace dtune::train
