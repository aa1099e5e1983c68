// S3 operations over pooled libcurl easy handles. One request = sign (fresh x-amz-date per
// attempt), send, classify; transient failures (network, 5xx, 429/SlowDown, RequestTimeout) are
// retried with exponential backoff and full jitter. See s3.h for the invariants.
#include "io/s3.h"

#include "core/error.h"
#include "core/log.h"
#include "core/thread_pool.h"
#include "io/s3_xml.h"

#include <curl/curl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <semaphore>
#include <thread>

namespace dtune::io {
namespace {

struct Response {
    long status = 0;
    std::string body;
    std::map<std::string, std::string> headers;  // lower-case names
    std::string transport_error;                 // curl's message; empty when a response came
};

// One request as the operations describe it; the transport adds host, date, hashes and auth.
struct Op {
    std::string method;
    std::string key;
    sigv4::Params query;
    sigv4::Params headers;
    std::string_view body;
    bool allow_404 = false;
};

size_t on_body(char* data, size_t size, size_t n, void* user) {
    static_cast<std::string*>(user)->append(data, size * n);
    return size * n;
}

size_t on_header(char* data, size_t size, size_t n, void* user) {
    std::string_view line(data, size * n);
    const auto colon = line.find(':');
    if (colon != std::string_view::npos) {
        std::string name(line.substr(0, colon));
        for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        std::string_view value = line.substr(colon + 1);
        while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
        while (!value.empty() && (value.back() == '\r' || value.back() == '\n' || value.back() == ' '))
            value.remove_suffix(1);
        (*static_cast<std::map<std::string, std::string>*>(user))[name] = std::string(value);
    }
    return size * n;
}

void global_init() {
    static std::once_flag once;
    std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

// A connection that dies mid-response can look like a complete, shorter answer (a server that
// closes instead of framing, or a cut inside the headers). A GET body must match its announced
// Content-Length, and a 2xx GET of an object must announce one (or be chunked, which curl checks).
void check_complete(const Op& op, Response& r) {
    if (op.method != "GET" || r.status < 200 || r.status >= 300) return;
    const auto len = r.headers.find("content-length");
    if (len != r.headers.end()) {
        if (std::strtoull(len->second.c_str(), nullptr, 10) != r.body.size())
            r.transport_error = "truncated response (body shorter than its Content-Length)";
        return;
    }
    const auto te = r.headers.find("transfer-encoding");
    if (!op.key.empty() && (te == r.headers.end() || te->second.find("chunked") == std::string::npos))
        r.transport_error = "response without Content-Length (connection cut?)";
}

std::string format_seconds(double s) {
    char buf[32];
    std::snprintf(buf, sizeof buf, s < 10 ? "%.2f s" : "%.0f s", s);
    return buf;
}

bool retryable(const Response& r) {
    if (!r.transport_error.empty()) return true;
    if (r.status == 429 || r.status == 500 || r.status == 502 || r.status == 503 || r.status == 504)
        return true;
    if (r.status == 400 && s3xml::first(r.body, "Code") == "RequestTimeout") return true;
    return false;
}

}  // namespace

struct S3Client::Impl {
    const S3Config& config;
    CURLSH* share = nullptr;
    std::mutex share_locks[CURL_LOCK_DATA_LAST];
    std::mutex idle_mutex;
    std::vector<CURL*> idle;  // easy handles keep their live connections between requests
    std::counting_semaphore<1 << 16> slots;
    std::once_flag pool_once;
    std::unique_ptr<ThreadPool> pool;
    std::atomic<std::uint64_t> requests{0}, retries{0};

