// SigV4 against AWS's published S3 examples (tests/io/sigv4_aws_examples.txt), the URI encoding
// rules, the addressing modes, XML extraction, and where credentials come from. No network.
#include "core/error.h"
#include "io/s3.h"
#include "io/s3_xml.h"
#include "io/sigv4.h"
#include "support/test_support.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

namespace dtune::io {
namespace test_sigv4_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

struct Example {
    std::string name;
    sigv4::Request request;
    std::string body, canonical_request_sha256, signature;
};

struct Examples {
    std::map<std::string, std::string> shared;
    std::vector<Example> examples;
};

Examples load_examples() {
    const std::filesystem::path path =
        std::filesystem::path(DTUNE_TEST_SOURCE_DIR) / "sigv4_aws_examples.txt";
    std::ifstream in(path);
    EXPECT_TRUE(in.good()) << "missing " << path;
    Examples out;
    Example* cur = nullptr;
    std::string line;
    while (std::getline(in, line)) {
        if (line.empty() || line[0] == '#') continue;
        const auto sp = line.find(' ');
        const std::string word = line.substr(0, sp),
                          rest = sp == std::string::npos ? "" : line.substr(sp + 1);
        if (word == "example") {
            out.examples.push_back({rest, {}, {}, {}, {}});
            cur = &out.examples.back();
        } else if (!cur) {
            out.shared[word] = rest;
        } else if (word == "method") {
            cur->request.method = rest;
        } else if (word == "uri") {
            cur->request.canonical_uri = rest;
        } else if (word == "query" || word == "header") {
            const auto sp2 = rest.find(' ');
            auto& list = word == "query" ? cur->request.query : cur->request.headers;
            list.emplace_back(rest.substr(0, sp2), sp2 == std::string::npos ? "" : rest.substr(sp2 + 1));
        } else if (word == "body") {
            cur->body = rest;
        } else if (word == "payload_hash") {
            cur->request.payload_hash = rest;
        } else if (word == "canonical_request_sha256") {
            cur->canonical_request_sha256 = rest;
        } else if (word == "signature") {
            cur->signature = rest;
        } else if (word == "end") {
            cur = nullptr;
        }
    }
    return out;
}

TEST(SigV4, AwsPublishedExamples) {
    const Examples ex = load_examples();
    ASSERT_EQ(ex.examples.size(), 4u);
    const sigv4::Credentials creds{ex.shared.at("access_key_id"), ex.shared.at("secret_access_key"), ""};
    for (const Example& e : ex.examples) {
        SCOPED_TRACE(e.name);
        if (!e.body.empty()) {
            EXPECT_EQ(sigv4::sha256_hex(e.body), e.request.payload_hash);
        }
        const auto s = sigv4::sign(e.request, creds, ex.shared.at("region"), "s3", ex.shared.at("amz_date"));
        EXPECT_EQ(s.signature, e.signature);
        if (!e.canonical_request_sha256.empty()) {
            EXPECT_EQ(sigv4::sha256_hex(s.canonical_request), e.canonical_request_sha256);
        }
        EXPECT_EQ(
            s.authorization.rfind("AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/"
                                  "aws4_request,SignedHeaders=",
                                  0),
            0u);
        // The secret itself never appears in anything sign() returns.
        EXPECT_EQ(s.canonical_request.find(creds.secret_access_key), std::string::npos);
        EXPECT_EQ(s.authorization.find(creds.secret_access_key), std::string::npos);
    }
}

TEST(SigV4, SessionTokenChangesSignature) {
    sigv4::Request r;
    r.method = "GET";
    r.canonical_uri = "/b/k";
    r.payload_hash = sigv4::kEmptySha256;
    r.headers = {{"host", "h"}, {"x-amz-date", "20130524T000000Z"}};
    const sigv4::Credentials c{"AK", "SK", ""};
    const auto plain = sigv4::sign(r, c, "us-east-1", "s3", "20130524T000000Z");
    r.headers.emplace_back("x-amz-security-token", "TOKEN");
    const auto with_token = sigv4::sign(r, c, "us-east-1", "s3", "20130524T000000Z");
    EXPECT_NE(plain.signature, with_token.signature);
    EXPECT_NE(with_token.authorization.find("x-amz-security-token"), std::string::npos);
}

TEST(SigV4, UriEncodingAndQuery) {
    EXPECT_EQ(sigv4::uri_encode("a b+c/d~e_f.g-h", false), "a%20b%2Bc/d~e_f.g-h");
    EXPECT_EQ(sigv4::uri_encode("a/b", true), "a%2Fb");
    EXPECT_EQ(sigv4::uri_encode("\xc3\xa9", true), "%C3%A9");  // é as UTF-8
    EXPECT_EQ(sigv4::uri_encode("$!*'()", true), "%24%21%2A%27%28%29");
    EXPECT_EQ(
        sigv4::canonical_query({{"prefix", "a b/c"}, {"list-type", "2"}, {"continuation-token", "x=="}}),
        "continuation-token=x%3D%3D&list-type=2&prefix=a%20b%2Fc");
    EXPECT_EQ(sigv4::canonical_query({{"uploads", ""}}), "uploads=");
}

TEST(SigV4, AmzDate) {
    // 1369353600 s since the epoch is 2013-05-24T00:00:00Z.
    EXPECT_EQ(sigv4::amz_date(std::chrono::system_clock::from_time_t(1369353600)), "20130524T000000Z");
}

S3Config base_config() {
    S3Config c;
    c.bucket = "my-bucket";
    c.credentials = {"AK", "SK", ""};
    return c;
}

TEST(S3Addressing, PathVirtualHostAndAwsDefault) {
    S3Config c = base_config();
    c.endpoint = "http://127.0.0.1:9000/";
    c = resolve_s3_config(c);
    auto t = s3_target(c, "dir/a b.jpg");
    EXPECT_EQ(t.url, "http://127.0.0.1:9000/my-bucket/dir/a%20b.jpg");
    EXPECT_EQ(t.host, "127.0.0.1:9000");
    EXPECT_EQ(t.canonical_uri, "/my-bucket/dir/a%20b.jpg");
    EXPECT_EQ(s3_target(c, "").canonical_uri, "/my-bucket");

    c.addressing = S3Addressing::kVirtualHost;
    t = s3_target(c, "k");
    EXPECT_EQ(t.url, "http://my-bucket.127.0.0.1:9000/k");
    EXPECT_EQ(t.host, "my-bucket.127.0.0.1:9000");

    S3Config aws = base_config();
    aws.region = "eu-west-1";
    ::unsetenv("AWS_ENDPOINT_URL");
    aws = resolve_s3_config(aws);
    EXPECT_EQ(aws.addressing, S3Addressing::kVirtualHost);
    EXPECT_EQ(s3_target(aws, "x/y").url, "https://my-bucket.s3.eu-west-1.amazonaws.com/x/y");
}

class EnvGuard {
  public:
    explicit EnvGuard(std::vector<std::string> names) : names_(std::move(names)) {
        for (const auto& n : names_) {
            const char* v = std::getenv(n.c_str());
            saved_.emplace_back(v ? std::optional<std::string>(v) : std::nullopt);
            ::unsetenv(n.c_str());
        }
    }
    ~EnvGuard() {
        for (std::size_t i = 0; i < names_.size(); ++i)
            saved_[i] ? (void)::setenv(names_[i].c_str(), saved_[i]->c_str(), 1)
                      : (void)::unsetenv(names_[i].c_str());
    }

