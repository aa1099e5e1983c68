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

bool fused_switch_from_env(const char* name, std::string_view on_meaning, std::string_view off_meaning) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return true;
    const std::optional<bool> on = parse_fused_kernels_value(v);
    if (!on)
        throw UsageError(std::string(name) + "=" + v + " is not a choice: use 1 (" + std::string(on_meaning) +
                         ", the default) or 0 (" + std::string(off_meaning) + ")");
    return *on;
}

bool FusedPathSwitch::on() {
    int state = state_.load();
    if (state < 0) {
        // Two first readers compute the same value; a set() in between wins.
        const int read = fused_switch_from_env(name_, on_meaning_, off_meaning_) ? 1 : 0;
        state_.compare_exchange_strong(state, read);
        state = state_.load();
    }
    return state == 1;
}

}  // namespace dtune