    explicit Impl(const S3Config& c) : config(c), slots(c.max_connections) {
        global_init();
        share = curl_share_init();
        curl_share_setopt(share, CURLSHOPT_LOCKFUNC, &Impl::lock);
        curl_share_setopt(share, CURLSHOPT_UNLOCKFUNC, &Impl::unlock);
        curl_share_setopt(share, CURLSHOPT_USERDATA, this);
        curl_share_setopt(share, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS);
        curl_share_setopt(share, CURLSHOPT_SHARE, CURL_LOCK_DATA_SSL_SESSION);
    }
    ~Impl() {
        for (CURL* h : idle) curl_easy_cleanup(h);
        curl_share_cleanup(share);
    }
    static void lock(CURL*, curl_lock_data data, curl_lock_access, void* self) {
        static_cast<Impl*>(self)->share_locks[data].lock();
    }
    static void unlock(CURL*, curl_lock_data data, void* self) {
        static_cast<Impl*>(self)->share_locks[data].unlock();
    }

    ThreadPool& thread_pool() {
        std::call_once(pool_once, [&] { pool = std::make_unique<ThreadPool>(config.max_connections); });
        return *pool;
    }

    CURL* acquire() {
        std::lock_guard lock(idle_mutex);
        if (!idle.empty()) {
            CURL* h = idle.back();
            idle.pop_back();
            return h;
        }
        return curl_easy_init();
    }
    void release(CURL* h) {
        std::lock_guard lock(idle_mutex);
        idle.push_back(h);
    }

    std::string describe(const Op& op) const {
        return str(op.method, " s3://", config.bucket, "/", op.key, " at ", config.endpoint);
    }
    curl_slist* signed_headers(const Op& op, const S3Target& target) const;
    void set_transport_options(CURL* h, Response& r, curl_slist* connect_to);
    Response attempt(const Op& op);
    Response execute(const Op& op);
    [[noreturn]] void fail(const Op& op, const Response& r, double seconds) const;
    std::string timeout_detail(CURL* h) const;
};

// The request's headers, signed now (each attempt gets a fresh x-amz-date).
curl_slist* S3Client::Impl::signed_headers(const Op& op, const S3Target& target) const {
    const std::string date = sigv4::amz_date(std::chrono::system_clock::now());
    sigv4::Request req;
    req.method = op.method;
    req.canonical_uri = target.canonical_uri;
    req.query = op.query;
    req.payload_hash = sigv4::sha256_hex(op.body);
    req.headers = op.headers;
    req.headers.emplace_back("host", target.host);
    req.headers.emplace_back("x-amz-date", date);
    req.headers.emplace_back("x-amz-content-sha256", req.payload_hash);
    if (!config.credentials.session_token.empty())
        req.headers.emplace_back("x-amz-security-token", config.credentials.session_token);
    const sigv4::Signature sig = sign(req, config.credentials, config.region, "s3", date);

    curl_slist* headers = nullptr;
    for (const auto& [k, v] : req.headers) headers = curl_slist_append(headers, (k + ": " + v).c_str());
    headers = curl_slist_append(headers, ("Authorization: " + sig.authorization).c_str());
    headers = curl_slist_append(headers, "Expect:");  // no 100-continue round trip
    if (!op.body.empty() || op.method == "PUT" || op.method == "POST")
        headers = curl_slist_append(headers, "Content-Type: application/octet-stream");
    return headers;
}

// Transport options shared by every request on a freshly reset handle.
void S3Client::Impl::set_transport_options(CURL* h, Response& r, curl_slist* connect_to) {
    curl_easy_setopt(h, CURLOPT_SHARE, share);
    if (connect_to) curl_easy_setopt(h, CURLOPT_CONNECT_TO, connect_to);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(config.connect_timeout_s * 1000));
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1024L);
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, static_cast<long>(std::max(1.0, config.low_speed_timeout_s)));
    curl_easy_setopt(h, CURLOPT_USERAGENT, "dtune-s3/1");
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &r.body);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &r.headers);
}

