// Circuit breaker decisions from recorded readings (this tests our logic, not NVML).
#include <gtest/gtest.h>

#include <cstdlib>

#include "core/error.h"
#include "health/breaker.h"

namespace dtune::health {
namespace {

GpuReading healthy(int index) {
    GpuReading r;
    r.index = index;
    r.name = "NVIDIA H100 80GB HBM3";
    r.uuid = "GPU-" + std::to_string(index);
    r.temperature_c = 45;
    r.slowdown_c = 87;
    r.shutdown_c = 92;
    r.ecc_supported = true;
    r.ecc_uncorrected_volatile = 2;  // errors from before the run do not count
    r.throttle_reasons = kThrottleSwPowerCap;
    r.power_w = 350;
    r.power_limit_w = 700;
    r.memory_used = 10ull << 30;
    r.memory_total = 80ull << 30;
    return r;
}

// A scripted source: each read_all() returns the next recorded poll.
class RecordedSource : public GpuSource {
  public:
    explicit RecordedSource(std::vector<std::vector<GpuReading>> polls) : polls_(std::move(polls)) {}
    int device_count() override {
        return static_cast<int>(polls_[std::min(next_, polls_.size() - 1)].size());
    }
    GpuReading read(int index) override {
        const auto& poll = polls_[std::min(next_, polls_.size() - 1)];
        GpuReading r = poll[static_cast<std::size_t>(index)];
        if (index + 1 == static_cast<int>(poll.size())) ++next_;
        return r;
    }

