// Webhook config parsing, payloads and the background Notifier.
#include "notify/webhooks.h"

#include <ctime>
#include <filesystem>
#include <set>

#include "core/error.h"
#include "core/fs.h"
#include "core/redact.h"
#include "notify/http.h"

namespace dtune::notify {
namespace {

using nlohmann::json;

const std::vector<std::string> kKnownKeys = {"webhook_type",   "webhook_url", "callback_url",
                                             "message_prefix", "log_level",   "ssl_no_verify",
                                             "auth_token",     "timeout",     "max_retries"};

WebhookTarget parse_target(const json& entry, std::size_t i, const std::string& project) {
    const std::string where = str("webhook_config entry ", i);
    DTUNE_CHECK_AS(UsageError, entry.is_object(), where,
                   " is not a JSON object; write {\"webhook_type\": ...}");
    for (auto it = entry.begin(); it != entry.end(); ++it)
        if (std::find(kKnownKeys.begin(), kKnownKeys.end(), it.key()) == kKnownKeys.end())
            log::warn() << where << ": unknown key '" << it.key() << "' ignored";
    auto get_string = [&](const char* key) -> std::string {
        if (!entry.contains(key)) return "";
        DTUNE_CHECK_AS(UsageError, entry[key].is_string(), where, ": '", key, "' must be a string");
        return entry[key].get<std::string>();
    };
    WebhookTarget t;
    const std::string type = get_string("webhook_type");
    if (type == "discord") {
        t.type = WebhookType::kDiscord;
        t.url = get_string("webhook_url");
        DTUNE_CHECK_AS(UsageError, !t.url.empty(), where, ": webhook_type discord needs 'webhook_url'");
    } else if (type == "raw") {
        t.type = WebhookType::kRaw;
        t.url = get_string("callback_url");
        if (t.url.empty() && !get_string("webhook_url").empty()) {
            // SimpleTuner rejects this (its docs show it, its validation refuses it); we accept it.
            t.url = get_string("webhook_url");
            log::warn() << where << ": raw webhooks take 'callback_url'; using 'webhook_url' instead";
        }
        DTUNE_CHECK_AS(UsageError, !t.url.empty(), where, ": webhook_type raw needs 'callback_url'");
    } else {
        throw UsageError(str(where, ": webhook_type '", type, "' is not supported; use discord or raw"));
    }
    t.message_prefix = entry.contains("message_prefix") ? get_string("message_prefix") : "(" + project + ")";
    if (entry.contains("log_level")) {
        auto level = log::parse_level(get_string("log_level"));
        DTUNE_CHECK_AS(UsageError, level.has_value(), where, ": log_level '", get_string("log_level"),
                       "' is not one of debug, info, warning, error");
        t.log_level = *level;
    }
    if (entry.contains("ssl_no_verify")) {
        DTUNE_CHECK_AS(UsageError, entry["ssl_no_verify"].is_boolean(), where,
                       ": 'ssl_no_verify' must be true/false");
        t.ssl_no_verify = entry["ssl_no_verify"].get<bool>();
    }
    if (const char* env = std::getenv("SIMPLETUNER_SSL_NO_VERIFY"); env && std::string(env) == "true")
        t.ssl_no_verify = true;
    t.auth_token = get_string("auth_token");
    if (entry.contains("timeout")) {
        DTUNE_CHECK_AS(UsageError, entry["timeout"].is_number() && entry["timeout"].get<double>() > 0, where,
                       ": 'timeout' must be a positive number of seconds");
        t.timeout_s = entry["timeout"].get<double>();
    }
    if (entry.contains("max_retries")) {
        DTUNE_CHECK_AS(UsageError, entry["max_retries"].is_number_unsigned(), where,
                       ": 'max_retries' must be a non-negative integer");
        t.max_retries = entry["max_retries"].get<int>();
    }
    return t;
}

std::string iso_now() {
    std::time_t t = std::time(nullptr);
    std::tm tm{};
    gmtime_r(&t, &tm);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
    return buf;
}

const char* severity_of(log::Level level) {
    switch (level) {
        case log::Level::kError: return "critical";
        case log::Level::kWarn: return "warning";
        case log::Level::kDebug: return "debug";
        case log::Level::kInfo: break;
    }
    return "info";
}

}  // namespace

std::vector<WebhookTarget> parse_webhook_config(const std::string& value, const std::string& project_name) {
    json root;
    const auto first = value.find_first_not_of(" \t\r\n");
    if (first != std::string::npos && (value[first] == '{' || value[first] == '[')) {
        root = json::parse(value, nullptr, false);
        // The text is not echoed: it may hold a URL with a token or an auth_token.
        DTUNE_CHECK_AS(UsageError, !root.is_discarded(), "webhook_config (inline, ", value.size(),
                       " characters) is not valid JSON; check its quotes, commas and brackets");
    } else {
        DTUNE_CHECK_AS(
            UsageError, std::filesystem::is_regular_file(value), "webhook_config '", redact_text(value),
            "' is neither inline JSON nor an existing file; pass a path to a JSON file or a JSON object");
        root = json::parse(fs::read_file(value), nullptr, false);
        DTUNE_CHECK_AS(UsageError, !root.is_discarded(), "webhook_config file '", value,
                       "' is not valid JSON");
    }
    std::vector<WebhookTarget> targets;
    if (root.is_array()) {
        for (std::size_t i = 0; i < root.size(); ++i)
            targets.push_back(parse_target(root[i], i, project_name));
    } else {
        targets.push_back(parse_target(root, 0, project_name));
    }
    return targets;
}

// ---- events -----------------------------------------------------------------------------------

Event lifecycle_stage(const std::string& key, const std::string& status, int64_t current, int64_t total,
                      double eta_seconds) {
    Event e{"lifecycle.stage",
            status == "failed" ? log::Level::kError : log::Level::kInfo,
            "",
            json::object(),
            {}};
    json progress = {{"current", current},
                     {"total", total},
                     {"percent", total > 0 ? 100.0 * static_cast<double>(current) / total : 0.0}};
    progress["eta_seconds"] = eta_seconds >= 0 ? json(eta_seconds) : json(nullptr);
    e.body["stage"] = {{"key", key}, {"status", status}, {"progress", progress}};
    e.message = str("Stage ", key, ": ", status, total > 0 ? str(" (", current, "/", total, ")") : "");
    return e;
}

Event training_status(const std::string& status, const json& metrics) {
    Event e{"training.status",
            status == "failed" ? log::Level::kError : log::Level::kInfo,
            "",
            json::object(),
            {}};
    e.body["status"] = status;
    e.body["progress"] = {{"metrics", metrics}};
    e.message = "Training " + status;
    return e;
}

Event training_progress(int64_t step, int64_t total_steps, int64_t epoch, double loss, double lr,
                        double images_per_s, double eta_seconds) {
    Event e{"training.progress", log::Level::kInfo, "", json::object(), {}};
    e.body["progress"] = {
        {"current", step},
        {"total", total_steps},
        {"percent", total_steps > 0 ? 100.0 * static_cast<double>(step) / total_steps : 0.0},
        {"epoch", epoch},
        {"eta_seconds", eta_seconds},
        {"metrics", {{"loss", loss}, {"learning_rate", lr}, {"images_per_second", images_per_s}}}};
    e.message = str("Step ", step, "/", total_steps, " epoch ", epoch, " loss ", loss, " lr ", lr);
    return e;
}

Event training_checkpoint(const std::string& path, const std::string& label, bool is_final) {
    Event e{"training.checkpoint", log::Level::kInfo, "", json::object(), {}};
    e.body["checkpoint"] = {{"path", path}, {"label", label}, {"is_final", is_final}};
    e.message = str(is_final ? "Final model saved: " : "Checkpoint saved: ", label);
    return e;
}

Event training_validation(int64_t step, const std::vector<Image>& images) {
    Event e{"training.validation", log::Level::kInfo, "", json::object(), images};
    e.body["step"] = step;
    e.message =
        str("Validation at step ", step, " (", images.size(), " image", images.size() == 1 ? "" : "s", ")");
    return e;
}

Event validation_preview(const PreviewFrame& f, Image image) {
    const std::string label = str(f.step + 1, "/", f.total_steps);
    const std::string text =
        str("Validation (step ", label, "): ", f.shortname.empty() ? "(validation)" : f.shortname);
    Event e{"validation.image", log::Level::kInfo, text, json::object(), {std::move(image)}};
    e.body["title"] = text;
    e.body["body"] = f.prompt;
    e.body["data"] = {{"step", f.step + 1},
                      {"timestep", f.timestep},
                      {"resolution", {f.width, f.height}},
                      {"validation_type", f.validation_type},
                      {"prompt", f.prompt},
                      {"step_label", label}};
    e.raw_only = true;
    return e;
}

Event notification(const std::string& message, const json& data) {
    Event e{"notification", log::Level::kInfo, message, json::object(), {}};
    e.body["title"] = message.substr(0, message.find('\n'));
    if (!data.empty()) e.body["data"] = data;
    return e;
}

Event error_event(const std::string& message) {
    Event e{"error", log::Level::kError, message, json::object(), {}};
    return e;
}

Event gpu_fault(const std::string& fault_type, const std::string& severity, const std::string& message,
                const json& fault) {
    Event e{"gpu.fault",
            severity == "warning" ? log::Level::kWarn : log::Level::kError,
            message,
            json::object(),
            {}};
    e.body["severity"] = severity;
    e.body["title"] = "GPU Fault: " + fault_type;
    e.body["fault"] = fault;
    return e;
}

std::string base64_encode(const std::string& bytes) {
    static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    out.reserve((bytes.size() + 2) / 3 * 4);
    std::size_t i = 0;
    for (; i + 2 < bytes.size(); i += 3) {
        const uint32_t n = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8) | uint8_t(bytes[i + 2]);
        for (int s = 18; s >= 0; s -= 6) out += kAlphabet[(n >> s) & 63];
    }
    if (i < bytes.size()) {
        uint32_t n = uint8_t(bytes[i]) << 16;
        if (i + 1 < bytes.size()) n |= uint8_t(bytes[i + 1]) << 8;
        out += kAlphabet[(n >> 18) & 63];
        out += kAlphabet[(n >> 12) & 63];
        out += i + 1 < bytes.size() ? kAlphabet[(n >> 6) & 63] : '=';
        out += '=';
    }
    return out;
}

