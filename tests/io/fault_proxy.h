// A TCP proxy on 127.0.0.1 that sits between a client and a real server and misbehaves on a share
// of connections: closes them before answering, answers "503 Slow Down" itself, or cuts the
// server's response after a random number of bytes (a truncated body). Decisions come from a
// seeded generator, so a run is reproducible. Used to show that the S3 client's retries recover
// from every kind of transient failure without corrupting data.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace dtune::test {

class FaultProxy {
  public:
    // fault_rate: probability that a new connection misbehaves (split evenly across the modes).
    FaultProxy(int upstream_port, double fault_rate, std::uint32_t seed);
    ~FaultProxy();
    FaultProxy(const FaultProxy&) = delete;
    FaultProxy& operator=(const FaultProxy&) = delete;

    int port() const { return port_; }
    int faults() const { return faults_; }
    int connections() const { return connections_; }

  private:
    void serve();
    void handle(int client, int mode, std::uint64_t cut_after);

    int upstream_port_;
    double fault_rate_;
    int listen_fd_ = -1, port_ = 0;
    std::uint32_t seed_;
    std::atomic<bool> stopping_{false};
    std::atomic<int> faults_{0}, connections_{0};
    std::thread thread_;
    std::mutex handlers_mutex_;
    std::vector<std::thread> handlers_;
};

}  // namespace dtune::test
