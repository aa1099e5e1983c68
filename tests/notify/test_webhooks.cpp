// Webhooks against a real HTTP listener on loopback.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <thread>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "notify/http.h"
#include "notify/webhooks.h"
#include "support/http_listener.h"
#include "support/test_support.h"

namespace dtune::notify {
namespace {

using namespace std::chrono_literals;
using nlohmann::json;

WebhookTarget raw_target(const test::HttpListener& l) {
    WebhookTarget t;
    t.type = WebhookType::kRaw;
    t.url = l.url("/raw");
    t.auth_token = "secret-token";
    t.timeout_s = 2;
    return t;
}

std::vector<Event> every_event() {
    const Image img{"step_10_cat_0_64x64.png", std::string("\x89PNG\r\n\x1a\n-fake-pixels-\x00\xff", 23)};
    json fault = {{"type", "ecc"}, {"gpu", {{"index", 0}, {"uuid", "GPU-1"}}}};
    return {lifecycle_stage("init_vae_cache", "running", 40, 100, 12.5),
            training_status("running", {{"loss", 0.1}}),
            training_progress(10, 100, 1, 0.25, 1e-4, 3.5, 90),
            training_checkpoint("/out/checkpoint-10", "checkpoint-10", false),
            training_validation(10, {img}),
            validation_preview({4, 20, 781.0, 1024, 768, "a cat", "cat"}, img),
            error_event("loss is NaN at step 11"),
            gpu_fault("ecc", "critical", "GPU 0: 3 new uncorrectable ECC errors", fault)};
}

}  // namespace

TEST(WebhookConfig, ParsesInlineFileAndLists) {
    auto one = parse_webhook_config(R"({"webhook_type":"discord","webhook_url":"https://d/x"})", "proj");
    ASSERT_EQ(one.size(), 1u);
    EXPECT_EQ(one[0].type, WebhookType::kDiscord);
    EXPECT_EQ(one[0].message_prefix, "(proj)");
    test::TempDir dir;
    fs::write_file_atomic(dir / "hooks.json",
                          R"([{"webhook_type":"raw","callback_url":"http://a/b","auth_token":"t",
        "log_level":"warning","message_prefix":"[run]"},{"webhook_type":"discord","webhook_url":"http://c"}])");
    auto two = parse_webhook_config((dir / "hooks.json").string(), "p");
    ASSERT_EQ(two.size(), 2u);
    EXPECT_EQ(two[0].type, WebhookType::kRaw);
    EXPECT_EQ(two[0].url, "http://a/b");
    EXPECT_EQ(two[0].log_level, log::Level::kWarn);
    EXPECT_EQ(two[0].message_prefix, "[run]");
}

TEST(WebhookConfig, BadEntriesNameTheProblem) {
    auto expect_error = [](const std::string& cfg, const std::string& needle) {
        try {
            parse_webhook_config(cfg, "p");
            ADD_FAILURE() << "accepted " << cfg;
        } catch (const UsageError& e) {
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
        }
    };
    expect_error(R"({"webhook_type":"discord"})", "needs 'webhook_url'");
    expect_error(R"({"webhook_type":"raw"})", "needs 'callback_url'");
    expect_error(R"({"webhook_type":"slack","webhook_url":"x"})", "'slack' is not supported");
    expect_error(R"([{"webhook_type":"raw","callback_url":"x"}, 3])", "entry 1");
    expect_error(R"({"webhook_type":"raw","callback_url":"x","log_level":"loud"})", "log_level 'loud'");
    expect_error("/no/such/hooks.json", "neither inline JSON nor an existing file");
    expect_error("{not json", "not valid JSON");
}

