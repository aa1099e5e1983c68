// AWS Signature Version 4 on OpenSSL's SHA-256 and HMAC. See sigv4.h.
#include "io/sigv4.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>

#include <algorithm>
#include <cctype>
#include <ctime>

namespace dtune::io::sigv4 {
namespace {

std::string lower(std::string s) {
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
}

// Header values are signed trimmed, with runs of spaces collapsed to one.
std::string trim_collapse(const std::string& v) {
    std::string out;
    bool space = false;
    for (char c : v) {
        if (c == ' ' || c == '\t') {
            space = !out.empty();
            continue;
        }
        if (space) out += ' ';
        space = false;
        out += c;
    }
    return out;
}

}  // namespace

std::string to_hex(std::string_view bytes) {
    static const char* kDigits = "0123456789abcdef";
    std::string out;
    out.reserve(bytes.size() * 2);
    for (unsigned char b : bytes) {
        out += kDigits[b >> 4];
        out += kDigits[b & 15];
    }
    return out;
}

std::string sha256_hex(std::string_view data) {
    unsigned char digest[SHA256_DIGEST_LENGTH];
    SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), digest);
    return to_hex(std::string_view(reinterpret_cast<const char*>(digest), sizeof digest));
}

std::string hmac_sha256(std::string_view key, std::string_view data) {
    unsigned char out[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
         reinterpret_cast<const unsigned char*>(data.data()), data.size(), out, &len);
    return std::string(reinterpret_cast<const char*>(out), len);
}

std::string uri_encode(std::string_view in, bool encode_slash) {
    static const char* kDigits = "0123456789ABCDEF";
    std::string out;
    out.reserve(in.size() * 3 / 2);
    for (unsigned char c : in) {
        const bool unreserved = std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~';
        if (unreserved || (c == '/' && !encode_slash)) {
            out += static_cast<char>(c);
        } else {
            out += '%';
            out += kDigits[c >> 4];
            out += kDigits[c & 15];
        }
    }
    return out;
}

std::string canonical_query(const Params& query) {
    std::vector<std::pair<std::string, std::string>> enc;
    enc.reserve(query.size());
    for (const auto& [k, v] : query) enc.emplace_back(uri_encode(k, true), uri_encode(v, true));
    std::sort(enc.begin(), enc.end());
    std::string out;
    for (const auto& [k, v] : enc) {
        if (!out.empty()) out += '&';
        out += k + "=" + v;
    }
    return out;
}

std::string amz_date(std::chrono::system_clock::time_point t) {
    const std::time_t secs = std::chrono::system_clock::to_time_t(t);
    std::tm tm{};
    gmtime_r(&secs, &tm);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
    return buf;
}

Signature sign(const Request& request, const Credentials& credentials, const std::string& region,
               const std::string& service, const std::string& amz_date) {
    // Canonical headers: lower-case names, sorted; duplicate names would be comma-joined, but we
    // never send duplicates.
    std::vector<std::pair<std::string, std::string>> headers;
    for (const auto& [k, v] : request.headers) headers.emplace_back(lower(k), trim_collapse(v));
    std::sort(headers.begin(), headers.end());
    std::string canonical_headers, signed_headers;
    for (const auto& [k, v] : headers) {
        canonical_headers += k + ":" + v + "\n";
        if (!signed_headers.empty()) signed_headers += ';';
        signed_headers += k;
    }
    Signature s;
    s.canonical_request = request.method + "\n" + request.canonical_uri + "\n" +
                          canonical_query(request.query) + "\n" + canonical_headers + "\n" + signed_headers +
                          "\n" + request.payload_hash;
    const std::string date = amz_date.substr(0, 8);
    const std::string scope = date + "/" + region + "/" + service + "/aws4_request";
    s.string_to_sign =
        "AWS4-HMAC-SHA256\n" + amz_date + "\n" + scope + "\n" + sha256_hex(s.canonical_request);
    std::string key = hmac_sha256("AWS4" + credentials.secret_access_key, date);
    key = hmac_sha256(key, region);
    key = hmac_sha256(key, service);
    key = hmac_sha256(key, "aws4_request");
    s.signature = to_hex(hmac_sha256(key, s.string_to_sign));
    s.authorization = "AWS4-HMAC-SHA256 Credential=" + credentials.access_key_id + "/" + scope +
                      ",SignedHeaders=" + signed_headers + ",Signature=" + s.signature;
    return s;
}

}  // namespace dtune::io::sigv4