json raw_payload(const Event& event, const std::string& job_id) {
    json p = event.body;
    p["type"] = event.type;
    if (!p.contains("severity")) p["severity"] = severity_of(event.level);
    p["job_id"] = job_id;
    if (!p.contains("title")) p["title"] = event.type;
    p["message"] = event.message;
    p["timestamp"] = iso_now();
    if (!event.images.empty()) {
        json images = json::array();
        for (const auto& img : event.images)
            images.push_back(base64_encode(img.png));  // plain base64, as SimpleTuner's raw webhooks
        p["images"] = images;
    }
    return p;
}

// ---- notifier ---------------------------------------------------------------------------------

Notifier::Notifier(std::vector<WebhookTarget> targets, std::string job_id, bool enabled)
    : targets_(std::move(targets)),
      job_id_(std::move(job_id)),
      enabled_(enabled && !targets_.empty()),
      failing_(targets_.size(), 0),
      last_error_(targets_.size()) {
    if (enabled_) thread_ = std::thread([this] { worker(); });
}

Notifier::~Notifier() {
    close(kCloseTimeout);
}

void Notifier::send(Event event) {
    if (!enabled_) return;
    std::lock_guard lock(mutex_);
    if (closed_) {
        ++stats_.dropped;  // after close(): nobody posts any more
        return;
    }
    for (std::size_t t = 0; t < targets_.size(); ++t) {
        if (event.level < targets_[t].log_level) continue;
        if (event.raw_only && targets_[t].type != WebhookType::kRaw) continue;
        if (queue_.size() >= kMaxQueue) {
            // Drop the oldest routine event; faults, errors and lifecycle changes are kept.
            auto victim = std::find_if(queue_.begin(), queue_.end(), [](const Job& j) {
                return j.event.type == "training.progress" || j.event.type == "validation.image";
            });
            if (victim == queue_.end()) victim = queue_.begin();
            queue_.erase(victim);
            ++stats_.dropped;
        }
        queue_.push_back(Job{event, t});
    }
    cv_.notify_one();
}

