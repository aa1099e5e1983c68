// S3 configuration: where region, endpoint and credentials come from (explicit values, the
// standard AWS environment variables, the shared credentials file), and how a bucket + key map to
// a URL (path-style or virtual-hosted). Never puts a key value into a message.
#include "core/error.h"
#include "io/s3.h"

#include <cstdlib>
#include <fstream>

namespace dtune::io {
namespace {

std::string env(const char* name) {
    const char* v = std::getenv(name);
    return v ? std::string(v) : std::string();
}

std::string trim(const std::string& s) {
    const auto b = s.find_first_not_of(" \t\r");
    if (b == std::string::npos) return {};
    return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

std::string credentials_file_path() {
    std::string path = env("AWS_SHARED_CREDENTIALS_FILE");
    if (!path.empty()) return path;
    const std::string home = env("HOME");
    return home.empty() ? std::string() : home + "/.aws/credentials";
}

// Reads one [profile] of an INI credentials file; empty credentials when file or profile is absent.
sigv4::Credentials read_profile(const std::string& path, const std::string& profile) {
    sigv4::Credentials c;
    std::ifstream in(path);
    if (!in) return c;
    std::string line, section;
    while (std::getline(in, line)) {
        line = trim(line);
        if (line.empty() || line[0] == '#' || line[0] == ';') continue;
        if (line.front() == '[' && line.back() == ']') {
            section = trim(line.substr(1, line.size() - 2));
            continue;
        }
        if (section != profile) continue;
        const auto eq = line.find('=');
        if (eq == std::string::npos) continue;
        const std::string k = trim(line.substr(0, eq)), v = trim(line.substr(eq + 1));
        if (k == "aws_access_key_id") c.access_key_id = v;
        if (k == "aws_secret_access_key") c.secret_access_key = v;
        if (k == "aws_session_token") c.session_token = v;
    }
    return c;
}

sigv4::Credentials resolve_credentials(const S3Config& config) {
    const auto& given = config.credentials;
    if (!given.access_key_id.empty() || !given.secret_access_key.empty()) {
        DTUNE_CHECK_AS(UsageError, !given.empty(), "S3 bucket '", config.bucket,
                       "': only one of aws_access_key_id / aws_secret_access_key is set; set both (or "
                       "neither, to use AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or ~/.aws/credentials)");
        return given;
    }
    sigv4::Credentials from_env{env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY"),
                                env("AWS_SESSION_TOKEN")};
    if (!from_env.empty()) return from_env;
    std::string profile = config.profile.empty() ? env("AWS_PROFILE") : config.profile;
    if (profile.empty()) profile = "default";
    const std::string path = credentials_file_path();
    sigv4::Credentials from_file = path.empty() ? sigv4::Credentials{} : read_profile(path, profile);
    DTUNE_CHECK_AS(UsageError, !from_file.empty(), "S3 bucket '", config.bucket,
                   "': no credentials found; set aws_access_key_id and aws_secret_access_key in the dataset "
                   "entry, or the AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY environment variables, or a [",
                   profile, "] section in ", path.empty() ? "~/.aws/credentials" : path);
    return from_file;
}

struct Endpoint {
    std::string scheme, host, base_path;  // host includes ":port" when given
};

Endpoint parse_endpoint(const std::string& url) {
    Endpoint e;
    const auto sep = url.find("://");
    DTUNE_CHECK_AS(UsageError, sep != std::string::npos, "aws_endpoint_url '", url,
                   "' has no scheme; write it as https://host[:port] (or http:// for a local server)");
    e.scheme = url.substr(0, sep);
    DTUNE_CHECK_AS(UsageError, e.scheme == "http" || e.scheme == "https", "aws_endpoint_url '", url,
                   "': scheme must be http or https");
    const auto slash = url.find('/', sep + 3);
    e.host = url.substr(sep + 3, slash == std::string::npos ? std::string::npos : slash - sep - 3);
    DTUNE_CHECK_AS(UsageError, !e.host.empty(), "aws_endpoint_url '", url, "' has no host");
    if (slash != std::string::npos) {
        e.base_path = url.substr(slash);
        while (!e.base_path.empty() && e.base_path.back() == '/') e.base_path.pop_back();
    }
    return e;
}

bool dns_compatible(const std::string& bucket) {
    if (bucket.size() < 3 || bucket.size() > 63) return false;
    for (char c : bucket)
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
    return true;
}

}  // namespace

S3Config resolve_s3_config(S3Config config) {
    DTUNE_CHECK_AS(UsageError, !config.bucket.empty(),
                   "S3: no bucket name; set aws_bucket_name in the dataset entry");
    if (config.region.empty()) config.region = env("AWS_REGION");
    if (config.region.empty()) config.region = env("AWS_DEFAULT_REGION");
    if (config.region.empty()) config.region = "us-east-1";
    if (config.endpoint.empty()) config.endpoint = env("AWS_ENDPOINT_URL");
    const bool aws = config.endpoint.empty();
    if (aws) config.endpoint = "https://s3." + config.region + ".amazonaws.com";
    while (!config.endpoint.empty() && config.endpoint.back() == '/') config.endpoint.pop_back();
    parse_endpoint(config.endpoint);  // validate early, with the key named
    if (config.addressing == S3Addressing::kAuto)
        config.addressing =
            aws && dns_compatible(config.bucket) ? S3Addressing::kVirtualHost : S3Addressing::kPath;
    DTUNE_CHECK_AS(UsageError, config.max_connections >= 1, "aws_max_pool_connections must be >= 1 (got ",
                   config.max_connections, ")");
    DTUNE_CHECK_AS(UsageError, config.multipart_part_size >= (5u << 20),
                   "S3 multipart part size must be at least 5 MiB (S3's minimum)");
    config.credentials = resolve_credentials(config);
    return config;
}

S3Target s3_target(const S3Config& config, const std::string& key) {
    const Endpoint e = parse_endpoint(config.endpoint);
    S3Target t;
    const std::string key_path = sigv4::uri_encode(key, false);
    if (config.addressing == S3Addressing::kVirtualHost) {
        t.host = config.bucket + "." + e.host;
        t.canonical_uri = e.base_path + "/" + key_path;
    } else {
        t.host = e.host;
        t.canonical_uri =
            e.base_path + "/" + sigv4::uri_encode(config.bucket, true) + (key.empty() ? "" : "/") + key_path;
    }
    t.url = e.scheme + "://" + t.host + t.canonical_uri;
    return t;
}

}  // namespace dtune::io
