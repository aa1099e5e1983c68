// Shared GpuSource helpers and the fault-injection wrapper.
#include <cstdlib>

#include "core/error.h"
#include "health/gpu_source.h"

namespace dtune::health {

std::vector<std::string> throttle_reason_names(uint64_t bits) {
    static const std::pair<uint64_t, const char*> kNames[] = {
        {kThrottleGpuIdle, "gpu_idle"},
        {kThrottleAppClocks, "applications_clocks_setting"},
        {kThrottleSwPowerCap, "sw_power_cap"},
        {kThrottleHwSlowdown, "hw_slowdown"},
        {kThrottleSyncBoost, "sync_boost"},
        {kThrottleSwThermal, "sw_thermal_slowdown"},
        {kThrottleHwThermal, "hw_thermal_slowdown"},
        {kThrottleHwPowerBrake, "hw_power_brake_slowdown"},
    };
    std::vector<std::string> out;
    for (const auto& [bit, name] : kNames)
        if (bits & bit) out.emplace_back(name);
    return out;
}

std::vector<GpuReading> GpuSource::read_all() {
    std::vector<GpuReading> out;
    const int n = device_count();
    for (int i = 0; i < n; ++i) out.push_back(read(i));
    return out;
}

namespace {

class InjectingSource : public GpuSource {
  public:
    InjectingSource(std::unique_ptr<GpuSource> inner, std::string fault)
        : inner_(std::move(inner)), fault_(fault) {}
    int device_count() override { return inner_->device_count(); }
    GpuReading read(int index) override {
        GpuReading r = inner_->read(index);
        // The first reading of GPU 0 is left alone so that it becomes the breaker's baseline and
        // the fault appears afterwards, as a real one would.
        if (index != 0 || reads_++ == 0) return r;
        if (fault_ == "ecc") {
            r.ecc_supported = true;
            r.ecc_uncorrected_volatile += 100;
            r.ecc_uncorrected_aggregate += 100;
        } else if (fault_ == "temperature") {
            r.shutdown_c = r.shutdown_c > 0 ? r.shutdown_c : 90;
            r.temperature_c = r.shutdown_c;
        } else if (fault_ == "hw_slowdown") {
            r.throttle_reasons |= kThrottleHwSlowdown;
        } else if (fault_ == "power_brake") {
            r.throttle_reasons |= kThrottleHwPowerBrake;
        } else if (fault_ == "thermal") {
            r.throttle_reasons |= kThrottleHwThermal;
        }
        return r;
    }

  private:
    std::unique_ptr<GpuSource> inner_;
    std::string fault_;
    int reads_ = 0;
};

}  // namespace

std::unique_ptr<GpuSource> maybe_inject_faults(std::unique_ptr<GpuSource> inner) {
    const char* env = std::getenv("DTUNE_INJECT_GPU_FAULT");
    if (!env || !*env || !inner) return inner;
    const std::string fault = env;
    DTUNE_CHECK_AS(UsageError,
                   fault == "ecc" || fault == "temperature" || fault == "hw_slowdown" ||
                       fault == "power_brake" || fault == "thermal",
                   "DTUNE_INJECT_GPU_FAULT='", fault,
                   "' is not one of ecc, temperature, hw_slowdown, power_brake, thermal");
    return std::make_unique<InjectingSource>(std::move(inner), fault);
}

namespace {

class SimulatedSource final : public GpuSource {
  public:
    int device_count() override { return 1; }
    GpuReading read(int index) override {
        GpuReading r;
        r.index = index;
        r.name = "simulated";
        r.uuid = "GPU-00000000-0000-0000-0000-000000000000";
        r.temperature_c = 40;
        r.slowdown_c = 90;
        r.shutdown_c = 95;
        r.ecc_supported = true;
        r.power_w = 100;
        r.power_limit_w = 700;
        r.memory_total = 80ull << 30;
        r.utilization_percent = 0;
        return r;
    }
};

}  // namespace

std::unique_ptr<GpuSource> simulated_gpu_source() {
    return std::make_unique<SimulatedSource>();
}

std::unique_ptr<GpuSource> open_monitor_source(std::string* why_not) {
    auto source = open_nvml(why_not);
    const char* inject = std::getenv("DTUNE_INJECT_GPU_FAULT");
    if (!source && inject && *inject) source = simulated_gpu_source();
    return maybe_inject_faults(std::move(source));
}

}  // namespace dtune::health
