// The GPU health circuit breaker: decides from GPU readings (and CUDA errors seen in training)
// whether the machine is fit to keep training. Once open it stays open: there is no recovery,
// the run stops cleanly and exits with ExitCode::kGpuFault (75) so an orchestrator replaces the
// instance.
//
// Trips (fatal) on: new uncorrectable ECC errors since the baseline reaching ecc_error_threshold;
// temperature within temperature_margin_c of the shutdown threshold; hw_slowdown or
// hw_power_brake throttling; cuda_failure_threshold CUDA errors. hw_thermal_slowdown alone is a
// warning. SimpleTuner's defaults, except ecc_error_threshold (SimpleTuner: 10; we trip on the
// first new uncorrectable error, which on datacenter GPUs already means the job's memory is bad).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "health/gpu_source.h"

namespace dtune::health {

struct BreakerConfig {
    uint64_t ecc_error_threshold = 1;
    int temperature_margin_c = 5;
    bool trip_on_hw_slowdown = true;
    bool trip_on_power_brake = true;
    int cuda_failure_threshold = 1;
    double poll_interval_s = 5.0;
};

enum class FaultType { kEcc, kTemperature, kHwSlowdown, kPowerBrake, kCudaError, kThermalWarning };
const char* fault_type_name(FaultType type);

struct Finding {
    FaultType type;
    bool fatal = true;
    int gpu_index = -1;  // -1: not tied to one GPU (a CUDA error)
    std::string message;
    std::optional<GpuReading> reading;
};

// The "fault" object of a gpu.fault payload (SIMPLETUNER.md §8.1 field names, plus uuid/node).
nlohmann::json fault_json(const Finding& finding, const std::string& node, int64_t step);

// True when an exception message looks like a CUDA/driver failure (SimpleTuner's matching:
// cuda, cudnn, cublas, nccl, device-side assert, out of memory, illegal memory access, ECC).
bool is_cuda_error(const std::string& message);

class CircuitBreaker {
  public:
    explicit CircuitBreaker(BreakerConfig config = {}) : config_(config) {}

    // Records per-GPU ECC counters as the baseline; readings before it count nothing.
    void set_baseline(const std::vector<GpuReading>& readings);
    // Evaluates one poll. Returns every finding (warnings included); opens on the first fatal one.
    std::vector<Finding> evaluate(const std::vector<GpuReading>& readings);
    // A CUDA exception from training. Returns the finding when it opened the circuit.
    std::optional<Finding> record_cuda_error(const std::string& message);

    bool is_open() const { return open_.load(); }
    std::optional<Finding> trip_reason() const;
    const BreakerConfig& config() const { return config_; }

  private:
    void open(const Finding& f);

    BreakerConfig config_;
    std::map<int, uint64_t> ecc_baseline_;
    std::atomic<bool> open_{false};
    int cuda_failures_ = 0;
    mutable std::mutex mutex_;
    std::optional<Finding> reason_;
};

// Polls a GpuSource on its own thread and feeds a CircuitBreaker. `on_finding` is called (on the
// monitor thread) for each warning once per fault type and GPU, and for the fatal finding that
// opens the circuit; the trainer checks breaker().is_open() between steps.
class HealthMonitor {
  public:
    HealthMonitor(std::unique_ptr<GpuSource> source, BreakerConfig config,
                  std::function<void(const Finding&)> on_finding);
    ~HealthMonitor();
    HealthMonitor(const HealthMonitor&) = delete;
    HealthMonitor& operator=(const HealthMonitor&) = delete;

    CircuitBreaker& breaker() { return breaker_; }
    // Runs one poll now (also what the thread does every poll_interval_s).
    void poll();

  private:
    std::unique_ptr<GpuSource> source_;
    CircuitBreaker breaker_;
    std::function<void(const Finding&)> on_finding_;
    std::map<std::pair<int, int>, bool> warned_;
    std::mutex poll_mutex_;
    std::mutex stop_mutex_;
    std::condition_variable stop_cv_;
    bool stopping_ = false;
    std::thread thread_;
};

}  // namespace dtune::health