TEST(Webhooks, RawBackendReceivesEveryEventAsJson) {
    test::HttpListener listener;
    auto events = every_event();
    {
        Notifier n({raw_target(listener)}, "job-7", true);
        for (auto& e : events) n.send(e);
        ASSERT_TRUE(n.flush(10s));
        EXPECT_EQ(n.stats().delivered, static_cast<int64_t>(events.size()));
    }
    auto reqs = listener.requests();
    ASSERT_EQ(reqs.size(), events.size());
    std::vector<std::string> types;
    for (const auto& r : reqs) {
        EXPECT_EQ(r.method, "POST");
        EXPECT_EQ(r.path, "/raw");
        EXPECT_EQ(r.headers.at("x-api-key"), "secret-token");
        EXPECT_EQ(r.headers.at("content-type"), "application/json");
        json body = json::parse(r.body);
        EXPECT_EQ(body["job_id"], "job-7");
        EXPECT_TRUE(body.contains("timestamp"));
        types.push_back(body["type"]);
        if (body["type"] == "lifecycle.stage") {
            EXPECT_EQ(body["stage"]["key"], "init_vae_cache");
            EXPECT_DOUBLE_EQ(body["stage"]["progress"]["percent"].get<double>(), 40.0);
        }
        if (body["type"] == "training.progress") {
            EXPECT_EQ(body["progress"]["metrics"]["loss"], 0.25);
        }
        if (body["type"] == "training.checkpoint") {
            EXPECT_EQ(body["checkpoint"]["label"], "checkpoint-10");
        }
        if (body["type"] == "validation.image") {
            // SimpleTuner's ValidationPreviewer payload; images as plain base64 PNG (its send_raw).
            const std::string image = body["images"][0];
            EXPECT_EQ(image, base64_encode(events[5].images[0].png));
            EXPECT_EQ(body["title"], "Validation (step 5/20): cat");
            EXPECT_EQ(body["message"], "Validation (step 5/20): cat");
            EXPECT_EQ(body["body"], "a cat");
            EXPECT_EQ(body["data"]["step"], 5);
            EXPECT_EQ(body["data"]["step_label"], "5/20");
            EXPECT_DOUBLE_EQ(body["data"]["timestep"].get<double>(), 781.0);
            EXPECT_EQ(body["data"]["resolution"], json::array({1024, 768}));
            EXPECT_EQ(body["data"]["validation_type"], "intermediary");
            EXPECT_EQ(body["data"]["prompt"], "a cat");
        }
        if (body["type"] == "gpu.fault") {
            EXPECT_EQ(body["severity"], "critical");
            EXPECT_EQ(body["title"], "GPU Fault: ecc");
            EXPECT_EQ(body["fault"]["gpu"]["uuid"], "GPU-1");
        }
    }
    std::vector<std::string> expected;
    for (const auto& e : events) expected.push_back(e.type);
    EXPECT_EQ(types, expected);  // delivered in order
}

TEST(Webhooks, DiscordBackendPostsMultipartWithAttachments) {
    test::HttpListener listener;
    WebhookTarget t;
    t.type = WebhookType::kDiscord;
    t.url = listener.url("/api/webhooks/1/abc");
    t.message_prefix = "(proj)";
    {
        Notifier n({t}, "job", true);
        for (auto& e : every_event()) n.send(e);
        ASSERT_TRUE(n.flush(10s));
    }
    auto reqs = listener.requests();
    ASSERT_EQ(reqs.size(), every_event().size() - 1);  // previews go to raw targets only
    for (const auto& r : reqs) {
        EXPECT_NE(r.headers.at("content-type").find("multipart/form-data"), std::string::npos);
        auto parts = test::parse_multipart(r);
        ASSERT_TRUE(parts.count("content")) << r.body.substr(0, 200);
        EXPECT_EQ(parts["content"].content.rfind("(proj) ", 0), 0u) << parts["content"].content;
    }
    auto validation = test::parse_multipart(reqs[4]);
    ASSERT_TRUE(validation.count("file0"));
    EXPECT_EQ(validation["file0"].filename, "step_10_cat_0_64x64.png");
    EXPECT_EQ(validation["file0"].content_type, "image/png");
    EXPECT_EQ(validation["file0"].content, every_event()[4].images[0].png);  // bytes intact, NUL included
    EXPECT_NE(test::parse_multipart(reqs[6])["content"].content.find("uncorrectable ECC"), std::string::npos);
}

