// AWS Signature Version 4 for S3 (header-based auth): canonical request, string to sign, signing
// key and the Authorization header, plus the hashing and URI-encoding helpers they need.
//
// Invariants: pure functions of their inputs (the time is a parameter), so the published AWS
// example requests reproduce bit for bit. Nothing here logs; a Credentials value is never
// streamed or formatted anywhere (it has no operator<<), so the secret cannot leak by accident.
#pragma once

#include <chrono>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtune::io::sigv4 {

// An access key pair, optionally with a session token (temporary STS credentials).
struct Credentials {
    std::string access_key_id;
    std::string secret_access_key;
    std::string session_token;  // empty: long-lived keys
    bool empty() const { return access_key_id.empty() || secret_access_key.empty(); }
};

using Params = std::vector<std::pair<std::string, std::string>>;

// What gets signed. `canonical_uri` is already URI-encoded (each key segment encoded once, '/'
// kept), exactly as sent on the wire; `query` and `headers` are raw (unencoded) values.
struct Request {
    std::string method;
    std::string canonical_uri = "/";
    Params query;
    Params headers;            // must include host, x-amz-date and x-amz-content-sha256 for S3
    std::string payload_hash;  // hex sha256 of the body, or "UNSIGNED-PAYLOAD"
};

struct Signature {
    std::string canonical_request;
    std::string string_to_sign;
    std::string signature;      // hex
    std::string authorization;  // the full Authorization header value
};

// amz_date: "20130524T000000Z"; region e.g. "us-east-1"; service "s3".
Signature sign(const Request& request, const Credentials& credentials, const std::string& region,
               const std::string& service, const std::string& amz_date);

// "YYYYMMDDTHHMMSSZ" in UTC.
std::string amz_date(std::chrono::system_clock::time_point t);

std::string sha256_hex(std::string_view data);
std::string hmac_sha256(std::string_view key, std::string_view data);  // raw 32 bytes
std::string to_hex(std::string_view bytes);
// RFC 3986 unreserved characters stay, everything else becomes %XX (upper case); '/' stays
// unless encode_slash.
std::string uri_encode(std::string_view in, bool encode_slash);
// The canonical query string: names and values encoded, sorted by name then value.
std::string canonical_query(const Params& query);

inline constexpr const char* kEmptySha256 =
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

}  // namespace dtune::io::sigv4