Response S3Client::Impl::attempt(const Op& op) {
    const S3Target target = s3_target(config, op.key);
    curl_slist* headers = signed_headers(op, target);
    const std::string query = sigv4::canonical_query(op.query);
    const std::string url = target.url + (query.empty() ? "" : "?" + query);
    Response r;
    slots.acquire();
    CURL* h = acquire();
    if (!h) {
        slots.release();
        curl_slist_free_all(headers);
        r.transport_error = "curl_easy_init failed (out of memory?)";
        return r;
    }
    curl_easy_reset(h);  // keeps the connection cache, drops the last request's options
    curl_slist* connect_to = nullptr;
    for (const auto& c : config.connect_to) connect_to = curl_slist_append(connect_to, c.c_str());
    set_transport_options(h, r, connect_to);
    curl_easy_setopt(h, CURLOPT_URL, url.c_str());
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    if (op.method == "HEAD") {
        curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    } else if (op.method == "GET") {
        curl_easy_setopt(h, CURLOPT_HTTPGET, 1L);
    } else {
        curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, op.method.c_str());
        if (op.method != "DELETE") {
            curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(op.body.size()));
            // Never NULL: curl would then read the body from its default callback (stdin).
            curl_easy_setopt(h, CURLOPT_POSTFIELDS, op.body.empty() ? "" : op.body.data());
        }
    }
    const CURLcode rc = curl_easy_perform(h);
    if (rc == CURLE_OK) {
        curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &r.status);
        check_complete(op, r);
    } else {
        r.transport_error = curl_easy_strerror(rc);
        if (rc == CURLE_OPERATION_TIMEDOUT) r.transport_error += timeout_detail(h);
    }
    release(h);
    slots.release();
    curl_slist_free_all(headers);
    curl_slist_free_all(connect_to);
    ++requests;
    return r;
}

