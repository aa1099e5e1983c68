// Fault-injecting TCP proxy for tests. See fault_proxy.h.
#include "fault_proxy.h"

#include "support/loopback.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <random>
#include <stdexcept>
#include <string>

namespace dtune::test {
namespace {

enum Mode { kForward = 0, kCloseAtOnce = 1, kAnswer503 = 2, kCutResponse = 3 };

}  // namespace

FaultProxy::FaultProxy(int upstream_port, double fault_rate, std::uint32_t seed)
    : upstream_port_(upstream_port), fault_rate_(fault_rate), seed_(seed) {
    listen_fd_ = listen_on_loopback(128, port_, "FaultProxy");
    thread_ = std::thread([this] { serve(); });
}

FaultProxy::~FaultProxy() {
    stopping_ = true;
    thread_.join();
    ::close(listen_fd_);
    std::lock_guard lock(handlers_mutex_);
    for (auto& t : handlers_) t.join();
}

void FaultProxy::serve() {
    std::mt19937_64 rng(seed_);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    while (!stopping_) {
        pollfd p{listen_fd_, POLLIN, 0};
        if (::poll(&p, 1, 50) <= 0) continue;
        const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) continue;
        ++connections_;
        int mode = kForward;
        if (u(rng) < fault_rate_) mode = 1 + static_cast<int>(u(rng) * 3) % 3;
        // Even "good" connections are cut after a random amount of response data, so faults keep
        // coming on long-lived keep-alive connections too.
        const std::uint64_t cut = mode == kCutResponse
                                      ? static_cast<std::uint64_t>(u(rng) * 4096)
                                      : 64 * 1024 + static_cast<std::uint64_t>(u(rng) * 1024 * 1024);
        std::lock_guard lock(handlers_mutex_);
        handlers_.emplace_back([this, fd, mode, cut] { handle(fd, mode, cut); });
    }
}

void FaultProxy::handle(int client, int mode, std::uint64_t cut_after) {
    if (mode == kCloseAtOnce) {
        ++faults_;
        ::close(client);
        return;
    }
    if (mode == kAnswer503) {
        // Read the request head, then answer as a throttling S3 would and hang up.
        std::string head;
        char buf[4096];
        while (head.find("\r\n\r\n") == std::string::npos) {
            pollfd p{client, POLLIN, 0};
            if (::poll(&p, 1, 2000) <= 0) break;
            const ssize_t n = ::recv(client, buf, sizeof buf, 0);
            if (n <= 0) break;
            head.append(buf, static_cast<std::size_t>(n));
        }
        const std::string body =
            "<Error><Code>SlowDown</Code><Message>Reduce your request rate.</Message></Error>";
        const std::string resp =
            "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: " +
            std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
        ++faults_;
        send_all(client, resp.data(), resp.size());
        ::close(client);
        return;
    }
    const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(upstream_port_));
    if (::connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        ::close(server);
        ::close(client);
        return;
    }
    std::uint64_t sent_back = 0;
    char buf[65536];
    bool open = true;
    while (open && !stopping_) {
        pollfd p[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
        if (::poll(p, 2, 100) <= 0) continue;
        for (int i = 0; i < 2 && open; ++i) {
            if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            const ssize_t n = ::recv(p[i].fd, buf, sizeof buf, 0);
            if (n <= 0) {
                open = false;
                break;
            }
            std::size_t len = static_cast<std::size_t>(n);
            if (i == 1 && sent_back + len > cut_after) {
                // Forward a prefix, then drop both sides mid-response.
                send_all(client, buf, static_cast<std::size_t>(cut_after - sent_back));
                ++faults_;
                open = false;
                break;
            }
            if (i == 1) sent_back += len;
            open = send_all(i == 0 ? server : client, buf, len);
        }
    }
    ::close(server);
    ::close(client);
}

}  // namespace dtune::test
