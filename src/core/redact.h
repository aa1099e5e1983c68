// Secrets out of everything dtune writes: logs, error messages, config.resolved.json, report.html.
//
// What counts as a secret: the userinfo of a URL (`https://user:password@host`, a token used as the
// user name), every query value of a URL (`?token=…`, presigned signatures), and the value of a key
// whose name says it holds one (auth_token, aws_access_key_id, aws_secret_access_key,
// aws_session_token, and any key containing "token", "secret", "password" or "api_key"). Webhook
// URLs (`webhook_url`, `callback_url`) are secrets as a whole (whoever has one can post), so only
// their scheme and host are kept.
//
// Invariants: redaction keeps the shape (keys, scheme, host, path) so a reader still sees what was
// configured; it is idempotent; it never throws.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace dtune {

// What a secret is replaced with.
inline constexpr const char* kRedacted = "<redacted>";

// "https://user:pw@host:1/p?token=abc&x=1#f" -> "https://<redacted>@host:1/p?token=<redacted>&x=<redacted>".
// Text without "://" is returned unchanged.
std::string redact_url(std::string_view url);
// Scheme and host only: "https://discord.com/api/webhooks/1/abc" -> "https://discord.com/…"
// ("<url>" when `url` has no scheme). For URLs that are secrets as a whole.
std::string redact_url_to_host(std::string_view url);
// Every URL inside free text (log lines, error messages) passed through redact_url.
std::string redact_text(std::string_view text);
// True for key names that hold a secret value (case-insensitive; see the header comment).
bool is_secret_key(std::string_view key);
// A copy of `value` with every secret replaced: secret keys' values, URL keys of webhooks, URLs in
// any string, and strings that are themselves inline JSON (webhook_config given as text).
nlohmann::json redact_json(const nlohmann::json& value);

}  // namespace dtune