bool Notifier::flush(std::chrono::milliseconds timeout) {
    if (!enabled_) return true;
    std::unique_lock lock(mutex_);
    return idle_cv_.wait_for(lock, timeout, [this] { return queue_.empty() && !busy_; });
}

bool Notifier::close(std::chrono::milliseconds timeout, const std::function<bool()>& abandon) {
    if (!enabled_) return true;
    std::unique_lock lock(mutex_);
    if (closed_) return close_result_;
    closed_ = stopping_ = true;
    cv_.notify_all();
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    bool abandoned = false;
    auto idle = [this] { return queue_.empty() && !busy_; };
    if (!idle()) {
        const std::size_t pending = queue_.size() + (busy_ ? 1 : 0);
        log::info() << "webhooks: delivering the last " << pending << " event" << (pending == 1 ? "" : "s")
                    << " (" << timeout.count() / 1000.0 << " s at most)";
    }
    while (!idle() && std::chrono::steady_clock::now() < deadline) {
        if (abandon && abandon()) {
            abandoned = true;
            break;
        }
        idle_cv_.wait_until(
            lock, std::min(deadline, std::chrono::steady_clock::now() + std::chrono::milliseconds(50)));
    }
    const std::size_t left = queue_.size() + (busy_ ? 1 : 0);
    if (left > 0) {
        std::set<std::string> type_set;
        for (const Job& j : queue_) type_set.insert(j.event.type);
        std::string types;
        for (const auto& type : type_set) types += (types.empty() ? "" : ", ") + type;
        stats_.dropped += static_cast<int64_t>(queue_.size());
        queue_.clear();
        cancel_ = true;  // the post in flight gives up within about a second
        log::warn() << "webhooks: " << left << " event" << (left == 1 ? "" : "s") << " not delivered "
                    << (abandoned ? "(the wait was cut short)"
                                  : str("within the ", timeout.count() / 1000.0, " s allowed at the end"))
                    << " and dropped" << (types.empty() ? "" : " (" + types + ")")
                    << "; check that the webhook endpoint answers";
    }
    close_result_ = left == 0;
    cv_.notify_all();
    lock.unlock();
    thread_.join();
    return close_result_;
}

