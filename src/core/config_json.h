// Parsing a configuration file's JSON text. A syntax error is a configuration problem (exit 2), and
// the message points at the place to fix: "path:line:column". Header-only so torch-free layers
// (the training config, the dataset config) share it without another link dependency.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>

#include "core/error.h"

namespace dtune {

// 1-based line and column of the byte at 1-based `position` in `text` (nlohmann's parse_error::byte,
// the last byte read when the error was found).
inline std::pair<std::size_t, std::size_t> line_and_column(const std::string& text, std::size_t position) {
    const std::size_t end = std::min(position == 0 ? 0 : position - 1, text.size());
    std::size_t line = 1, column = 1;
    for (std::size_t i = 0; i < end; ++i) {
        if (text[i] == '\n') {
            ++line;
            column = 1;
        } else {
            ++column;
        }
    }
    return {line, column};
}

// `text` is the contents of `path`; UsageError "path:line:column: not valid JSON (...)" otherwise.
inline nlohmann::json parse_config_json(const std::string& text, const std::string& path) {
    try {
        return nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
        const auto [line, column] = line_and_column(text, e.byte);
        std::string reason = e.what();
        // nlohmann's text: "[json.exception.parse_error.101] parse error at line 3, column 1: syntax
        // error while parsing ..."; keep what follows the position, which we print our own way.
        if (const auto colon = reason.find(": "); colon != std::string::npos)
            reason = reason.substr(colon + 2);
        throw UsageError(str(path, ":", line, ":", column, ": not valid JSON (", reason,
                             "); fix the syntax there (a trailing comma, a comment or a missing quote is "
                             "the usual cause)"));
    }
}

}  // namespace dtune
