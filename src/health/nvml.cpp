// NVML through dlopen. We declare the few entry points we call ourselves (their C ABI is stable
// across driver versions) instead of needing nvml.h at build time.
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "health/gpu_source.h"

namespace dtune::health {
namespace {

using nvmlReturn_t = int;
using nvmlDevice_t = struct nvmlDevice_st*;
constexpr nvmlReturn_t kNvmlSuccess = 0;
struct NvmlMemory {
    unsigned long long total, free, used;
};
struct NvmlUtilization {
    unsigned gpu, memory;
};

struct NvmlApi {
    void* lib = nullptr;
    nvmlReturn_t (*init)() = nullptr;
    nvmlReturn_t (*shutdown)() = nullptr;
    const char* (*error_string)(nvmlReturn_t) = nullptr;
    nvmlReturn_t (*count)(unsigned*) = nullptr;
    nvmlReturn_t (*handle)(unsigned, nvmlDevice_t*) = nullptr;
    nvmlReturn_t (*name)(nvmlDevice_t, char*, unsigned) = nullptr;
    nvmlReturn_t (*uuid)(nvmlDevice_t, char*, unsigned) = nullptr;
    nvmlReturn_t (*temperature)(nvmlDevice_t, int, unsigned*) = nullptr;
    nvmlReturn_t (*threshold)(nvmlDevice_t, int, unsigned*) = nullptr;
    nvmlReturn_t (*ecc_mode)(nvmlDevice_t, int*, int*) = nullptr;
    nvmlReturn_t (*ecc_total)(nvmlDevice_t, int, int, unsigned long long*) = nullptr;
    nvmlReturn_t (*throttle)(nvmlDevice_t, unsigned long long*) = nullptr;
    nvmlReturn_t (*power)(nvmlDevice_t, unsigned*) = nullptr;
    nvmlReturn_t (*power_limit)(nvmlDevice_t, unsigned*) = nullptr;
    nvmlReturn_t (*memory)(nvmlDevice_t, NvmlMemory*) = nullptr;
    nvmlReturn_t (*utilization)(nvmlDevice_t, NvmlUtilization*) = nullptr;
};

template <typename F>
bool bind(void* lib, F*& fn, std::initializer_list<const char*> names) {
    for (const char* n : names) {
        fn = reinterpret_cast<F*>(dlsym(lib, n));
        if (fn) return true;
    }
    return false;
}

class NvmlSource : public GpuSource {
  public:
    explicit NvmlSource(NvmlApi api) : api_(api) {}
    ~NvmlSource() override {
        api_.shutdown();
        dlclose(api_.lib);
    }
    int device_count() override {
        unsigned n = 0;
        return api_.count(&n) == kNvmlSuccess ? static_cast<int>(n) : 0;
    }
    GpuReading read(int index) override;

