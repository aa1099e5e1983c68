// A real HTTP/1.1 server on 127.0.0.1 (an ephemeral port) for tests of code that posts to
// webhooks or downloads files. It accepts connections on its own thread, reads each request in full
// (Content-Length bodies), records it, and answers with the configured status, optionally after
// a delay (to play a slow or hung endpoint); paths given a Route get their own answer and body.
// SilentListener plays an endpoint that never answers at all.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dtune::test {

struct HttpRequest {
    std::string method, path;
    std::map<std::string, std::string> headers;  // names lower-cased
    std::string body;
};

// The answer for one path: `status` and `body`, after `fail_first` requests answered with
// `fail_status` (a flaky server). `cut_after` >= 0 announces the whole body but sends only that
// many bytes before closing (a connection cut mid-transfer).
struct Route {
    int status = 200;
    std::string body;
    int fail_first = 0;
    int fail_status = 503;
    long cut_after = -1;
};

class HttpListener {
  public:
    HttpListener();
    ~HttpListener();
    HttpListener(const HttpListener&) = delete;
    HttpListener& operator=(const HttpListener&) = delete;

    int port() const { return port_; }
    std::string url(const std::string& path = "/hook") const;
    void set_status(int status) { status_ = status; }
    void set_delay(std::chrono::milliseconds delay) { delay_ms_ = delay.count(); }
    void set_route(const std::string& path, Route route);

    // Waits until at least `n` requests arrived or `timeout` passes; returns what arrived.
    std::vector<HttpRequest> wait_for(std::size_t n, std::chrono::milliseconds timeout);
    std::vector<HttpRequest> requests();

  private:
    void serve();
    void handle(int fd);

    int listen_fd_ = -1;
    int port_ = 0;
    std::atomic<int> status_{200};
    std::atomic<long> delay_ms_{0};
    std::atomic<bool> stopping_{false};
    std::mutex mutex_;
    std::condition_variable cv_;
    std::vector<HttpRequest> requests_;
    std::map<std::string, Route> routes_;
    std::map<std::string, int> served_;  // requests per routed path
    std::vector<std::thread> handlers_;
    std::thread thread_;
};

// A TCP endpoint on 127.0.0.1 that accepts every connection and then never reads from it nor
// answers: a webhook or S3 server that hangs after the handshake (the client's request sits in
// the socket buffers until the client gives up). Connections stay open until the listener goes.
class SilentListener {
  public:
    SilentListener();
    ~SilentListener();
    SilentListener(const SilentListener&) = delete;
    SilentListener& operator=(const SilentListener&) = delete;

    int port() const { return port_; }
    std::string url(const std::string& path = "/hook") const;
    int connections() const { return connections_; }

  private:
    int listen_fd_ = -1;
    int port_ = 0;
    std::atomic<bool> stopping_{false};
    std::atomic<int> connections_{0};
    std::vector<int> accepted_;  // accept thread only, closed by the destructor after the join
    std::thread thread_;
};

// Splits a multipart/form-data body into parts: name -> {filename, content}.
struct FormPart {
    std::string filename, content_type, content;
};
std::map<std::string, FormPart> parse_multipart(const HttpRequest& request);

}  // namespace dtune::test
