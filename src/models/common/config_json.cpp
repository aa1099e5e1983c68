// Typed access to diffusers config.json files with errors that name the key at fault.
#include "models/common/config_json.h"

#include <fstream>

#include "core/error.h"

namespace dtune::models {

ConfigReader ConfigReader::from_file(const std::filesystem::path& path) {
    DTUNE_CHECK_AS(DataError, std::filesystem::is_regular_file(path), "model config '", path.string(),
                   "' does not exist; pass the component folder of a diffusers model (it holds config.json "
                   "and diffusion_pytorch_model.safetensors)");
    std::ifstream in(path);
    try {
        return ConfigReader(nlohmann::json::parse(in), path.string());
    } catch (const nlohmann::json::exception& e) {
        throw DataError(str("model config '", path.string(), "' is not valid JSON (", e.what(),
                            "); re-download or fix the file"));
    }
}

bool ConfigReader::has(const std::string& key) const {
    return json_.contains(key) && !json_.at(key).is_null();
}

const nlohmann::json& ConfigReader::at(const std::string& key) const {
    return json_.at(key);
}

void ConfigReader::wrong_type(const std::string& key, const char* expected) const {
    throw DataError(str(origin_, ": `", key, "` = ", json_.at(key).dump(), " should be ", expected,
                        "; fix the value in the config"));
}

int64_t ConfigReader::get_int(const std::string& key, int64_t fallback) const {
    if (!has(key)) return fallback;
    if (!at(key).is_number_integer()) wrong_type(key, "an integer");
    return at(key).get<int64_t>();
}

double ConfigReader::get_double(const std::string& key, double fallback) const {
    if (!has(key)) return fallback;
    if (!at(key).is_number()) wrong_type(key, "a number");
    return at(key).get<double>();
}

bool ConfigReader::get_bool(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!at(key).is_boolean()) wrong_type(key, "true or false");
    return at(key).get<bool>();
}

std::string ConfigReader::get_string(const std::string& key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    if (!at(key).is_string()) wrong_type(key, "a string");
    return at(key).get<std::string>();
}

int64_t ConfigReader::require_int(const std::string& key) const {
    DTUNE_CHECK_AS(DataError, has(key), origin_, ": required key `", key,
                   "` is missing; add it to the config");
    return get_int(key, 0);
}

std::vector<int64_t> ConfigReader::require_int_list(const std::string& key) const {
    DTUNE_CHECK_AS(DataError, has(key), origin_, ": required key `", key,
                   "` is missing; add it to the config");
    if (!at(key).is_array()) wrong_type(key, "a list of integers");
    std::vector<int64_t> out;
    for (const auto& v : at(key)) {
        if (!v.is_number_integer()) wrong_type(key, "a list of integers");
        out.push_back(v.get<int64_t>());
    }
    return out;
}

std::vector<std::string> ConfigReader::require_string_list(const std::string& key) const {
    DTUNE_CHECK_AS(DataError, has(key), origin_, ": required key `", key,
                   "` is missing; add it to the config");
    if (!at(key).is_array()) wrong_type(key, "a list of strings");
    std::vector<std::string> out;
    for (const auto& v : at(key)) {
        if (!v.is_string()) wrong_type(key, "a list of strings");
        out.push_back(v.get<std::string>());
    }
    return out;
}

std::vector<int64_t> ConfigReader::per_block_int(const std::string& key, std::size_t n,
                                                 int64_t fallback) const {
    if (!has(key)) return std::vector<int64_t>(n, fallback);
    if (at(key).is_number_integer()) return std::vector<int64_t>(n, at(key).get<int64_t>());
    if (!at(key).is_array() || at(key).size() != n)
        wrong_type(key, str("an integer or a list of ", n, " integers (one per block)").c_str());
    std::vector<int64_t> out;
    for (const auto& v : at(key)) {
        if (!v.is_number_integer())
            wrong_type(
                key,
                str("an integer or a list of ", n, " integers (nested lists are not supported)").c_str());
        out.push_back(v.get<int64_t>());
    }
    return out;
}

std::vector<bool> ConfigReader::per_block_bool(const std::string& key, std::size_t n, bool fallback) const {
    if (!has(key)) return std::vector<bool>(n, fallback);
    if (at(key).is_boolean()) return std::vector<bool>(n, at(key).get<bool>());
    if (!at(key).is_array() || at(key).size() != n)
        wrong_type(key, str("a bool or a list of ", n, " bools").c_str());
    std::vector<bool> out;
    for (const auto& v : at(key)) {
        if (!v.is_boolean()) wrong_type(key, str("a bool or a list of ", n, " bools").c_str());
        out.push_back(v.get<bool>());
    }
    return out;
}

void ConfigReader::unsupported(const std::string& key, const std::string& why) const {
    const std::string value = json_.contains(key) ? json_.at(key).dump() : "(absent)";
    throw UsageError(str(origin_, ": `", key, "` = ", value, " is not supported by dtune (", why, ")"));
}

void ConfigReader::expect_null(const std::string& key) const {
    if (has(key)) unsupported(key, "only null is implemented; use a model without this feature");
}

void ConfigReader::expect_value(const std::string& key, const nlohmann::json& allowed) const {
    if (has(key) && at(key) != allowed)
        unsupported(key, str("only ", allowed.dump(), " is implemented; use a model with that setting"));
}

}  // namespace dtune::models
