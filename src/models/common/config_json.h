// Reading diffusers `config.json` files: typed getters whose errors name the file, the key, the
// value found and what is accepted. Per-block keys (`attention_head_dim`, `layers_per_block`, ...)
// may be a scalar or a list; `per_block` broadcasts a scalar and checks a list's length.
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

namespace dtune::models {

class ConfigReader {
  public:
    // `origin` names the source in errors (usually the config.json path).
    ConfigReader(nlohmann::json json, std::string origin)
        : json_(std::move(json)), origin_(std::move(origin)) {}
    // Parses a file; DataError naming the path when it is missing or not JSON.
    static ConfigReader from_file(const std::filesystem::path& path);

    const nlohmann::json& json() const { return json_; }
    const std::string& origin() const { return origin_; }
    // True when the key is present and not null.
    bool has(const std::string& key) const;

    int64_t get_int(const std::string& key, int64_t fallback) const;
    double get_double(const std::string& key, double fallback) const;
    bool get_bool(const std::string& key, bool fallback) const;
    std::string get_string(const std::string& key, const std::string& fallback) const;
    // A required key; DataError when absent.
    int64_t require_int(const std::string& key) const;
    std::vector<int64_t> require_int_list(const std::string& key) const;
    std::vector<std::string> require_string_list(const std::string& key) const;
    // A scalar repeated n times, or a list of exactly n; `fallback` when absent/null.
    std::vector<int64_t> per_block_int(const std::string& key, std::size_t n, int64_t fallback) const;
    std::vector<bool> per_block_bool(const std::string& key, std::size_t n, bool fallback) const;

    // UsageError "<origin>: `key` = <value> is not supported (<why>)".
    [[noreturn]] void unsupported(const std::string& key, const std::string& why) const;
    // Rejects a key that is set (not null/absent) unless it equals `allowed`.
    void expect_null(const std::string& key) const;
    void expect_value(const std::string& key, const nlohmann::json& allowed) const;

  private:
    const nlohmann::json& at(const std::string& key) const;
    [[noreturn]] void wrong_type(const std::string& key, const char* expected) const;

    nlohmann::json json_;
    std::string origin_;
};

}  // namespace dtune::models
