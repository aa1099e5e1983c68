// libcurl-backed HTTP POST and GET. curl_global_init runs once; each request uses its own easy handle so
// calls are thread-safe (webhooks post from one background thread anyway).
#include "notify/http.h"

#include "core/redact.h"

#include <curl/curl.h>

#include <memory>
#include <mutex>

namespace dtune::notify {
namespace {

void global_init() {
    static std::once_flag once;
    std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

size_t discard(char*, size_t size, size_t n, void*) {
    return size * n;
}

// libcurl calls this about once a second even while nothing moves; non-zero aborts the transfer.
int on_progress(void* cancel, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
    return static_cast<const std::atomic<bool>*>(cancel)->load() ? 1 : 0;
}

struct Easy {
    CURL* handle = curl_easy_init();
    curl_slist* headers = nullptr;
    curl_mime* mime = nullptr;
    ~Easy() {
        if (mime) curl_mime_free(mime);
        if (headers) curl_slist_free_all(headers);
        if (handle) curl_easy_cleanup(handle);
    }
};

void common_setup(Easy& e, const std::string& url, const HttpOptions& options) {
    curl_easy_setopt(e.handle, CURLOPT_URL, url.c_str());
    curl_easy_setopt(e.handle, CURLOPT_TIMEOUT_MS, static_cast<long>(options.timeout_s * 1000));
    curl_easy_setopt(e.handle, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(options.timeout_s * 1000));
    curl_easy_setopt(e.handle, CURLOPT_NOSIGNAL, 1L);  // timeouts without SIGALRM (threads)
    curl_easy_setopt(e.handle, CURLOPT_WRITEFUNCTION, discard);
    curl_easy_setopt(e.handle, CURLOPT_USERAGENT, "dtune-webhook/1");
    if (options.ssl_no_verify) {
        curl_easy_setopt(e.handle, CURLOPT_SSL_VERIFYPEER, 0L);
        curl_easy_setopt(e.handle, CURLOPT_SSL_VERIFYHOST, 0L);
    }
    if (options.cancel) {
        curl_easy_setopt(e.handle, CURLOPT_XFERINFOFUNCTION, on_progress);
        curl_easy_setopt(e.handle, CURLOPT_XFERINFODATA, options.cancel);
        curl_easy_setopt(e.handle, CURLOPT_NOPROGRESS, 0L);
    }
    for (const auto& [k, v] : options.headers)
        e.headers = curl_slist_append(e.headers, (k + ": " + v).c_str());
}

HttpResult perform(Easy& e) {
    if (e.headers) curl_easy_setopt(e.handle, CURLOPT_HTTPHEADER, e.headers);
    HttpResult result;
    CURLcode rc = curl_easy_perform(e.handle);
    if (rc != CURLE_OK) {
        result.error = curl_easy_strerror(rc);
        return result;
    }
    curl_easy_getinfo(e.handle, CURLINFO_RESPONSE_CODE, &result.status);
    return result;
}

// Appends to the body until it would pass the limit; returning less than given aborts the transfer.
struct BoundedBody {
    std::string* out;
    std::size_t max_bytes;
    bool overflow = false;
};

size_t append_bounded(char* data, size_t size, size_t n, void* user) {
    auto* b = static_cast<BoundedBody*>(user);
    if (b->out->size() + size * n > b->max_bytes) {
        b->overflow = true;
        return 0;
    }
    b->out->append(data, size * n);
    return size * n;
}

}  // namespace

HttpResult http_get(const std::string& url, std::string& body, const HttpOptions& options,
                    std::size_t max_bytes) {
    global_init();
    body.clear();
    Easy e;
    if (!e.handle) return {0, "curl_easy_init failed"};
    common_setup(e, url, options);
    BoundedBody sink{&body, max_bytes};
    curl_easy_setopt(e.handle, CURLOPT_WRITEFUNCTION, append_bounded);
    curl_easy_setopt(e.handle, CURLOPT_WRITEDATA, &sink);
    curl_easy_setopt(e.handle, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(e.handle, CURLOPT_MAXREDIRS, 5L);
    curl_easy_setopt(e.handle, CURLOPT_USERAGENT, "dtune/1");
    HttpResult result = perform(e);
    if (sink.overflow) result.error = "the response is larger than " + std::to_string(max_bytes) + " bytes";
    return result;
}

HttpResult http_post_json(const std::string& url, const std::string& json_body, const HttpOptions& options) {
    global_init();
    Easy e;
    if (!e.handle) return {0, "curl_easy_init failed"};
    common_setup(e, url, options);
    e.headers = curl_slist_append(e.headers, "Content-Type: application/json");
    curl_easy_setopt(e.handle, CURLOPT_POSTFIELDS, json_body.c_str());
    curl_easy_setopt(e.handle, CURLOPT_POSTFIELDSIZE, static_cast<long>(json_body.size()));
    return perform(e);
}

HttpResult http_post_multipart(const std::string& url,
                               const std::vector<std::pair<std::string, std::string>>& fields,
                               const std::vector<MultipartFile>& files, const HttpOptions& options) {
    global_init();
    Easy e;
    if (!e.handle) return {0, "curl_easy_init failed"};
    common_setup(e, url, options);
    e.mime = curl_mime_init(e.handle);
    for (const auto& [name, value] : fields) {
        curl_mimepart* part = curl_mime_addpart(e.mime);
        curl_mime_name(part, name.c_str());
        curl_mime_data(part, value.data(), value.size());
    }
    for (const auto& f : files) {
        curl_mimepart* part = curl_mime_addpart(e.mime);
        curl_mime_name(part, f.field.c_str());
        curl_mime_filename(part, f.filename.c_str());
        curl_mime_type(part, f.content_type.c_str());
        curl_mime_data(part, f.bytes.data(), f.bytes.size());
    }
    curl_easy_setopt(e.handle, CURLOPT_MIMEPOST, e.mime);
    return perform(e);
}

std::string redact_url(const std::string& url) {
    return redact_url_to_host(url);
}

}  // namespace dtune::notify