TEST(Webhooks, LogLevelFiltersEvents) {
    test::HttpListener listener;
    WebhookTarget t = raw_target(listener);
    t.log_level = log::Level::kWarn;
    {
        Notifier n({t}, "job", true);
        for (auto& e : every_event()) n.send(e);
        ASSERT_TRUE(n.flush(10s));
    }
    auto reqs = listener.requests();
    ASSERT_EQ(reqs.size(), 2u);  // the error and the gpu.fault
    EXPECT_EQ(json::parse(reqs[0].body)["type"], "error");
    EXPECT_EQ(json::parse(reqs[1].body)["type"], "gpu.fault");
}

TEST(Webhooks, ServerErrorsAreRetriedThenGivenUp) {
    test::HttpListener listener;
    listener.set_status(500);
    WebhookTarget t = raw_target(listener);
    t.max_retries = 2;
    Notifier n({t}, "job", true);
    n.send(error_event("boom"));
    ASSERT_TRUE(n.flush(15s));
    EXPECT_EQ(listener.requests().size(), 3u);  // 1 + 2 retries
    EXPECT_EQ(n.stats().failed, 1);
    EXPECT_EQ(n.stats().attempts, 3);
}

TEST(Webhooks, HungEndpointNeverBlocksTheCaller) {
    test::HttpListener listener;
    listener.set_delay(30s);  // answers far later than the timeout
    WebhookTarget t = raw_target(listener);
    t.timeout_s = 0.3;
    t.max_retries = 0;
    const auto start = std::chrono::steady_clock::now();
    {
        Notifier n({t}, "job", true);
        for (int i = 0; i < 3; ++i) n.send(training_progress(i, 10, 0, 0.1, 1e-4, 1, 1));
        // send() returned at once although nothing has been delivered yet (a send that waited
        // for the post would take its 0.3 s timeout; the margin is for a loaded CI machine).
        EXPECT_LT(std::chrono::steady_clock::now() - start, 250ms);
        EXPECT_TRUE(n.flush(5s));  // three posts, each cut at 0.3 s
        EXPECT_EQ(n.stats().failed, 3);
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
}

TEST(Webhooks, FullQueueDropsProgressFirstAndDisabledSendsNothing) {
    test::HttpListener listener;
    listener.set_delay(200ms);
    WebhookTarget t = raw_target(listener);
    {
        Notifier n({t}, "job", true);
        n.send(error_event("first"));  // occupies the worker
        for (std::size_t i = 0; i < Notifier::kMaxQueue + 10; ++i)
            n.send(training_progress(i, 1, 0, 0, 0, 0, 0));
        n.send(gpu_fault("ecc", "critical", "keep me", json::object()));
        EXPECT_GE(n.stats().dropped, 9);
        listener.set_delay(0ms);  // let the destructor drain the queue quickly
    }                             // destructor delivers the rest; the fault must be among them
    bool fault_seen = false;
    for (const auto& r : listener.requests()) fault_seen |= json::parse(r.body)["type"] == "gpu.fault";
    EXPECT_TRUE(fault_seen);

    test::HttpListener quiet;
    {
        Notifier n({raw_target(quiet)}, "job", /*enabled=*/false);  // not rank 0
        n.send(error_event("x"));
        EXPECT_TRUE(n.flush(1s));
    }
    EXPECT_TRUE(quiet.requests().empty());
}

// Issue #20: an endpoint that accepts the connection and never answers. close() ends within its
// timeout (not after 20 events x (1 + 2 retries) x 5 s), drops the rest with one warning, and a
// failing webhook logs one warning in all, not one per event.
TEST(Webhooks, CloseIsBoundedWhenTheEndpointNeverAnswers) {
    test::SilentListener silent;
    test::TempDir dir;
    log::set_file(dir / "log.txt");
    WebhookTarget t;
    t.type = WebhookType::kRaw;
    t.url = silent.url();
    t.timeout_s = 5;
    t.max_retries = 2;
    Notifier n({t}, "job", true);
    for (int i = 0; i < 20; ++i) n.send(training_progress(i, 20, 0, 0.1, 1e-4, 1, 1));
    const auto start = std::chrono::steady_clock::now();
    EXPECT_FALSE(n.close(2s));
    const auto took = std::chrono::steady_clock::now() - start;
    log::set_file({});
    EXPECT_GE(took, 1900ms);
    EXPECT_LT(took, 4s) << "close() waited past its timeout";
    EXPECT_GE(n.stats().dropped, 19);
    EXPECT_GE(silent.connections(), 1);  // it really tried
    const std::string log_text = fs::read_file(dir / "log.txt");
    std::size_t warnings = 0;
    for (auto p = log_text.find(" warn: "); p != std::string::npos; p = log_text.find(" warn: ", p + 1))
        ++warnings;
    EXPECT_EQ(warnings, 1u) << log_text;
    EXPECT_NE(log_text.find("not delivered"), std::string::npos) << log_text;
    n.send(error_event("after close"));  // dropped, no crash, no wait
    EXPECT_FALSE(n.close(1s));           // idempotent: the first result, at once
}

// A signal (or any reason to stop waiting) ends close() long before its timeout.
TEST(Webhooks, CloseStopsWaitingWhenAbandoned) {
    test::SilentListener silent;
    WebhookTarget t;
    t.type = WebhookType::kDiscord;
    t.url = silent.url();
    t.timeout_s = 30;
    Notifier n({t}, "job", true);
    n.send(error_event("never answered"));
    std::atomic<bool> stop{false};
    std::thread signaller([&] {
        std::this_thread::sleep_for(300ms);
        stop = true;
    });
    const auto start = std::chrono::steady_clock::now();
    EXPECT_FALSE(n.close(60s, [&] { return stop.load(); }));
    signaller.join();
    EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
}

// Issue #20: the "could not deliver" warning (default level) showed the URL's password; query
// tokens showed through redact_url when the URL had no path.
TEST(Webhooks, FailureWarningsShowNoPasswordOrToken) {
    test::HttpListener listener;
    listener.set_status(500);
    test::TempDir dir;
    log::set_file(dir / "log.txt");
    WebhookTarget t = raw_target(listener);
    const std::string host = "127.0.0.1:" + std::to_string(listener.port());
    t.url = "http://hookuser:PW-in-url-31@" + host + "/raw?token=TOKEN-in-query-32";
    t.max_retries = 0;
    {
        Notifier n({t}, "job", true);
        for (int i = 0; i < 3; ++i) n.send(error_event("boom"));
        EXPECT_TRUE(n.flush(10s));
        EXPECT_EQ(n.stats().failed, 3);
    }
    log::set_file({});
    ASSERT_EQ(listener.requests().size(), 3u);
    const std::string log_text = fs::read_file(dir / "log.txt");
    EXPECT_NE(log_text.find("could not deliver"), std::string::npos) << log_text;
    EXPECT_EQ(log_text.find("could not deliver"), log_text.rfind("could not deliver"))
        << "one warning, not 3";
    for (const char* secret : {"PW-in-url-31", "TOKEN-in-query-32", "hookuser", "secret-token"})
        EXPECT_EQ(log_text.find(secret), std::string::npos) << secret << " in\n" << log_text;
    for (const std::string url :
         {"https://u:PW-5@h.example/x/y", "https://h.example?token=TOK-6", "http://TOK-7@h.example"})
        for (const char* secret : {"PW-5", "TOK-6", "TOK-7"})
            EXPECT_EQ(redact_url(url).find(secret), std::string::npos) << redact_url(url);
}

TEST(Webhooks, UrlsAreRedactedForLogs) {
    EXPECT_EQ(redact_url("https://discord.com/api/webhooks/123/SECRET"), "https://discord.com/…");
    EXPECT_EQ(redact_url("garbage"), "<url>");
    EXPECT_EQ(base64_encode("Man"), "TWFu");
    EXPECT_EQ(base64_encode("Ma"), "TWE=");
    EXPECT_EQ(base64_encode("M"), "TQ==");
}

}  // namespace dtune::notify