Response S3Client::Impl::execute(const Op& op) {
    thread_local std::mt19937_64 rng{std::random_device{}()};
    const auto start = std::chrono::steady_clock::now();
    Response r;
    for (int attempt_no = 0;; ++attempt_no) {
        r = attempt(op);
        if (!retryable(r) || attempt_no + 1 >= config.max_attempts) break;
        ++retries;
        // Full jitter: spreads the retries of many parallel requests after a shared hiccup.
        const double cap = std::min(config.backoff_cap_s, config.backoff_base_s * std::pow(2.0, attempt_no));
        const double sleep_s = std::uniform_real_distribution<double>(0.0, cap)(rng);
        // A warning, not a debug line: a server that does not answer must not look like a hang.
        log::warn() << "S3: " << describe(op) << ": "
                    << (r.transport_error.empty() ? str("HTTP ", r.status) : r.transport_error)
                    << "; retrying in " << format_seconds(sleep_s) << " (attempt " << attempt_no + 2 << " of "
                    << config.max_attempts << ")";
        std::this_thread::sleep_for(std::chrono::duration<double>(sleep_s));
    }
    if (r.transport_error.empty() && r.status >= 200 && r.status < 300) return r;
    // A missing bucket is never "the object is absent" (HEAD has no body to tell them apart).
    if (op.allow_404 && r.status == 404 && s3xml::first(r.body, "Code") != "NoSuchBucket") return r;
    fail(op, r, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

// Which of the two limits ended a timed-out request: the connect timeout or the stall limit.
std::string S3Client::Impl::timeout_detail(CURL* h) const {
    curl_off_t connected_us = 0;
    curl_easy_getinfo(h, CURLINFO_CONNECT_TIME_T, &connected_us);
    if (connected_us == 0)
        return str(" (no connection within ", format_seconds(config.connect_timeout_s), ")");
    return str(" (connected, but the server sent less than 1 KiB in ",
               format_seconds(std::max(1.0, config.low_speed_timeout_s)), ")");
}

void S3Client::Impl::fail(const Op& op, const Response& r, double seconds) const {
    const std::string where = describe(op);
    if (!r.transport_error.empty())
        throw DataError(str("S3: ", where, " failed after ", config.max_attempts, " attempts in ",
                            format_seconds(seconds), ": ", r.transport_error,
                            "; check aws_endpoint_url (and that the server is reachable)"));
    const std::string code = s3xml::first(r.body, "Code");
    std::string message = s3xml::first(r.body, "Message");
    // Servers may echo request details; never let a key value through.
    for (const std::string* secret :
         {&config.credentials.access_key_id, &config.credentials.secret_access_key,
          &config.credentials.session_token}) {
        if (secret->empty()) continue;
        for (auto p = message.find(*secret); p != std::string::npos; p = message.find(*secret))
            message.replace(p, secret->size(), "<redacted>");
    }
    if (message.size() > 200) message = message.substr(0, 200) + "…";
    std::string fix;
    if (code == "SignatureDoesNotMatch" || code == "InvalidAccessKeyId" || code == "InvalidToken" ||
        code == "ExpiredToken" || (r.status == 403 && code.empty()))
        fix =
            "check aws_access_key_id / aws_secret_access_key / aws_session_token (or AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, ~/.aws/credentials)";
    else if (code == "AccessDenied")
        fix = "the credentials are valid but lack permission on this bucket/key";
    else if (code == "NoSuchBucket")
        fix = "check aws_bucket_name and aws_endpoint_url";
    else if (code == "NoSuchKey" || r.status == 404)
        fix = "the object does not exist; check aws_data_prefix and the path";
    else if (code == "AuthorizationHeaderMalformed" || code == "PermanentRedirect" || r.status == 301)
        fix = "wrong region or endpoint; set aws_region_name to the bucket's region (or aws_endpoint_url)";
    else
        fix = "see the S3 error code";
    throw DataError(str("S3: ", where, ": HTTP ", r.status, code.empty() ? "" : " " + code,
                        message.empty() ? "" : " (" + message + ")", "; ", fix));
}

S3Client::S3Client(S3Config config)
    : config_(resolve_s3_config(std::move(config))), impl_(std::make_unique<Impl>(config_)) {}

S3Client::~S3Client() = default;

std::uint64_t S3Client::requests_sent() const {
    return impl_->requests;
}
std::uint64_t S3Client::retries() const {
    return impl_->retries;
}

std::vector<S3Object> S3Client::list(const std::string& prefix) const {
    std::vector<S3Object> out;
    std::string token;
    for (;;) {
        Op op{"GET", "", {{"list-type", "2"}, {"max-keys", std::to_string(config_.list_page_size)}}, {}, {}};
        if (!prefix.empty()) op.query.emplace_back("prefix", prefix);
        if (!token.empty()) op.query.emplace_back("continuation-token", token);
        const Response r = impl_->execute(op);
        for (std::string_view item : s3xml::all(r.body, "Contents")) {
            S3Object o;
            o.key = s3xml::first(item, "Key");
            o.size = std::strtoull(s3xml::first(item, "Size").c_str(), nullptr, 10);
            o.etag = s3xml::first(item, "ETag");
            out.push_back(std::move(o));
        }
        if (s3xml::first(r.body, "IsTruncated") != "true") break;
        token = s3xml::first(r.body, "NextContinuationToken");
        DTUNE_CHECK_AS(DataError, !token.empty(), "S3: listing s3://", config_.bucket, "/", prefix, " at ",
                       config_.endpoint,
                       ": truncated page without NextContinuationToken; the server is not "
                       "ListObjectsV2-compatible");
    }
    std::sort(out.begin(), out.end(), [](const S3Object& a, const S3Object& b) { return a.key < b.key; });
    return out;
}

std::string S3Client::get(const std::string& key) const {
    return impl_->execute(Op{"GET", key, {}, {}, {}}).body;
}

std::optional<std::string> S3Client::get_if_exists(const std::string& key) const {
    Op op{"GET", key, {}, {}, {}};
    op.allow_404 = true;
    Response r = impl_->execute(op);
    if (r.status == 404) return std::nullopt;
    return std::move(r.body);
}

std::string S3Client::get_range(const std::string& key, std::uint64_t offset, std::uint64_t length) const {
    if (length == 0) return {};
    const std::string range = str("bytes=", offset, "-", offset + length - 1);
    return impl_->execute(Op{"GET", key, {}, {{"range", range}}, {}}).body;
}

std::optional<S3Object> S3Client::head(const std::string& key) const {
    Op op{"HEAD", key, {}, {}, {}};
    op.allow_404 = true;
    const Response r = impl_->execute(op);
    if (r.status == 404) return std::nullopt;
    S3Object o;
    o.key = key;
    const auto len = r.headers.find("content-length");
    if (len != r.headers.end()) o.size = std::strtoull(len->second.c_str(), nullptr, 10);
    const auto etag = r.headers.find("etag");
    if (etag != r.headers.end()) o.etag = etag->second;
    return o;
}

void S3Client::remove(const std::string& key) const {
    Op op{"DELETE", key, {}, {}, {}};
    op.allow_404 = true;
    impl_->execute(op);
}

void S3Client::create_bucket() const {
    std::string body;
    if (config_.region != "us-east-1")
        body = "<CreateBucketConfiguration><LocationConstraint>" + config_.region +
               "</LocationConstraint></CreateBucketConfiguration>";
    try {
        impl_->execute(Op{"PUT", "", {}, {}, body});
    } catch (const DataError& e) {
        if (std::string(e.what()).find("BucketAlreadyOwnedByYou") == std::string::npos) throw;
    }
}

void S3Client::put(const std::string& key, std::string_view bytes) const {
    if (bytes.size() <= config_.multipart_threshold) {
        impl_->execute(Op{"PUT", key, {}, {}, bytes});
        return;
    }
    // Multipart: create, upload the parts in order, complete; abort on any failure so the
    // server drops the parts and no partial object appears.
    const Response created = impl_->execute(Op{"POST", key, {{"uploads", ""}}, {}, {}});
    const std::string upload_id = s3xml::first(created.body, "UploadId");
    DTUNE_CHECK_AS(DataError, !upload_id.empty(), "S3: multipart upload of s3://", config_.bucket, "/", key,
                   " at ", config_.endpoint,
                   ": the server returned no UploadId; it may not support multipart uploads");
    try {
        std::string complete = "<CompleteMultipartUpload>";
        const std::size_t part = config_.multipart_part_size;
        for (std::size_t offset = 0, number = 1; offset < bytes.size(); offset += part, ++number) {
            const std::string n = std::to_string(number);
            const Response r = impl_->execute(
                Op{"PUT", key, {{"partNumber", n}, {"uploadId", upload_id}}, {}, bytes.substr(offset, part)});
            const auto etag = r.headers.find("etag");
            DTUNE_CHECK_AS(DataError, etag != r.headers.end(), "S3: part ", n, " of s3://", config_.bucket,
                           "/", key, " came back without an ETag");
            complete += "<Part><PartNumber>" + n + "</PartNumber><ETag>" + s3xml::escape(etag->second) +
                        "</ETag></Part>";
        }
        complete += "</CompleteMultipartUpload>";
        const Response done = impl_->execute(Op{"POST", key, {{"uploadId", upload_id}}, {}, complete});
        // CompleteMultipartUpload can fail with 200 and an <Error> body.
        DTUNE_CHECK_AS(DataError, s3xml::all(done.body, "Error").empty(),
                       "S3: completing the multipart upload of s3://", config_.bucket, "/", key, " at ",
                       config_.endpoint, " failed: ", s3xml::first(done.body, "Code"));
    } catch (...) {
        try {
            Op abort{"DELETE", key, {{"uploadId", upload_id}}, {}, {}};
            abort.allow_404 = true;
            impl_->execute(abort);
        } catch (...) {
            // The original error matters more; a leftover upload only costs storage until it expires.
        }
        throw;
    }
}

std::vector<std::string> S3Client::get_many(const std::vector<std::string>& keys) const {
    std::vector<std::string> out(keys.size());
    impl_->thread_pool().parallel_for(keys.size(), [&](std::size_t i) { out[i] = get(keys[i]); });
    return out;
}

std::vector<std::optional<std::string>> S3Client::get_many_if_exists(
    const std::vector<std::string>& keys) const {
    std::vector<std::optional<std::string>> out(keys.size());
    impl_->thread_pool().parallel_for(keys.size(), [&](std::size_t i) { out[i] = get_if_exists(keys[i]); });
    return out;
}

void S3Client::put_many(const std::vector<std::pair<std::string, std::string>>& objects) const {
    impl_->thread_pool().parallel_for(objects.size(),
                                      [&](std::size_t i) { put(objects[i].first, objects[i].second); });
}

}  // namespace dtune::io
