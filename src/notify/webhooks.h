// Webhooks for a training run: SimpleTuner's `webhook_config` (discord and raw backends), the
// event payloads, and a Notifier that posts them from a background thread.
//
// Invariants: send() never blocks on the network (a bounded queue; the oldest progress events are
// dropped first when it is full); each post has a timeout and a bounded number of retries with
// backoff; close() (and the destructor) never takes longer than its timeout: what is still queued
// then, and the post in flight, are dropped with one warning; a failing webhook logs one warning,
// not one per event; only the process created with `enabled=true` (rank 0, or the node reporting
// a GPU fault) posts; URLs and tokens never reach a log line (see redact_url).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "core/log.h"

namespace dtune::notify {

enum class WebhookType { kDiscord, kRaw };

struct WebhookTarget {
    WebhookType type = WebhookType::kRaw;
    std::string url;  // discord: webhook_url; raw: callback_url
    std::string message_prefix;
    log::Level log_level = log::Level::kInfo;  // events below this level are not sent
    bool ssl_no_verify = false;
    std::string auth_token;  // raw: sent as X-API-Key
    double timeout_s = 5.0;
    int max_retries = 2;
};

// `value` is inline JSON (an object or a list of objects) or the path of a JSON file holding one.
// `project_name` fills the default message_prefix "(<project>)". Errors name the entry and key.
std::vector<WebhookTarget> parse_webhook_config(const std::string& value, const std::string& project_name);

struct Image {
    std::string name;  // file name, e.g. "step_100_cat_0_1024x1024.png"
    std::string png;   // encoded bytes
};

struct Event {
    std::string type;  // "lifecycle.stage", "training.progress", "gpu.fault", ...
    log::Level level = log::Level::kInfo;
    std::string message;  // human text (discord content)
    nlohmann::json body;  // type-specific fields, merged into the raw payload
    std::vector<Image> images;
    bool raw_only = false;  // sent to raw targets only (SimpleTuner's send_raw: previews)
};

// Event builders. Field names follow SimpleTuner's payloads (SIMPLETUNER.md §8.2).
Event lifecycle_stage(const std::string& key, const std::string& status, int64_t current = 0,
                      int64_t total = 0, double eta_seconds = -1);
Event training_status(const std::string& status, const nlohmann::json& metrics = nlohmann::json::object());
Event training_progress(int64_t step, int64_t total_steps, int64_t epoch, double loss, double lr,
                        double images_per_s, double eta_seconds);
Event training_checkpoint(const std::string& path, const std::string& label, bool is_final);
Event training_validation(int64_t step, const std::vector<Image>& images);
// A validation preview frame (SimpleTuner's ValidationPreviewer): `step` is the sampler step just
// done (0-based), `total_steps` the sampling run's; raw targets only.
struct PreviewFrame {
    int64_t step = 0;
    int64_t total_steps = 0;
    double timestep = 0;
    int64_t width = 0, height = 0;
    std::string prompt;
    std::string shortname;
    std::string validation_type = "intermediary";  // SimpleTuner's --validation_type default
};
Event validation_preview(const PreviewFrame& frame, Image image);
Event error_event(const std::string& message);
// SimpleTuner's notification event: `message` (title = its first line) and a `data` object.
Event notification(const std::string& message, const nlohmann::json& data = nlohmann::json::object());
// `fault` is the payload's "fault" object (see health/breaker.h fault_json()).
Event gpu_fault(const std::string& fault_type, const std::string& severity, const std::string& message,
                const nlohmann::json& fault);

// The JSON a raw backend receives for `event` (images as base64 PNG strings, as SimpleTuner sends).
nlohmann::json raw_payload(const Event& event, const std::string& job_id);
std::string base64_encode(const std::string& bytes);

class Notifier {
  public:
    Notifier(std::vector<WebhookTarget> targets, std::string job_id, bool enabled);
    ~Notifier();  // close(kCloseTimeout) unless closed already
    Notifier(const Notifier&) = delete;
    Notifier& operator=(const Notifier&) = delete;

    // Queues the event for every target whose log_level admits it. Never blocks on the network.
    void send(Event event);
    // Waits until the queue is empty or `timeout` passes; true when everything was handled.
    bool flush(std::chrono::milliseconds timeout);
    // The end of delivery: posts what is queued until the queue is empty, `timeout` passes or
    // `abandon` (polled every 50 ms; e.g. "a signal arrived") returns true; then abandons the post
    // in flight, drops the rest with one warning and stops the worker. Later sends are dropped.
    // True when nothing was dropped. Idempotent: a second call returns at once.
    bool close(std::chrono::milliseconds timeout, const std::function<bool()>& abandon = {});

    struct Stats {
        int64_t delivered = 0, failed = 0, dropped = 0, attempts = 0;
    };
    Stats stats() const;

    static constexpr std::size_t kMaxQueue = 256;
    static constexpr std::chrono::seconds kCloseTimeout{15};

  private:
    struct Job {
        Event event;
        std::size_t target;
    };
    void worker();
    bool deliver(const Job& job);
    void report_outcome(const Job& job, bool ok, const std::string& error);

    std::vector<WebhookTarget> targets_;
    std::string job_id_;
    bool enabled_;
    mutable std::mutex mutex_;
    std::condition_variable cv_;
    std::condition_variable idle_cv_;
    std::deque<Job> queue_;
    bool busy_ = false;
    bool stopping_ = false;
    bool closed_ = false;
    bool close_result_ = true;
    std::atomic<bool> cancel_{false};      // close() gave up: abandon the post in flight
    std::vector<char> failing_;            // per target: the last post failed (worker thread only)
    std::vector<std::string> last_error_;  // per target: why it failed (worker thread only)
    Stats stats_;
    std::thread thread_;
};

}  // namespace dtune::notify
