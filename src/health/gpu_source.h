// Readings of the node's GPUs, behind an interface so that the circuit breaker's logic can be fed
// recorded readings in tests, and NVML is only one implementation of it.
//
// NVML is loaded at run time with dlopen("libnvidia-ml.so.1"): dtune runs on machines without an
// NVIDIA driver, and open_nvml() then returns nullptr with the reason.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dtune::health {

// NVML's clock-throttle ("clocks event") reason bits.
inline constexpr uint64_t kThrottleGpuIdle = 0x1;
inline constexpr uint64_t kThrottleAppClocks = 0x2;
inline constexpr uint64_t kThrottleSwPowerCap = 0x4;
inline constexpr uint64_t kThrottleHwSlowdown = 0x8;
inline constexpr uint64_t kThrottleSyncBoost = 0x10;
inline constexpr uint64_t kThrottleSwThermal = 0x20;
inline constexpr uint64_t kThrottleHwThermal = 0x40;
inline constexpr uint64_t kThrottleHwPowerBrake = 0x80;

// Names of the set bits, e.g. {"sw_power_cap", "hw_slowdown"}.
std::vector<std::string> throttle_reason_names(uint64_t bits);

struct GpuReading {
    int index = 0;
    std::string name;
    std::string uuid;
    // -1 where the GPU does not report the value.
    int temperature_c = -1;
    int slowdown_c = -1;  // NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
    int shutdown_c = -1;  // NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
    bool ecc_supported = false;
    uint64_t ecc_uncorrected_volatile = 0;
    uint64_t ecc_uncorrected_aggregate = 0;
    uint64_t ecc_corrected_volatile = 0;
    uint64_t throttle_reasons = 0;
    double power_w = -1, power_limit_w = -1;
    uint64_t memory_used = 0, memory_total = 0;
    int utilization_percent = -1;
};

class GpuSource {
  public:
    virtual ~GpuSource() = default;
    virtual int device_count() = 0;
    virtual GpuReading read(int index) = 0;
    std::vector<GpuReading> read_all();
};

// nullptr when NVML cannot be loaded or initialised; `why_not` then says why.
std::unique_ptr<GpuSource> open_nvml(std::string* why_not);

// Wraps a source and, for testing the whole fault path on real hardware, alters GPU 0's readings
// as DTUNE_INJECT_GPU_FAULT asks: "ecc" (+100 uncorrectable errors), "temperature" (at the
// shutdown threshold), "hw_slowdown", "power_brake", "thermal" (hw thermal slowdown, a warning).
// Returns `inner` unchanged when the variable is unset. Throws UsageError for an unknown value.
std::unique_ptr<GpuSource> maybe_inject_faults(std::unique_ptr<GpuSource> inner);

// One healthy simulated GPU ("simulated", 40 C of 90/95 C, ECC on, no throttling): what the
// training monitor reads when DTUNE_INJECT_GPU_FAULT is set on a machine without NVML, so the
// whole fault path (breaker, gpu.fault webhook, stop of every rank, exit 75) runs on CPU in tests.
std::unique_ptr<GpuSource> simulated_gpu_source();

// The monitor's source: NVML; else, when DTUNE_INJECT_GPU_FAULT is set, the simulated GPU; then
// wrapped by maybe_inject_faults. nullptr (with `why_not`) when there is nothing to monitor.
std::unique_ptr<GpuSource> open_monitor_source(std::string* why_not);

}  // namespace dtune::health
