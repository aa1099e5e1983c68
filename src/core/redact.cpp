// Redaction of URLs, free text and JSON (see redact.h).
#include "core/redact.h"

#include <algorithm>
#include <cctype>
#include <vector>

namespace dtune {
namespace {

struct UrlParts {
    std::string_view scheme, userinfo, host, path, query, fragment;
    bool has_userinfo = false, has_query = false, has_fragment = false;
};

// Splits "scheme://[userinfo@]host[path][?query][#fragment]"; false without "://".
bool split_url(std::string_view url, UrlParts& p) {
    const auto sep = url.find("://");
    if (sep == std::string_view::npos) return false;
    p.scheme = url.substr(0, sep);
    std::string_view rest = url.substr(sep + 3);
    const auto authority_end = std::min(rest.find_first_of("/?#"), rest.size());
    std::string_view authority = rest.substr(0, authority_end);
    rest.remove_prefix(authority_end);
    // The last '@' ends the userinfo: an unencoded '@' inside a password stays hidden.
    if (const auto at = authority.rfind('@'); at != std::string_view::npos) {
        p.has_userinfo = true;
        p.userinfo = authority.substr(0, at);
        authority.remove_prefix(at + 1);
    }
    p.host = authority;
    if (const auto hash = rest.find('#'); hash != std::string_view::npos) {
        p.has_fragment = true;
        p.fragment = rest.substr(hash + 1);
        rest = rest.substr(0, hash);
    }
    if (const auto q = rest.find('?'); q != std::string_view::npos) {
        p.has_query = true;
        p.query = rest.substr(q + 1);
        rest = rest.substr(0, q);
    }
    p.path = rest;
    return true;
}

// "a=1&b&c=" -> "a=<redacted>&<redacted>&c=": names stay, values (and bare items) go.
std::string redact_query(std::string_view query) {
    std::string out;
    std::size_t start = 0;
    while (start <= query.size()) {
        auto end = query.find('&', start);
        if (end == std::string_view::npos) end = query.size();
        const std::string_view item = query.substr(start, end - start);
        if (start > 0) out += '&';
        const auto eq = item.find('=');
        if (eq == std::string_view::npos)
            out += item.empty() ? "" : kRedacted;
        else
            out += std::string(item.substr(0, eq + 1)) + (eq + 1 < item.size() ? kRedacted : "");
        start = end + 1;
    }
    return out;
}

bool url_char(char c) {
    return !(std::isspace(static_cast<unsigned char>(c)) || c == '"' || c == '\'' || c == '`' || c == '<' ||
             c == '>');
}

bool scheme_char(char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '-' || c == '.';
}

std::vector<std::string> words_of(std::string_view key) {
    std::vector<std::string> words(1);
    for (char c : key) {
        if (std::isalnum(static_cast<unsigned char>(c)))
            words.back() += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        else if (!words.back().empty())
            words.emplace_back();
    }
    if (words.back().empty()) words.pop_back();
    return words;
}

bool is_webhook_url_key(const std::string& key) {
    return key == "webhook_url" || key == "callback_url";
}

}  // namespace

std::string redact_url(std::string_view url) {
    UrlParts p;
    if (!split_url(url, p)) return std::string(url);
    std::string out = std::string(p.scheme) + "://";
    if (p.has_userinfo) out += std::string(kRedacted) + "@";
    out += p.host;
    out += p.path;
    if (p.has_query) out += "?" + redact_query(p.query);
    if (p.has_fragment) out += p.fragment.empty() ? "#" : std::string("#") + kRedacted;
    return out;
}

std::string redact_url_to_host(std::string_view url) {
    UrlParts p;
    if (!split_url(url, p) || p.host.empty()) return "<url>";
    std::string out = std::string(p.scheme) + "://" + std::string(p.host);
    if (!p.path.empty() || p.has_query || p.has_fragment) out += "/…";
    return out;
}

std::string redact_text(std::string_view text) {
    std::string out;
    std::size_t copied = 0;
    for (auto sep = text.find("://"); sep != std::string_view::npos; sep = text.find("://", sep + 3)) {
        std::size_t begin = sep;
        while (begin > copied && scheme_char(text[begin - 1])) --begin;
        if (begin == sep) continue;  // "://" without a scheme
        std::size_t end = sep + 3;
        while (end < text.size() && url_char(text[end])) ++end;
        out.append(text.substr(copied, begin - copied));
        out += redact_url(text.substr(begin, end - begin));
        copied = end;
        sep = end - 3;
    }
    out.append(text.substr(copied));
    return out;
}

bool is_secret_key(std::string_view key) {
    const auto words = words_of(key);
    for (std::size_t i = 0; i < words.size(); ++i) {
        const std::string& w = words[i];
        if (w == "token" || w == "secret" || w == "password" || w == "passwd" || w == "apikey" ||
            w == "credentials")
            return true;
        if (i + 1 < words.size() && words[i + 1] == "key" && (w == "api" || w == "access" || w == "private"))
            return true;
    }
    return false;
}

nlohmann::json redact_json(const nlohmann::json& value) {
    if (value.is_array()) {
        nlohmann::json out = nlohmann::json::array();
        for (const auto& v : value) out.push_back(redact_json(v));
        return out;
    }
    if (value.is_object()) {
        nlohmann::json out = nlohmann::json::object();
        for (auto it = value.begin(); it != value.end(); ++it) {
            const auto& v = it.value();
            const bool empty = v.is_null() || (v.is_string() && v.get_ref<const std::string&>().empty());
            if (is_secret_key(it.key()) && !empty && !v.is_boolean())
                out[it.key()] = kRedacted;
            else if (is_webhook_url_key(it.key()) && v.is_string())
                out[it.key()] = redact_url_to_host(v.get_ref<const std::string&>());
            else
                out[it.key()] = redact_json(v);
        }
        return out;
    }
    if (!value.is_string()) return value;
    const std::string& s = value.get_ref<const std::string&>();
    const auto first = s.find_first_not_of(" \t\r\n");
    if (first != std::string::npos && (s[first] == '{' || s[first] == '[')) {
        // Inline JSON given as text (webhook_config on the command line): redact its structure.
        const auto inner = nlohmann::json::parse(s, nullptr, false);
        if (!inner.is_discarded()) {
            const nlohmann::json redacted = redact_json(inner);
            return redacted == inner ? s : redacted.dump();  // untouched text keeps its spelling
        }
    }
    return redact_text(s);
}

}  // namespace dtune