  private:
    std::vector<std::vector<GpuReading>> polls_;
    std::size_t next_ = 0;
};

}  // namespace

TEST(Breaker, HealthyReadingsKeepItClosed) {
    CircuitBreaker b;
    b.set_baseline({healthy(0), healthy(1)});
    EXPECT_TRUE(b.evaluate({healthy(0), healthy(1)}).empty());
    EXPECT_FALSE(b.is_open());
}

TEST(Breaker, NewUncorrectableEccErrorsTrip) {
    CircuitBreaker b(BreakerConfig{.ecc_error_threshold = 3});
    b.set_baseline({healthy(0)});
    GpuReading r = healthy(0);
    r.ecc_uncorrected_volatile = 4;  // 2 new: below the threshold of 3
    EXPECT_TRUE(b.evaluate({r}).empty());
    r.ecc_uncorrected_volatile = 5;  // 3 new
    auto findings = b.evaluate({r});
    ASSERT_EQ(findings.size(), 1u);
    EXPECT_EQ(findings[0].type, FaultType::kEcc);
    EXPECT_TRUE(b.is_open());
    EXPECT_NE(b.trip_reason()->message.find("3 new uncorrectable"), std::string::npos);
}

TEST(Breaker, TemperatureWithinMarginOfShutdownTrips) {
    CircuitBreaker b;
    GpuReading r = healthy(1);
    r.temperature_c = 86;  // 92 - 5 = 87 is the line
    EXPECT_TRUE(b.evaluate({r}).empty());
    r.temperature_c = 87;
    auto f = b.evaluate({r});
    ASSERT_EQ(f.size(), 1u);
    EXPECT_EQ(f[0].type, FaultType::kTemperature);
    EXPECT_EQ(f[0].gpu_index, 1);
    EXPECT_TRUE(b.is_open());
}

TEST(Breaker, PowerBrakeAndHwSlowdownTripThermalOnlyWarns) {
    CircuitBreaker thermal;
    GpuReading r = healthy(0);
    r.throttle_reasons = kThrottleHwThermal | kThrottleSwThermal;
    auto f = thermal.evaluate({r});
    ASSERT_EQ(f.size(), 1u);
    EXPECT_EQ(f[0].type, FaultType::kThermalWarning);
    EXPECT_FALSE(f[0].fatal);
    EXPECT_FALSE(thermal.is_open());

    for (uint64_t bit : {kThrottleHwPowerBrake, kThrottleHwSlowdown}) {
        CircuitBreaker b;
        r.throttle_reasons = bit;
        b.evaluate({r});
        EXPECT_TRUE(b.is_open()) << bit;
        EXPECT_EQ(b.trip_reason()->type,
                  bit == kThrottleHwPowerBrake ? FaultType::kPowerBrake : FaultType::kHwSlowdown);
    }
    CircuitBreaker lenient(BreakerConfig{.trip_on_power_brake = false});
    r.throttle_reasons = kThrottleHwPowerBrake;
    lenient.evaluate({r});
    EXPECT_FALSE(lenient.is_open());
}

TEST(Breaker, CudaErrorsAreClassifiedAndCounted) {
    EXPECT_TRUE(is_cuda_error("CUDA error: an illegal memory access was encountered"));
    EXPECT_TRUE(is_cuda_error("NCCL watchdog timeout"));
    EXPECT_TRUE(is_cuda_error("CUDA error: unspecified launch failure"));
    EXPECT_TRUE(is_cuda_error("CUDA error: uncorrectable ECC error encountered"));
    // Not hardware faults: exiting 75 ("replace the machine") would not help.
    EXPECT_FALSE(is_cuda_error("CUDA out of memory. Tried to allocate 2.00 GiB"));
    EXPECT_FALSE(is_cuda_error("Expected a 'cuda' device type for generator but found 'cpu'"));
    EXPECT_FALSE(is_cuda_error("bucket 1.75 has 3 samples"));
    CircuitBreaker b(BreakerConfig{.cuda_failure_threshold = 2});
    EXPECT_FALSE(b.record_cuda_error("config key missing").has_value());
    EXPECT_FALSE(b.record_cuda_error("CUDA error: unspecified launch failure").has_value());
    EXPECT_FALSE(b.is_open());
    auto f = b.record_cuda_error("CUDA error: uncorrectable ECC error encountered");
    ASSERT_TRUE(f.has_value());
    EXPECT_EQ(f->type, FaultType::kCudaError);
    EXPECT_TRUE(b.is_open());
}

TEST(Breaker, FirstFatalFindingStaysTheReason) {
    CircuitBreaker b;
    GpuReading hot = healthy(0);
    hot.temperature_c = 95;
    b.evaluate({hot});
    GpuReading brake = healthy(0);
    brake.throttle_reasons = kThrottleHwPowerBrake;
    b.evaluate({brake});
    EXPECT_EQ(b.trip_reason()->type, FaultType::kTemperature);
}

TEST(Breaker, FaultPayloadCarriesTheReadings) {
    GpuReading r = healthy(3);
    r.throttle_reasons = kThrottleHwPowerBrake | kThrottleSwPowerCap;
    Finding f{FaultType::kPowerBrake, true, 3, "power brake", r};
    auto j = fault_json(f, "node-2", 1234);
    EXPECT_EQ(j["type"], "power_brake");
    EXPECT_EQ(j["node"], "node-2");
    EXPECT_EQ(j["step"], 1234);
    EXPECT_EQ(j["gpu"]["uuid"], "GPU-3");
    EXPECT_EQ(j["gpu"]["temperature_shutdown_celsius"], 92);
    EXPECT_EQ(j["gpu"]["throttle_reasons"], nlohmann::json({"sw_power_cap", "hw_power_brake_slowdown"}));
    EXPECT_DOUBLE_EQ(j["gpu"]["memory_used_percent"].get<double>(), 12.5);
    EXPECT_EQ(j["action_taken"], "circuit_opened");
}

TEST(Monitor, PollsReportWarningsOnceAndTheTripOnce) {
    GpuReading thermal = healthy(0);
    thermal.throttle_reasons = kThrottleHwThermal;
    GpuReading ecc = healthy(0);
    ecc.ecc_uncorrected_volatile = 10;
    auto source = std::make_unique<RecordedSource>(
        std::vector<std::vector<GpuReading>>{{healthy(0)}, {thermal}, {thermal}, {ecc}, {ecc}});
    std::vector<Finding> seen;
    HealthMonitor m(std::move(source), BreakerConfig{.poll_interval_s = 3600},
                    [&](const Finding& f) { seen.push_back(f); });
    for (int i = 0; i < 4; ++i) m.poll();  // baseline was poll 0
    ASSERT_EQ(seen.size(), 2u);
    EXPECT_EQ(seen[0].type, FaultType::kThermalWarning);
    EXPECT_EQ(seen[1].type, FaultType::kEcc);
    EXPECT_TRUE(m.breaker().is_open());
}

TEST(Injection, ChangesGpuZeroAfterItsFirstReading) {
    ::setenv("DTUNE_INJECT_GPU_FAULT", "power_brake", 1);
    auto src = maybe_inject_faults(
        std::make_unique<RecordedSource>(std::vector<std::vector<GpuReading>>{{healthy(0)}}));
    EXPECT_EQ(src->read(0).throttle_reasons & kThrottleHwPowerBrake, 0u);  // the baseline reading
    EXPECT_NE(src->read(0).throttle_reasons & kThrottleHwPowerBrake, 0u);
    ::setenv("DTUNE_INJECT_GPU_FAULT", "meteor", 1);
    EXPECT_THROW(maybe_inject_faults(
                     std::make_unique<RecordedSource>(std::vector<std::vector<GpuReading>>{{healthy(0)}})),
                 UsageError);
    ::unsetenv("DTUNE_INJECT_GPU_FAULT");
}

TEST(Nvml, AbsentDriverIsReportedNotFatal) {
    std::string why;
    auto src = open_nvml(&why);
    if (src) GTEST_SKIP() << "an NVIDIA driver is present; the absent-driver path cannot be exercised here";
    EXPECT_NE(why.find("libnvidia-ml.so.1"), std::string::npos) << why;
}

TEST(Nvml, InjectionWithoutDriverSimulatesOneGpuThatTrips) {
    std::string why;
    if (open_nvml(&why)) GTEST_SKIP() << "an NVIDIA driver is present: the monitor reads the real GPUs";
    EXPECT_EQ(open_monitor_source(&why), nullptr);  // nothing to monitor, nothing injected
    ::setenv("DTUNE_INJECT_GPU_FAULT", "ecc", 1);
    auto src = open_monitor_source(&why);
    ::unsetenv("DTUNE_INJECT_GPU_FAULT");
    ASSERT_NE(src, nullptr);
    ASSERT_EQ(src->device_count(), 1);
    CircuitBreaker breaker;
    breaker.set_baseline(src->read_all());  // the simulated GPU's first reading is healthy
    EXPECT_FALSE(breaker.is_open());
    breaker.evaluate(src->read_all());
    ASSERT_TRUE(breaker.is_open());
    EXPECT_EQ(breaker.trip_reason()->type, FaultType::kEcc);
    EXPECT_EQ(breaker.trip_reason()->reading->name, "simulated");
}

}  // namespace dtune::health
