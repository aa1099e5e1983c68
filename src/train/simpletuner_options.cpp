// SimpleTuner's option table and the comparison with its defaults (see simpletuner_options.h).
#include "train/simpletuner_options.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <set>
#include <sstream>

#include "core/error.h"
#include "train/config.h"

namespace dtune::train {
namespace {

using nlohmann::json;

std::string lowered(std::string s) {
    for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return s;
}

std::string trimmed(const std::string& s) {
    const auto b = s.find_first_not_of(" \t\r\n");
    if (b == std::string::npos) return "";
    return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

// SimpleTuner's boolean words (its _parse_bool_flag); nullopt when the value is not one.
std::optional<bool> as_bool(const json& v) {
    if (v.is_boolean()) return v.get<bool>();
    if (v.is_number_integer() && (v == 0 || v == 1)) return v == 1;
    if (!v.is_string()) return std::nullopt;
    const std::string t = lowered(trimmed(v.get<std::string>()));
    if (t == "1" || t == "true" || t == "yes" || t == "y" || t == "on") return true;
    if (t == "0" || t == "false" || t == "no" || t == "n" || t == "off") return false;
    return std::nullopt;
}

std::optional<double> as_number(const json& v) {
    if (v.is_number()) return v.get<double>();
    if (!v.is_string()) return std::nullopt;
    const std::string t = trimmed(v.get<std::string>());
    if (t.empty()) return std::nullopt;
    char* end = nullptr;
    const double d = std::strtod(t.c_str(), &end);
    if (end != t.c_str() + t.size()) return std::nullopt;
    return d;
}

// The text a config.json value becomes on SimpleTuner's command line (Python's str()).
std::optional<std::string> as_text(const json& v) {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_boolean()) return std::string(v.get<bool>() ? "True" : "False");
    if (v.is_number_integer()) return v.dump();
    if (v.is_number_float()) {
        const double d = v.get<double>();
        if (std::floor(d) == d && std::fabs(d) < 1e15) return str(static_cast<int64_t>(d), ".0");
        return v.dump();
    }
    return std::nullopt;
}

bool is_none(const json& v) {
    return v.is_null() || (v.is_string() && (v == "None" || v == "none" || v == "null"));
}

}  // namespace

const std::vector<SimpleTunerOption>& simpletuner_options() {
    // clang-format off
    static const std::vector<SimpleTunerOption> kOptions = {
#include "train/simpletuner_options.inc"
    };
    // clang-format on
    return kOptions;
}

const SimpleTunerOption* find_simpletuner_option(const std::string& key) {
    static const std::map<std::string, const SimpleTunerOption*> kIndex = [] {
        std::map<std::string, const SimpleTunerOption*> index;
        for (const auto& o : simpletuner_options()) {
            index.emplace(o.name, &o);
            std::stringstream spellings(o.spellings);
            for (std::string s; std::getline(spellings, s, ',');)
                if (!s.empty()) index.emplace(s, &o);
        }
        return index;
    }();
    const auto it = kIndex.find(key);
    return it == kIndex.end() ? nullptr : it->second;
}

bool is_simpletuner_default(const SimpleTunerOption& option, const json& value) {
    if (is_none(value)) return true;  // SimpleTuner drops None-valued keys: the default applies
    const json d = json::parse(option.default_json);
    if (value.is_array() || value.is_object()) return value == d;
    switch (option.type) {
        case 'b': {
            const auto b = as_bool(value);
            return b && d.is_boolean() && *b == d.get<bool>();
        }
        case 'i':
        case 'f': {
            const auto n = as_number(value);
            return n && d.is_number() && *n == d.get<double>();
        }
        default: {
            const auto t = as_text(value);
            if (!t) return false;
            if (d.is_null()) return t->empty();
            if (d.is_string()) {
                if (*t == d.get<std::string>()) return true;
                // Numbers written as numbers for a string-typed option ("aspect_bucket_alignment": 64).
                const auto a = as_number(json(*t)), b = as_number(d);
                return a && b && *a == *b;
            }
            return false;
        }
    }
}

std::string options_markdown() {
    std::set<std::string> implemented;
    for (const auto& s : option_specs()) implemented.insert(s.name);
    std::size_t done = 0;
    std::string rows;
    for (const auto& o : simpletuner_options()) {
        const bool is_done = implemented.count(o.name) > 0;
        done += is_done;
        const char* status = is_done ? "implemented"
                             : option_only_labels(o.name)
                                 ? "any value accepted; it only names things dtune does not do"
                                 : "accepted at its default only";
        std::string spellings = o.spellings;
        std::replace(spellings.begin(), spellings.end(), ',', ' ');
        rows += str("| `", o.name, "` | ", spellings.empty() ? "" : "`" + spellings + "`", " | `",
                    o.default_json, "` | ", status, " |\n");
    }
    std::string own;
    for (const auto& s : option_specs())
        if (!find_simpletuner_option(s.name))
            own += str("| `", s.name, "` | `", s.default_json, "` | ", s.help, " |\n");
    return str(
        "# SimpleTuner's options in dtune\n\n"
        "Generated: `dtune train --list-options` prints this page, and a test fails when it is out of\n"
        "date. The option table comes from SimpleTuner's own argument parser through\n"
        "`tools/ref/simpletuner_options.py` (`src/train/simpletuner_options.inc`).\n\n"
        "- **implemented**: the option means in dtune what it means in SimpleTuner.\n"
        "- **accepted at its default only**: a config may set it to SimpleTuner's default (or `null`); any\n"
        "  other value stops `dtune train` with exit code 2, saying that dtune does not implement it.\n"
        "- **any value accepted**: the option only names things dtune does not do (a hub repository, a\n"
        "  tracker run); it is read and has no effect.\n"
        "- A key that is in none of these is unknown: exit code 2, naming the closest known key.\n\n",
        "SimpleTuner's parser knows ", simpletuner_options().size(), " options; dtune implements ", done,
        " of them.\n\n| option | other spellings | SimpleTuner's default | in dtune |\n|---|---|---|---|\n",
        rows, "\n## dtune's own options\n\n| option | default | meaning |\n|---|---|---|\n", own);
}

}  // namespace dtune::train
