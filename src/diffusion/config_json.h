// Typed reads of optional keys from a diffusers-style JSON config. A missing or null key gives the
// default (diffusers' from_config treats both as "use the class default"); a key of the wrong type
// is a UsageError naming the file, the key and the value.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace dtune::diffusion::detail {

inline bool has_value(const nlohmann::json& j, const std::string& key) {
    return j.is_object() && j.contains(key) && !j.at(key).is_null();
}

inline std::string type_error(const std::string& source, const std::string& key, const nlohmann::json& v,
                              const char* wanted) {
    return str(source, ": key \"", key, "\" is ", v.dump(), "; expected ", wanted, ". Fix the value in ",
               source);
}

inline double get_double(const nlohmann::json& j, const std::string& key, double fallback,
                         const std::string& source) {
    if (!has_value(j, key)) return fallback;
    const auto& v = j.at(key);
    // Python's json writes -inf as -Infinity, which nlohmann rejects while parsing; we also accept the
    // string spellings so a config written by json.dump(default=str) still loads.
    if (v.is_string()) {
        const auto s = v.get<std::string>();
        if (s == "-inf" || s == "-Infinity") return -std::numeric_limits<double>::infinity();
        if (s == "inf" || s == "Infinity") return std::numeric_limits<double>::infinity();
    }
    DTUNE_CHECK_AS(UsageError, v.is_number(), type_error(source, key, v, "a number"));
    return v.get<double>();
}

inline std::optional<double> get_optional_double(const nlohmann::json& j, const std::string& key,
                                                 const std::string& source) {
    if (!has_value(j, key)) return std::nullopt;
    return get_double(j, key, 0.0, source);
}

inline int64_t get_int(const nlohmann::json& j, const std::string& key, int64_t fallback,
                       const std::string& source) {
    if (!has_value(j, key)) return fallback;
    const auto& v = j.at(key);
    DTUNE_CHECK_AS(UsageError, v.is_number_integer(), type_error(source, key, v, "an integer"));
    return v.get<int64_t>();
}

inline bool get_bool(const nlohmann::json& j, const std::string& key, bool fallback,
                     const std::string& source) {
    if (!has_value(j, key)) return fallback;
    const auto& v = j.at(key);
    DTUNE_CHECK_AS(UsageError, v.is_boolean(), type_error(source, key, v, "true or false"));
    return v.get<bool>();
}

inline std::string get_string(const nlohmann::json& j, const std::string& key, const std::string& fallback,
                              const std::string& source) {
    if (!has_value(j, key)) return fallback;
    const auto& v = j.at(key);
    DTUNE_CHECK_AS(UsageError, v.is_string(), type_error(source, key, v, "a string"));
    return v.get<std::string>();
}

}  // namespace dtune::diffusion::detail
