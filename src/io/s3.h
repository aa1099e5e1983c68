// A small S3 client on libcurl + OpenSSL: ListObjectsV2, GetObject (whole or a byte range),
// HeadObject, PutObject (multipart above a threshold), DeleteObject, CreateBucket; parallel
// batches; retries with exponential backoff and full jitter on 5xx, throttling and network errors.
//
// Invariants:
// - credentials are never written anywhere: errors name the operation, bucket, key, endpoint,
//   HTTP status and S3 error code only, and any server message is scrubbed of the key values;
// - at most `max_connections` requests are in flight at once per client; curl handles (and the
//   connections they keep alive) are pooled and reused; every method is thread-safe;
// - a failed multipart upload is aborted, so no half object becomes visible.
#pragma once

#include "io/sigv4.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dtune::io {

enum class S3Addressing { kAuto, kPath, kVirtualHost };

struct S3Config {
    std::string bucket;
    std::string region;    // empty: AWS_REGION, AWS_DEFAULT_REGION, else us-east-1
    std::string endpoint;  // "http://127.0.0.1:8333"; empty: AWS_ENDPOINT_URL, else AWS
    S3Addressing addressing = S3Addressing::kAuto;  // auto: virtual host on AWS, path elsewhere
    sigv4::Credentials credentials;                 // empty: environment, then ~/.aws/credentials [profile]
    std::string profile;                            // empty: AWS_PROFILE, else "default"
    int max_connections = 16;                       // SimpleTuner's aws_max_pool_connections
    int max_attempts = 6;                           // 1 try + 5 retries, like SimpleTuner
    double backoff_base_s = 0.2;                    // sleep ~ U(0, min(cap, base * 2^attempt))
    double backoff_cap_s = 10.0;
    double connect_timeout_s = 10.0;
    double low_speed_timeout_s = 60.0;  // abort a transfer slower than 1 KiB/s for this long
    std::size_t multipart_threshold = 64u << 20;
    std::size_t multipart_part_size = 16u << 20;  // S3's minimum is 5 MiB (except the last part)
    int list_page_size = 1000;                    // ListObjectsV2 max-keys
    // curl CONNECT_TO entries ("host:port:connect-host:connect-port") so tests can reach a
    // virtual-hosted bucket name on loopback without DNS.
    std::vector<std::string> connect_to;
};

struct S3Object {
    std::string key;
    std::uint64_t size = 0;
    std::string etag;
};

// Fills region, endpoint and credentials from the environment / credentials file where the
// config leaves them empty. Throws UsageError (naming the variables and file to set) when no
// credentials are found; the message never contains a key value.
S3Config resolve_s3_config(S3Config config);

class S3Client {
  public:
    explicit S3Client(S3Config config);  // resolves via resolve_s3_config
    ~S3Client();
    S3Client(const S3Client&) = delete;
    S3Client& operator=(const S3Client&) = delete;

    const std::string& bucket() const { return config_.bucket; }
    const std::string& endpoint() const { return config_.endpoint; }
    const std::string& region() const { return config_.region; }

    // Every object whose key starts with `prefix`, in key order (ListObjectsV2, all pages).
    std::vector<S3Object> list(const std::string& prefix = "") const;
    std::string get(const std::string& key) const;
    // nullopt when the object does not exist (one request; other errors throw like get()).
    std::optional<std::string> get_if_exists(const std::string& key) const;
    // `length` bytes from `offset` (fewer at the end of the object).
    std::string get_range(const std::string& key, std::uint64_t offset, std::uint64_t length) const;
    // nullopt when the object does not exist.
    std::optional<S3Object> head(const std::string& key) const;
    void put(const std::string& key, std::string_view bytes) const;
    void remove(const std::string& key) const;  // no error when absent (S3 semantics)
    void create_bucket() const;                 // no error when it already exists and is ours

    // Batches over a pool of max_connections threads; results in input order. The first error
    // (by index) is rethrown after every request has finished.
    std::vector<std::string> get_many(const std::vector<std::string>& keys) const;
    std::vector<std::optional<std::string>> get_many_if_exists(const std::vector<std::string>& keys) const;
    void put_many(const std::vector<std::pair<std::string, std::string>>& objects) const;

    // Counters for tests and benchmarks.
    std::uint64_t requests_sent() const;
    std::uint64_t retries() const;

    struct Impl;

  private:
    S3Config config_;
    std::unique_ptr<Impl> impl_;
};

// Builds the URL and canonical URI of a request (exposed for tests of the addressing modes).
struct S3Target {
    std::string url;            // without query
    std::string host;           // Host header value
    std::string canonical_uri;  // encoded path, as signed
};
S3Target s3_target(const S3Config& config, const std::string& key);

}  // namespace dtune::io