  private:
    std::vector<std::string> names_;
    std::vector<std::optional<std::string>> saved_;
};

const std::vector<std::string> kAwsEnv = {
    "AWS_ACCESS_KEY_ID",  "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
    "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL",      "AWS_PROFILE",       "AWS_SHARED_CREDENTIALS_FILE"};

TEST(S3Credentials, ExplicitThenEnvThenProfile) {
    EnvGuard guard(kAwsEnv);
    test::TempDir dir;
    test::write_bytes(dir / "credentials",
                      "[default]\naws_access_key_id = FILEKEY\naws_secret_access_key = FILESECRET\n\n"
                      "[other]\naws_access_key_id=OTHERKEY\naws_secret_access_key=OTHERSECRET\n"
                      "aws_session_token=OTHERTOKEN\n");
    ::setenv("AWS_SHARED_CREDENTIALS_FILE", (dir / "credentials").c_str(), 1);
    S3Config c;
    c.bucket = "b-b-b";
    auto r = resolve_s3_config(c);
    EXPECT_EQ(r.credentials.access_key_id, "FILEKEY");
    EXPECT_EQ(r.credentials.secret_access_key, "FILESECRET");
    EXPECT_EQ(r.region, "us-east-1");

    ::setenv("AWS_PROFILE", "other", 1);
    r = resolve_s3_config(c);
    EXPECT_EQ(r.credentials.session_token, "OTHERTOKEN");

    ::setenv("AWS_ACCESS_KEY_ID", "ENVKEY", 1);
    ::setenv("AWS_SECRET_ACCESS_KEY", "ENVSECRET", 1);
    ::setenv("AWS_SESSION_TOKEN", "ENVTOKEN", 1);
    ::setenv("AWS_DEFAULT_REGION", "ap-south-1", 1);
    ::setenv("AWS_ENDPOINT_URL", "https://acct.r2.cloudflarestorage.com", 1);
    r = resolve_s3_config(c);
    EXPECT_EQ(r.credentials.access_key_id, "ENVKEY");
    EXPECT_EQ(r.credentials.session_token, "ENVTOKEN");
    EXPECT_EQ(r.region, "ap-south-1");
    EXPECT_EQ(r.endpoint, "https://acct.r2.cloudflarestorage.com");
    EXPECT_EQ(r.addressing, S3Addressing::kPath);

    c.credentials = {"EXPLICITKEY", "EXPLICITSECRET", ""};
    c.region = "us-west-2";
    r = resolve_s3_config(c);
    EXPECT_EQ(r.credentials.access_key_id, "EXPLICITKEY");
    EXPECT_EQ(r.credentials.session_token, "");
    EXPECT_EQ(r.region, "us-west-2");
}

TEST(S3Credentials, MissingOrHalfGivenIsAUsageErrorWithoutTheValue) {
    EnvGuard guard(kAwsEnv);
    ::setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials", 1);
    S3Config c;
    c.bucket = "b-b-b";
    try {
        resolve_s3_config(c);
        FAIL() << "expected UsageError";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("AWS_ACCESS_KEY_ID"), std::string::npos) << e.what();
    }
    c.credentials.secret_access_key = "HALF-GIVEN-SECRET-123";
    try {
        resolve_s3_config(c);
        FAIL() << "expected UsageError";
    } catch (const UsageError& e) {
        EXPECT_EQ(std::string(e.what()).find("HALF-GIVEN-SECRET-123"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("aws_access_key_id"), std::string::npos) << e.what();
    }
}

TEST(S3Xml, ExtractsAndDecodes) {
    const std::string xml =
        "<ListBucketResult><KeyCount>2</KeyCount><Contents><Key>a&amp;b "
        "&#233;.jpg</Key><Size>3</Size></Contents>"
        "<Contents><Key>c&lt;d</Key><Size>10</Size></Contents><IsTruncated>false</IsTruncated></"
        "ListBucketResult>";
    const auto items = s3xml::all(xml, "Contents");
    ASSERT_EQ(items.size(), 2u);
    EXPECT_EQ(s3xml::first(items[0], "Key"), "a&b \xc3\xa9.jpg");
    EXPECT_EQ(s3xml::first(items[1], "Key"), "c<d");
    EXPECT_EQ(s3xml::first(xml, "Key"), "a&b \xc3\xa9.jpg");  // <KeyCount> is not <Key>
    EXPECT_EQ(s3xml::first(xml, "IsTruncated"), "false");
    EXPECT_EQ(s3xml::first(xml, "Missing"), "");
    EXPECT_EQ(s3xml::escape("\"a\"&<b>"), "&quot;a&quot;&amp;&lt;b&gt;");
}

}  // namespace
}  // namespace test_sigv4_local
}  // namespace dtune::io