  private:
    NvmlApi api_;
};

GpuReading NvmlSource::read(int index) {
    GpuReading r;
    r.index = index;
    nvmlDevice_t dev = nullptr;
    nvmlReturn_t rc = api_.handle(static_cast<unsigned>(index), &dev);
    DTUNE_CHECK(rc == kNvmlSuccess, "NVML could not open GPU ", index, ": ", api_.error_string(rc));
    char buf[96] = {0};
    if (api_.name(dev, buf, sizeof buf) == kNvmlSuccess) r.name = buf;
    std::memset(buf, 0, sizeof buf);
    if (api_.uuid(dev, buf, sizeof buf) == kNvmlSuccess) r.uuid = buf;
    unsigned v = 0;
    if (api_.temperature(dev, /*NVML_TEMPERATURE_GPU*/ 0, &v) == kNvmlSuccess)
        r.temperature_c = static_cast<int>(v);
    if (api_.threshold(dev, /*SHUTDOWN*/ 0, &v) == kNvmlSuccess) r.shutdown_c = static_cast<int>(v);
    if (api_.threshold(dev, /*SLOWDOWN*/ 1, &v) == kNvmlSuccess) r.slowdown_c = static_cast<int>(v);
    int current = 0, pending = 0;
    r.ecc_supported = api_.ecc_mode(dev, &current, &pending) == kNvmlSuccess && current == 1;
    unsigned long long count = 0;
    if (r.ecc_supported) {
        // error type 1 = uncorrected, 0 = corrected; counter 0 = volatile, 1 = aggregate
        if (api_.ecc_total(dev, 1, 0, &count) == kNvmlSuccess) r.ecc_uncorrected_volatile = count;
        if (api_.ecc_total(dev, 1, 1, &count) == kNvmlSuccess) r.ecc_uncorrected_aggregate = count;
        if (api_.ecc_total(dev, 0, 0, &count) == kNvmlSuccess) r.ecc_corrected_volatile = count;
    }
    if (api_.throttle(dev, &count) == kNvmlSuccess) r.throttle_reasons = count;
    if (api_.power(dev, &v) == kNvmlSuccess) r.power_w = v / 1000.0;
    if (api_.power_limit(dev, &v) == kNvmlSuccess) r.power_limit_w = v / 1000.0;
    NvmlMemory mem{};
    if (api_.memory(dev, &mem) == kNvmlSuccess) {
        r.memory_used = mem.used;
        r.memory_total = mem.total;
    }
    NvmlUtilization util{};
    if (api_.utilization(dev, &util) == kNvmlSuccess) r.utilization_percent = static_cast<int>(util.gpu);
    return r;
}

}  // namespace

std::unique_ptr<GpuSource> open_nvml(std::string* why_not) {
    auto fail = [&](const std::string& why) -> std::unique_ptr<GpuSource> {
        if (why_not) *why_not = why;
        return nullptr;
    };
    NvmlApi api;
    api.lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!api.lib) return fail(str("cannot load libnvidia-ml.so.1 (", dlerror(), "): no NVIDIA driver here"));
    const bool ok =
        bind(api.lib, api.init, {"nvmlInit_v2", "nvmlInit"}) &&
        bind(api.lib, api.shutdown, {"nvmlShutdown"}) &&
        bind(api.lib, api.error_string, {"nvmlErrorString"}) &&
        bind(api.lib, api.count, {"nvmlDeviceGetCount_v2", "nvmlDeviceGetCount"}) &&
        bind(api.lib, api.handle, {"nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex"}) &&
        bind(api.lib, api.name, {"nvmlDeviceGetName"}) && bind(api.lib, api.uuid, {"nvmlDeviceGetUUID"}) &&
        bind(api.lib, api.temperature, {"nvmlDeviceGetTemperature"}) &&
        bind(api.lib, api.threshold, {"nvmlDeviceGetTemperatureThreshold"}) &&
        bind(api.lib, api.ecc_mode, {"nvmlDeviceGetEccMode"}) &&
        bind(api.lib, api.ecc_total, {"nvmlDeviceGetTotalEccErrors"}) &&
        bind(api.lib, api.throttle,
             {"nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"}) &&
        bind(api.lib, api.power, {"nvmlDeviceGetPowerUsage"}) &&
        bind(api.lib, api.power_limit, {"nvmlDeviceGetEnforcedPowerLimit"}) &&
        bind(api.lib, api.memory, {"nvmlDeviceGetMemoryInfo"}) &&
        bind(api.lib, api.utilization, {"nvmlDeviceGetUtilizationRates"});
    if (!ok) {
        dlclose(api.lib);
        return fail("libnvidia-ml.so.1 lacks an NVML function dtune needs: the driver is too old");
    }
    nvmlReturn_t rc = api.init();
    if (rc != kNvmlSuccess) {
        std::string why = str("nvmlInit failed: ", api.error_string(rc));
        dlclose(api.lib);
        return fail(why);
    }
    return std::make_unique<NvmlSource>(api);
}

}  // namespace dtune::health
