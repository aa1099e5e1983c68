// Loopback HTTP server for tests.
#include "support/http_listener.h"
#include "support/loopback.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <stdexcept>

namespace dtune::test {

HttpListener::HttpListener() {
    listen_fd_ = listen_on_loopback(64, port_, "HttpListener");
    thread_ = std::thread([this] { serve(); });
}

HttpListener::~HttpListener() {
    stopping_ = true;
    ::shutdown(listen_fd_, SHUT_RDWR);
    ::close(listen_fd_);
    thread_.join();
    for (auto& t : handlers_) t.join();
}

void HttpListener::set_route(const std::string& path, Route route) {
    std::lock_guard lock(mutex_);
    routes_[path] = std::move(route);
}

std::string HttpListener::url(const std::string& path) const {
    return "http://127.0.0.1:" + std::to_string(port_) + path;
}

void HttpListener::serve() {
    while (!stopping_) {
        pollfd p{listen_fd_, POLLIN, 0};
        if (::poll(&p, 1, 50) <= 0) continue;
        int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) continue;
        handlers_.emplace_back([this, fd] { handle(fd); });
    }
}

void HttpListener::handle(int fd) {
    std::string data;
    char buf[65536];
    std::size_t header_end = std::string::npos, content_length = 0;
    HttpRequest req;
    for (;;) {
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, 5000) <= 0) break;
        ssize_t n = ::recv(fd, buf, sizeof buf, 0);
        if (n <= 0) break;
        data.append(buf, static_cast<std::size_t>(n));
        if (header_end == std::string::npos && (header_end = data.find("\r\n\r\n")) != std::string::npos) {
            std::size_t line_end = data.find("\r\n");
            std::string first = data.substr(0, line_end);
            req.method = first.substr(0, first.find(' '));
            req.path = first.substr(first.find(' ') + 1, first.rfind(' ') - first.find(' ') - 1);
            std::size_t pos = line_end + 2;
            while (pos < header_end) {
                std::size_t e = data.find("\r\n", pos);
                std::string line = data.substr(pos, e - pos);
                std::size_t colon = line.find(':');
                std::string key = line.substr(0, colon);
                std::transform(key.begin(), key.end(), key.begin(),
                               [](unsigned char c) { return std::tolower(c); });
                std::string value = line.substr(colon + 1);
                value.erase(0, value.find_first_not_of(' '));
                req.headers[key] = value;
                pos = e + 2;
            }
            if (req.headers.count("content-length"))
                content_length = std::stoul(req.headers["content-length"]);
            if (req.headers["expect"] == "100-continue") {
                const char* cont = "HTTP/1.1 100 Continue\r\n\r\n";
                ::send(fd, cont, std::strlen(cont), MSG_NOSIGNAL);
            }
        }
        if (header_end != std::string::npos && data.size() >= header_end + 4 + content_length) break;
    }
    if (header_end != std::string::npos) {
        req.body = data.substr(header_end + 4, content_length);
        {
            std::lock_guard lock(mutex_);
            requests_.push_back(req);
        }
        cv_.notify_all();
        const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(delay_ms_.load());
        while (!stopping_ && std::chrono::steady_clock::now() < until)
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        int status = status_.load();
        std::string body = "{}";
        long cut_after = -1;
        {
            std::lock_guard lock(mutex_);
            if (auto it = routes_.find(req.path); it != routes_.end()) {
                const Route& r = it->second;
                const bool fail = served_[req.path]++ < r.fail_first;
                status = fail ? r.fail_status : r.status;
                body = fail ? std::string() : r.body;
                cut_after = fail ? -1 : r.cut_after;
            }
        }
        std::string reply = "HTTP/1.1 " + std::to_string(status) +
                            " X\r\nContent-Length: " + std::to_string(body.size()) +
                            "\r\nConnection: close\r\n\r\n";
        reply += cut_after >= 0 ? body.substr(0, static_cast<std::size_t>(cut_after)) : body;
        send_all(fd, reply.data(), reply.size());
    }
    ::close(fd);
}

std::vector<HttpRequest> HttpListener::wait_for(std::size_t n, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    cv_.wait_for(lock, timeout, [&] { return requests_.size() >= n; });
    return requests_;
}

std::vector<HttpRequest> HttpListener::requests() {
    std::lock_guard lock(mutex_);
    return requests_;
}

SilentListener::SilentListener() {
    listen_fd_ = listen_on_loopback(64, port_, "SilentListener");
    thread_ = std::thread([this] {
        while (!stopping_) {
            pollfd p{listen_fd_, POLLIN, 0};
            if (::poll(&p, 1, 50) <= 0) continue;
            const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
            if (fd < 0) continue;
            accepted_.push_back(fd);  // held open, never read
            ++connections_;
        }
    });
}

SilentListener::~SilentListener() {
    stopping_ = true;
    thread_.join();
    ::close(listen_fd_);
    for (int fd : accepted_) ::close(fd);
}

std::string SilentListener::url(const std::string& path) const {
    return "http://127.0.0.1:" + std::to_string(port_) + path;
}

std::map<std::string, FormPart> parse_multipart(const HttpRequest& request) {
    std::map<std::string, FormPart> parts;
    auto it = request.headers.find("content-type");
    if (it == request.headers.end()) return parts;
    const std::string& ct = it->second;
    std::size_t b = ct.find("boundary=");
    if (b == std::string::npos) return parts;
    const std::string boundary = "--" + ct.substr(b + 9);
    const std::string& body = request.body;
    std::size_t pos = body.find(boundary);
    while (pos != std::string::npos) {
        pos += boundary.size();
        if (body.compare(pos, 2, "--") == 0) break;
        pos += 2;  // \r\n
        std::size_t head_end = body.find("\r\n\r\n", pos);
        std::string head = body.substr(pos, head_end - pos);
        std::size_t next = body.find(boundary, head_end);
        FormPart part;
        part.content = body.substr(head_end + 4, next - head_end - 4 - 2);  // minus \r\n
        auto field = [&](const std::string& key) {
            std::size_t k = head.find(key + "=\"");
            if (k == std::string::npos) return std::string();
            k += key.size() + 2;
            return head.substr(k, head.find('"', k) - k);
        };
        std::size_t t = head.find("Content-Type: ");
        if (t != std::string::npos) part.content_type = head.substr(t + 14, head.find("\r\n", t) - t - 14);
        part.filename = field("filename");
        parts[field("name")] = part;
        pos = next;
    }
    return parts;
}

}  // namespace dtune::test
