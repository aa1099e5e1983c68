// Minimal HTTP over libcurl: POST for webhooks (JSON bodies and multipart forms) and GET for
// downloads (the images of `type: csv` datasets); a hard timeout, optional TLS verification bypass,
// cancellation. One call = one request (redirects followed); retries live in the caller.
#pragma once

#include <atomic>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace dtune::notify {

struct HttpResult {
    long status = 0;    // HTTP status, 0 when no response arrived
    std::string error;  // transport error (timeout, refused, TLS), empty on a response
    bool ok() const { return error.empty() && status >= 200 && status < 300; }
    // Worth another try: transport failure, throttling or a server error.
    bool retryable() const { return !error.empty() || status == 429 || status >= 500; }
};

struct MultipartFile {
    std::string field;         // form field name, e.g. "file0"
    std::string filename;      // e.g. "step_100_cat_0_1024x1024.png"
    std::string content_type;  // e.g. "image/png"
    std::string bytes;
};

struct HttpOptions {
    double timeout_s = 5.0;
    bool ssl_no_verify = false;
    std::vector<std::pair<std::string, std::string>> headers;  // extra headers
    // When set and true, the request in flight is abandoned within about a second (shutdown).
    const std::atomic<bool>* cancel = nullptr;
};

HttpResult http_post_json(const std::string& url, const std::string& json_body, const HttpOptions& options);
HttpResult http_post_multipart(const std::string& url,
                               const std::vector<std::pair<std::string, std::string>>& fields,
                               const std::vector<MultipartFile>& files, const HttpOptions& options);
// GET into `body` (replaced; holds the error page on a non-2xx answer). A body larger than
// `max_bytes`, or shorter than its Content-Length (a cut connection), is a transport error.
HttpResult http_get(const std::string& url, std::string& body, const HttpOptions& options,
                    std::size_t max_bytes);

// "https://user:pw@discord.com/api/webhooks/123/abc?token=x" -> "https://discord.com/…": URLs of
// webhooks are secrets as a whole (whoever has one can post), so logs show only the scheme and
// the host; userinfo, path and query never appear (core/redact.h's redact_url_to_host).
std::string redact_url(const std::string& url);

}  // namespace dtune::notify
