// `dtune health`: the GPU health table the circuit breaker sees, once or every few seconds.
#include <chrono>
#include <cstdio>
#include <thread>

#include "cli/command.h"
#include "core/error.h"
#include "health/breaker.h"
#include "health/gpu_source.h"
#include "notify/webhooks.h"

#include <unistd.h>

namespace dtune::cli {
namespace {

// The check cannot run here (sysexits' EX_UNAVAILABLE): not an unexpected error (1), not a fault
// (75). README "Exit codes".
constexpr int kCheckUnavailableExit = static_cast<int>(ExitCode::kUnavailable);

std::string or_dash(int v, const char* unit) {
    return v < 0 ? "-" : std::to_string(v) + unit;
}

void print_table(const std::vector<health::GpuReading>& readings, health::CircuitBreaker& breaker) {
    std::printf("%-3s %-24s %-16s %-15s %-17s %-5s %-13s %s\n", "gpu", "name", "temp/slow/shut",
                "power/limit W", "memory GiB", "util", "ECC uncorr.", "throttle / verdict");
    const auto findings = breaker.evaluate(readings);
    for (const auto& r : readings) {
        char temp[32], power[32], mem[32], ecc[32];
        std::snprintf(temp, sizeof temp, "%s/%s/%s", or_dash(r.temperature_c, "").c_str(),
                      or_dash(r.slowdown_c, "").c_str(), or_dash(r.shutdown_c, "C").c_str());
        std::snprintf(power, sizeof power, "%.0f/%.0f", r.power_w, r.power_limit_w);
        std::snprintf(mem, sizeof mem, "%.1f/%.1f", r.memory_used / 1073741824.0,
                      r.memory_total / 1073741824.0);
        if (r.ecc_supported)
            std::snprintf(ecc, sizeof ecc, "%llu vol/%llu agg",
                          static_cast<unsigned long long>(r.ecc_uncorrected_volatile),
                          static_cast<unsigned long long>(r.ecc_uncorrected_aggregate));
        else
            std::snprintf(ecc, sizeof ecc, "ECC off");
        std::string throttle;
        for (const auto& n : health::throttle_reason_names(r.throttle_reasons))
            throttle += (throttle.empty() ? "" : ",") + n;
        std::string verdict = "ok";
        for (const auto& f : findings)
            if (f.gpu_index == r.index)
                verdict = std::string(f.fatal ? "FAULT " : "warn ") + health::fault_type_name(f.type);
        std::printf("%-3d %-24.24s %-16s %-15s %-17s %-5s %-13s %s%s%s\n", r.index, r.name.c_str(), temp,
                    power, mem, or_dash(r.utilization_percent, "%").c_str(), ecc,
                    throttle.empty() ? "-" : throttle.c_str(), " / ", verdict.c_str());
    }
    std::fflush(stdout);
}

int run_health(const std::vector<std::string>& args) {
    bool watch = false;
    double interval = 5.0;
    std::string webhook_config;
    for (std::size_t i = 0; i < args.size(); ++i) {
        if (args[i] == "--watch")
            watch = true;
        else if (args[i] == "--interval" && i + 1 < args.size())
            interval = std::stod(args[++i]);
        else if (args[i] == "--webhook_config" && i + 1 < args.size())
            webhook_config = args[++i];
        else
            throw UsageError(str("unknown option '", args[i], "' for health; see dtune health --help"));
    }
    // The training monitor's source: NVML, or with DTUNE_INJECT_GPU_FAULT and no NVML one
    // simulated GPU, so the injected fault path runs here as it does in `dtune train`.
    std::string why;
    auto source = health::open_monitor_source(&why);
    if (!source) {
        std::fprintf(stderr,
                     "health: cannot check GPU health on this machine: NVML is not available (%s). "
                     "dtune health needs the NVIDIA driver's libnvidia-ml.so.1; to try the fault path "
                     "without it, set DTUNE_INJECT_GPU_FAULT=ecc (a simulated GPU is checked then).\n",
                     why.c_str());
        return kCheckUnavailableExit;
    }
    std::unique_ptr<notify::Notifier> notifier;
    if (!webhook_config.empty())
        notifier = std::make_unique<notify::Notifier>(notify::parse_webhook_config(webhook_config, "dtune"),
                                                      "dtune-health", true);
    char host[256] = "unknown";
    ::gethostname(host, sizeof host - 1);
    health::CircuitBreaker breaker;
    breaker.set_baseline(source->read_all());
    for (;;) {
        print_table(source->read_all(), breaker);
        if (breaker.is_open() && notifier) {
            const auto f = *breaker.trip_reason();
            notifier->send(notify::gpu_fault(health::fault_type_name(f.type), "critical", f.message,
                                             health::fault_json(f, host, -1)));
            notifier->close(std::chrono::seconds(10));  // bounded, whatever the endpoint does
        }
        if (!watch || breaker.is_open()) break;
        std::this_thread::sleep_for(std::chrono::duration<double>(interval));
        std::printf("\n");
    }
    return breaker.is_open() ? static_cast<int>(ExitCode::kGpuFault) : 0;
}

}  // namespace

DTUNE_REGISTER_COMMAND(health, "health", "show the GPU health readings the circuit breaker acts on",
                       "usage: dtune health [--watch] [--interval SECONDS] [--webhook_config JSON|FILE]\n\n"
                       "Reads every GPU of this machine through NVML (libnvidia-ml.so.1, loaded at run\n"
                       "time): temperature against the slowdown/shutdown thresholds, power, memory,\n"
                       "utilisation, uncorrectable ECC errors and clock-throttle reasons, and the\n"
                       "circuit breaker's verdict. --watch repeats every --interval seconds (default 5)\n"
                       "until a GPU faults; with --webhook_config a fault is posted as gpu.fault.\n"
                       "Exit code 0 when every GPU is healthy, 75 when a GPU is faulty, 69 when the check\n"
                       "cannot run (NVML unavailable: no NVIDIA driver).\n\n"
                       "DTUNE_INJECT_GPU_FAULT=ecc|temperature|hw_slowdown|power_brake|thermal makes GPU 0\n"
                       "report that fault after its first reading, to test the fault path end to end; on a\n"
                       "machine without NVML one simulated GPU is read instead, as in dtune train.\n",
                       run_health);

}  // namespace dtune::cli
