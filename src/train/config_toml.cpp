// config.toml -> JSON (see config_toml.h). toml++ is used header-only in this one file, so nothing
// else pays for its compile time and the binary needs no TOML shared library at run time.
#define TOML_HEADER_ONLY 1
#define TOML_EXCEPTIONS 1
#include "train/config_toml.h"

#include <toml++/toml.h>
#include <sstream>

#include "core/error.h"

namespace dtune::train {
namespace {

nlohmann::json to_json(const toml::node& node) {
    if (const auto* t = node.as_table()) {
        nlohmann::json out = nlohmann::json::object();
        for (const auto& [key, value] : *t) out[std::string(key.str())] = to_json(value);
        return out;
    }
    if (const auto* a = node.as_array()) {
        nlohmann::json out = nlohmann::json::array();
        for (const auto& value : *a) out.push_back(to_json(value));
        return out;
    }
    if (const auto* s = node.as_string()) return s->get();
    if (const auto* i = node.as_integer()) return i->get();
    if (const auto* f = node.as_floating_point()) return f->get();
    if (const auto* b = node.as_boolean()) return b->get();
    std::ostringstream text;  // dates and times: their TOML spelling
    node.visit([&](const auto& v) { text << v; });
    return text.str();
}

}  // namespace

nlohmann::json read_toml_config(const std::filesystem::path& file) {
    try {
        const toml::table table = toml::parse_file(file.string());
        return to_json(table);
    } catch (const toml::parse_error& e) {
        const auto& where = e.source().begin;
        throw UsageError(str(file.string(), ":", where.line, ":", where.column, ": not valid TOML (",
                             e.description(), "); fix that line, or use config.json with the same keys"));
    }
}

}  // namespace dtune::train