Notifier::Stats Notifier::stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
}

bool Notifier::deliver(const Job& job) {
    const WebhookTarget& t = targets_[job.target];
    HttpOptions options;
    options.timeout_s = t.timeout_s;
    options.ssl_no_verify = t.ssl_no_verify;
    options.cancel = &cancel_;
    if (t.type == WebhookType::kRaw && !t.auth_token.empty())
        options.headers.emplace_back("X-API-Key", t.auth_token);
    for (int attempt = 0; attempt <= t.max_retries; ++attempt) {
        if (attempt > 0) {
            // Exponential backoff with jitter: 0.5 s, 1 s, 2 s ... (+ up to 25%).
            const double base = 0.5 * (1 << (attempt - 1));
            const double jitter = base * 0.25 * (std::rand() % 1000) / 1000.0;
            std::unique_lock lock(mutex_);
            if (cv_.wait_for(lock, std::chrono::duration<double>(base + jitter),
                             [this] { return cancel_.load(); }))
                return false;  // close() gave up on this event
        }
        HttpResult r;
        if (t.type == WebhookType::kDiscord) {
            std::string content =
                t.message_prefix.empty() ? job.event.message : t.message_prefix + " " + job.event.message;
            if (content.size() > 2000) content = content.substr(0, 1997) + "...";  // Discord's limit
            std::vector<MultipartFile> files;
            for (std::size_t i = 0; i < job.event.images.size() && i < 10; ++i)
                files.push_back({"file" + std::to_string(i), job.event.images[i].name, "image/png",
                                 job.event.images[i].png});
            r = http_post_multipart(t.url, {{"content", content}}, files, options);
        } else {
            r = http_post_json(t.url, raw_payload(job.event, job_id_).dump(), options);
        }
        {
            std::lock_guard lock(mutex_);
            ++stats_.attempts;
        }
        if (r.ok()) return true;
        last_error_[job.target] = r.error.empty() ? "HTTP " + std::to_string(r.status) : r.error;
        log::debug() << "webhook " << redact_url(t.url) << " " << job.event.type << " attempt " << attempt + 1
                     << " failed: " << last_error_[job.target];
        if (!r.retryable() || cancel_) return false;
    }
    return false;
}

// One warning when a webhook starts failing and one line when it works again: a dead endpoint
// does not fill the log with a warning per event.
void Notifier::report_outcome(const Job& job, bool ok, const std::string& error) {
    const std::string where = "webhook " + redact_url(targets_[job.target].url);
    char& failing = failing_[job.target];
    if (ok && failing) {
        log::info() << where << ": delivering again";
    } else if (!ok && cancel_) {
        // close() gave up: its one warning covers this event.
    } else if (!ok && !failing) {
        log::warn() << where << ": could not deliver " << job.event.type << " (" << error
                    << "); later failures of this webhook are logged at debug level until a post succeeds";
    } else if (!ok) {
        log::debug() << where << ": could not deliver " << job.event.type << " (" << error << ")";
    }
    failing = ok ? 0 : 1;
}

void Notifier::worker() {
    for (;;) {
        Job job;
        {
            std::unique_lock lock(mutex_);
            cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
            if (queue_.empty()) return;
            job = std::move(queue_.front());
            queue_.pop_front();
            busy_ = true;
        }
        const bool ok = deliver(job);
        report_outcome(job, ok, last_error_[job.target]);
        {
            std::lock_guard lock(mutex_);
            busy_ = false;
            ++(ok ? stats_.delivered : stats_.failed);
        }
        idle_cv_.notify_all();
    }
}

}  // namespace dtune::notify
