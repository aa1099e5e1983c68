// Redaction of URLs, text and JSON: every planted secret disappears, the shape stays readable.
#include <gtest/gtest.h>

#include "core/log.h"
#include "core/redact.h"
#include "support/test_support.h"

#include <fstream>
#include <sstream>

namespace dtune {
namespace test_redact_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

bool has(const std::string& s, const std::string& part) {
    return s.find(part) != std::string::npos;
}

TEST(Redact, UrlLosesUserinfoQueryValuesAndFragmentButKeepsItsShape) {
    const std::string r = redact_url("https://alice:PW-1@hooks.example:8443/a/b?token=TOK-2&x=1&flag#FRAG-3");
    for (const char* secret : {"PW-1", "TOK-2", "FRAG-3", "alice"}) EXPECT_FALSE(has(r, secret)) << r;
    EXPECT_EQ(
        r, "https://<redacted>@hooks.example:8443/a/b?token=<redacted>&x=<redacted>&<redacted>#<redacted>");
    EXPECT_EQ(redact_url(r), r);  // idempotent
    EXPECT_EQ(redact_url("https://TOKEN-AS-USER@github.com/x.git"), "https://<redacted>@github.com/x.git");
    EXPECT_EQ(redact_url("http://h?k=v"), "http://h?k=<redacted>");
    EXPECT_EQ(redact_url("/plain/path?x=1"), "/plain/path?x=1");  // not a URL: unchanged
    // An unencoded '@' inside the password: everything before the last '@' is userinfo.
    EXPECT_FALSE(has(redact_url("https://u:p@ss-WORD@h/"), "ss-WORD"));
}

TEST(Redact, HostOnlyFormHidesPathsAndCredentials) {
    EXPECT_EQ(redact_url_to_host("https://discord.com/api/webhooks/123/SECRET"), "https://discord.com/…");
    EXPECT_EQ(redact_url_to_host("https://u:PW@h.example?token=T"), "https://h.example/…");
    EXPECT_EQ(redact_url_to_host("http://h:1"), "http://h:1");
    EXPECT_EQ(redact_url_to_host("garbage"), "<url>");
}

TEST(Redact, TextRedactsEveryUrlInside) {
    const std::string t = redact_text(
        "could not post to 'https://u:PW-9@a.example/h?token=T-8' nor \"http://b.example?sig=S-7\" (done)");
    for (const char* secret : {"PW-9", "T-8", "S-7"}) EXPECT_FALSE(has(t, secret)) << t;
    EXPECT_TRUE(has(t, "a.example/h")) << t;
    EXPECT_TRUE(has(t, "could not post to '")) << t;
    EXPECT_TRUE(has(t, "(done)")) << t;
    EXPECT_EQ(redact_text("no urls here: s3 bucket x"), "no urls here: s3 bucket x");
    EXPECT_EQ(redact_text(t), t);
}

TEST(Redact, SecretKeyNames) {
    for (const char* k : {"auth_token", "aws_access_key_id", "aws_secret_access_key", "aws_session_token",
                          "hub_token", "API_KEY", "db-password", "client_secret"})
        EXPECT_TRUE(is_secret_key(k)) << k;
    for (const char* k :
         {"tokenizer_max_length", "webhook_url", "aws_bucket_name", "keyframe", "learning_rate"})
        EXPECT_FALSE(is_secret_key(k)) << k;
}

TEST(Redact, JsonRedactsKeysWebhookUrlsAndInlineJsonText) {
    const nlohmann::json hooks = nlohmann::json::array(
        {{{"webhook_type", "raw"},
          {"callback_url", "https://u:PW-A@orch.example/hook?token=TOK-B"},
          {"auth_token", "AUTH-C"}},
         {{"webhook_type", "discord"}, {"webhook_url", "https://discord.com/api/webhooks/1/PATH-D"}}});
    const nlohmann::json config = {{"webhook_config", hooks.dump()},  // inline JSON given as text
                                   {"nested", {{"webhook_config", hooks}}},
                                   {"aws_secret_access_key", "AWS-E"},
                                   {"aws_session_token", ""},
                                   {"pretrained_model_name_or_path", "https://x:PW-F@models.example/m"},
                                   {"learning_rate", 1e-4},
                                   {"output_dir", "/tmp/out"}};
    const std::string dumped = redact_json(config).dump();
    for (const char* secret : {"PW-A", "TOK-B", "AUTH-C", "PATH-D", "AWS-E", "PW-F"})
        EXPECT_FALSE(has(dumped, secret)) << secret << " in " << dumped;
    const nlohmann::json r = redact_json(config);
    EXPECT_EQ(r["learning_rate"], 1e-4);
    EXPECT_EQ(r["output_dir"], "/tmp/out");
    EXPECT_EQ(r["aws_session_token"], "");  // unset stays visibly unset
    EXPECT_EQ(r["nested"]["webhook_config"][0]["callback_url"], "https://orch.example/…");
    EXPECT_EQ(r["nested"]["webhook_config"][0]["webhook_type"], "raw");
    EXPECT_TRUE(nlohmann::json::parse(r["webhook_config"].get<std::string>()).is_array());
    EXPECT_EQ(redact_json(r), r);
}

TEST(Redact, LogLinesNeverCarryUrlCredentials) {
    test::TempDir dir;
    log::set_file(dir / "log.txt");
    log::info() << "posting to https://u:LOGPW-1@h.example/x?token=LOGTOK-2 now";
    log::set_file({});
    std::ifstream in(dir / "log.txt");
    std::stringstream text;
    text << in.rdbuf();
    EXPECT_TRUE(has(text.str(), "h.example/x")) << text.str();
    EXPECT_FALSE(has(text.str(), "LOGPW-1")) << text.str();
    EXPECT_FALSE(has(text.str(), "LOGTOK-2")) << text.str();
}

}  // namespace
}  // namespace test_redact_local
}  // namespace dtune
