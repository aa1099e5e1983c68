// DTUNE_FUSED_KERNELS (see fused_env.h).
#include "core/fused_env.h"

#include <cstdlib>
#include <string>

#include "core/error.h"

namespace dtune {

std::optional<bool> parse_fused_kernels_value(std::string_view v) {
    if (v.empty() || v == "1" || v == "on" || v == "true") return true;
    if (v == "0" || v == "off" || v == "false") return false;
    return std::nullopt;
}

bool fused_kernels_allowed() {
    const char* env = std::getenv("DTUNE_FUSED_KERNELS");
    if (!env) return true;
    if (auto on = parse_fused_kernels_value(env)) return *on;
    throw UsageError(std::string("DTUNE_FUSED_KERNELS='") + env +
                     "' is not understood; use 0 (or off/false) to turn dtune's fused kernels off, 1 (or "
                     "on/true, or unset) to keep them");
}

}  // namespace dtune
