// Circuit breaker decisions and the polling monitor.
#include "health/breaker.h"

#include <algorithm>
#include <cctype>
#include <condition_variable>

#include "core/error.h"
#include "core/log.h"

namespace dtune::health {

const char* fault_type_name(FaultType type) {
    switch (type) {
        case FaultType::kEcc: return "ecc";
        case FaultType::kTemperature: return "temperature";
        case FaultType::kHwSlowdown: return "hw_slowdown";
        case FaultType::kPowerBrake: return "power_brake";
        case FaultType::kCudaError: return "cuda_error";
        case FaultType::kThermalWarning: return "thermal";
    }
    return "?";
}

bool is_cuda_error(const std::string& message) {
    std::string m = message;
    std::transform(m.begin(), m.end(), m.begin(), [](unsigned char c) { return std::tolower(c); });
    // Errors that mean the device (or its link) can no longer be trusted. Deviation from
    // SimpleTuner, which matches any "cuda" and "out of memory": a programming error that merely
    // mentions a CUDA device ("Expected a 'cuda' device type ...") or an out-of-memory is not a
    // hardware fault, and replacing the machine (exit 75) would not help.
    for (const char* needle :
         {"cuda error", "cudaerror", "cudnn_status_execution_failed", "cudnn_status_internal_error",
          "cublas_status_execution_failed", "cublas_status_internal_error", "nccl error", "nccl watchdog",
          "device-side assert", "illegal memory access", "illegal instruction", "launch failure",
          "uncorrectable ecc", "ecc error"})
        if (m.find(needle) != std::string::npos) return true;
    return false;
}

nlohmann::json fault_json(const Finding& f, const std::string& node, int64_t step) {
    nlohmann::json gpu = nlohmann::json::object();
    if (f.reading) {
        const GpuReading& r = *f.reading;
        gpu = {{"index", r.index},
               {"name", r.name},
               {"uuid", r.uuid},
               {"temperature_celsius", r.temperature_c},
               {"temperature_slowdown_celsius", r.slowdown_c},
               {"temperature_shutdown_celsius", r.shutdown_c},
               {"ecc_errors_double", r.ecc_uncorrected_volatile},
               {"ecc_errors_uncorrected_aggregate", r.ecc_uncorrected_aggregate},
               {"ecc_errors_single", r.ecc_corrected_volatile},
               {"throttle_reasons", throttle_reason_names(r.throttle_reasons)},
               {"power_watts", r.power_w},
               {"memory_used_percent",
                r.memory_total ? 100.0 * static_cast<double>(r.memory_used) / r.memory_total : 0.0}};
    } else if (f.gpu_index >= 0) {
        gpu = {{"index", f.gpu_index}};
    }
    return {{"type", fault_type_name(f.type)},
            {"gpu", gpu},
            {"node", node},
            {"step", step},
            {"action_taken", f.fatal ? "circuit_opened" : "none"},
            {"message", f.message}};
}

void CircuitBreaker::set_baseline(const std::vector<GpuReading>& readings) {
    for (const auto& r : readings) ecc_baseline_[r.index] = r.ecc_uncorrected_volatile;
}

void CircuitBreaker::open(const Finding& f) {
    std::lock_guard lock(mutex_);
    if (reason_) return;  // the first fatal finding is the reason
    reason_ = f;
    open_ = true;
}

std::optional<Finding> CircuitBreaker::trip_reason() const {
    std::lock_guard lock(mutex_);
    return reason_;
}

std::vector<Finding> CircuitBreaker::evaluate(const std::vector<GpuReading>& readings) {
    std::vector<Finding> out;
    for (const GpuReading& r : readings) {
        const std::string gpu = str("GPU ", r.index, " (", r.name.empty() ? "?" : r.name, ")");
        if (r.ecc_supported) {
            const uint64_t base =
                ecc_baseline_.count(r.index) ? ecc_baseline_[r.index] : r.ecc_uncorrected_volatile;
            const uint64_t fresh = r.ecc_uncorrected_volatile > base ? r.ecc_uncorrected_volatile - base : 0;
            if (fresh >= config_.ecc_error_threshold)
                out.push_back(
                    {FaultType::kEcc, true, r.index,
                     str(gpu, ": ", fresh, " new uncorrectable ECC error(s) since start (threshold ",
                         config_.ecc_error_threshold, "); its memory is failing"),
                     r});
        }
        if (r.temperature_c >= 0 && r.shutdown_c > 0 &&
            r.temperature_c >= r.shutdown_c - config_.temperature_margin_c)
            out.push_back({FaultType::kTemperature, true, r.index,
                           str(gpu, ": ", r.temperature_c, " C is within ", config_.temperature_margin_c,
                               " C of its shutdown threshold ", r.shutdown_c, " C"),
                           r});
        if (config_.trip_on_hw_slowdown && (r.throttle_reasons & kThrottleHwSlowdown))
            out.push_back({FaultType::kHwSlowdown, true, r.index,
                           str(gpu, ": hardware slowdown is active (power or cooling fault)"), r});
        if (config_.trip_on_power_brake && (r.throttle_reasons & kThrottleHwPowerBrake))
            out.push_back(
                {FaultType::kPowerBrake, true, r.index,
                 str(gpu, ": hardware power-brake slowdown is active (external power supply fault)"), r});
        if (r.throttle_reasons & kThrottleHwThermal)
            out.push_back({FaultType::kThermalWarning, false, r.index,
                           str(gpu, ": hardware thermal slowdown at ", r.temperature_c,
                               " C; training continues slower"),
                           r});
    }
    for (const Finding& f : out)
        if (f.fatal) {
            open(f);
            break;
        }
    return out;
}

std::optional<Finding> CircuitBreaker::record_cuda_error(const std::string& message) {
    if (!is_cuda_error(message)) return std::nullopt;
    if (++cuda_failures_ < config_.cuda_failure_threshold) return std::nullopt;
    Finding f{FaultType::kCudaError, true, -1, "CUDA error in training: " + message, std::nullopt};
    open(f);
    return f;
}

HealthMonitor::HealthMonitor(std::unique_ptr<GpuSource> source, BreakerConfig config,
                             std::function<void(const Finding&)> on_finding)
    : source_(std::move(source)), breaker_(config), on_finding_(std::move(on_finding)) {
    if (!source_) return;
    breaker_.set_baseline(source_->read_all());
    thread_ = std::thread([this] {
        const auto interval = std::chrono::duration<double>(breaker_.config().poll_interval_s);
        std::unique_lock lock(stop_mutex_);
        while (!stop_cv_.wait_for(lock, interval, [this] { return stopping_; })) {
            lock.unlock();
            try {
                poll();
            } catch (const std::exception& e) {
                log::warn() << "GPU health poll failed: " << e.what();
            }
            lock.lock();
        }
    });
}

HealthMonitor::~HealthMonitor() {
    {
        std::lock_guard lock(stop_mutex_);
        stopping_ = true;
    }
    stop_cv_.notify_all();
    if (thread_.joinable()) thread_.join();
}

void HealthMonitor::poll() {
    if (!source_) return;
    std::lock_guard lock(poll_mutex_);
    const bool was_open = breaker_.is_open();
    for (const Finding& f : breaker_.evaluate(source_->read_all())) {
        if (f.fatal) continue;
        auto key = std::make_pair(f.gpu_index, static_cast<int>(f.type));
        if (warned_[key]) continue;
        warned_[key] = true;
        log::warn() << f.message;
        if (on_finding_) on_finding_(f);
    }
    if (!was_open && breaker_.is_open()) {
        const Finding f = *breaker_.trip_reason();
        log::error() << "GPU health circuit breaker open: " << f.message;
        if (on_finding_) on_finding_(f);
    }
}

}  // namespace dtune::health
