// DTUNE_FUSED_KERNELS: a process-wide way to turn off every fused path of dtune's own (the GEGLU
// kernels, the LoRA training linear, the channels-last inference blocks, adamw_bf16's CUDA
// kernel), so a suspected numerical or kernel problem can be checked against the plain ATen ops
// without rebuilding. "0", "off" or "false" turns them off; unset, empty, "1", "on" or "true" leaves
// them on. The per-path switches (models::set_fused_geglu, ...) still apply on top.
#pragma once

#include <atomic>
#include <optional>
#include <string_view>

namespace dtune {

// The value's meaning: true = fused paths on, false = off; nullopt for anything else.
std::optional<bool> parse_fused_kernels_value(std::string_view value);

// Reads DTUNE_FUSED_KERNELS now (cheap: called on hot paths). Throws UsageError naming the variable
// and the accepted values when it holds anything else.
bool fused_kernels_allowed();
// A per-path switch of the same values (e.g. DTUNE_FUSED_QKV), read from the environment by the
// caller once: unset or empty = on (the default); otherwise as above. Throws UsageError naming the
// variable with what 1 (`on_meaning`) and 0 (`off_meaning`) do for anything else.
bool fused_switch_from_env(const char* name, std::string_view on_meaning, std::string_view off_meaning);

// One such per-path switch (DTUNE_FUSED_QK_NORM_ROPE, ...) as an object with constant
// initialisation (define it at namespace scope): the variable is read on first use, not during
// static initialisation, so a bad value reaches the CLI as the UsageError above (and again on the
// next read until it is fixed); set() overrides it in-process (tests, benchmarks).
class FusedPathSwitch {
  public:
    constexpr FusedPathSwitch(const char* name, std::string_view on_meaning, std::string_view off_meaning)
        : name_(name), on_meaning_(on_meaning), off_meaning_(off_meaning) {}
    // The switch alone (the environment's value, or the last set()).
    bool on();
    // on() and fused_kernels_allowed(): what a fused path asks before it runs.
    bool enabled() { return on() && fused_kernels_allowed(); }
    void set(bool on) { state_.store(on ? 1 : 0); }

  private:
    const char* name_;
    std::string_view on_meaning_, off_meaning_;
    std::atomic<int> state_{-1};  // -1: not read yet
};

}  // namespace dtune
