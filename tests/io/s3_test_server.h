// Real S3-compatible servers for integration tests, started on 127.0.0.1 by the test itself:
// SeaweedFS (`weed mini`, verifies SigV4 against a configured identity) and moto's server mode
// (an independent implementation; it does not check signatures). Each instance gets free ports,
// its own data directory and log file, and is killed (its whole process group) on destruction.
// A missing binary fails the test with the install command (scripts/setup.sh installs both).
#pragma once

#include "support/test_support.h"

#include <sys/types.h>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

namespace dtune::test {

enum class S3ServerKind { kSeaweed, kMoto };

class S3TestServer {
  public:
    // Starts the server and waits until it answers S3 requests (creating nothing). Fails the
    // calling test (ADD_FAILURE + returns nullptr) when the binary is missing or it never gets ready.
    static std::unique_ptr<S3TestServer> start(S3ServerKind kind);
    ~S3TestServer();

    const std::string& endpoint() const { return endpoint_; }  // http://127.0.0.1:<port>
    int port() const { return port_; }
    const std::string& name() const { return name_; }
    static constexpr const char* kAccessKey = "DTUNETESTKEY";
    static constexpr const char* kSecretKey = "dtune-test-secret-Zq8vR2mX";
    std::string log_path() const { return (dir_->path() / "server.log").string(); }

  private:
    S3TestServer() = default;
    void stop();
    std::unique_ptr<TempDir> dir_;
    std::string endpoint_, name_;
    std::vector<std::string> leftovers_;
    int port_ = 0;
    pid_t pid_ = -1;
};

// gtest prints the parameter by this (ctest names read "GetParam() = seaweedfs").
inline void PrintTo(S3ServerKind kind, std::ostream* os) {
    *os << (kind == S3ServerKind::kSeaweed ? "seaweedfs" : "moto");
}

// Where a named executable lives on PATH, or "" when absent.
std::string find_on_path(const std::string& name);

}  // namespace dtune::test
