// JSON-lines parsing with nlohmann::ordered_json, one line at a time.
#include "io/jsonl_table.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "core/error.h"

namespace dtune::io {

namespace {

Cell to_cell(const nlohmann::ordered_json& v) {
    switch (v.type()) {
        case nlohmann::ordered_json::value_t::null: return std::nullopt;
        case nlohmann::ordered_json::value_t::boolean: return Value(v.get<bool>());
        case nlohmann::ordered_json::value_t::number_integer: return Value(v.get<std::int64_t>());
        case nlohmann::ordered_json::value_t::number_unsigned: {
            const auto u = v.get<std::uint64_t>();
            if (u <= static_cast<std::uint64_t>(INT64_MAX)) return Value(static_cast<std::int64_t>(u));
            return Value(static_cast<double>(u));
        }
        case nlohmann::ordered_json::value_t::number_float: return Value(v.get<double>());
        case nlohmann::ordered_json::value_t::string: return Value(v.get<std::string>());
        default: return Value(v.dump());
    }
}

}  // namespace

Table parse_jsonl(std::string_view text, const std::string& name) {
    std::vector<std::string> names;
    std::unordered_map<std::string, std::size_t> index;
    std::vector<std::vector<Cell>> columns;
    std::size_t rows = 0;
    std::size_t line_no = 0;
    std::size_t pos = 0;
    while (pos < text.size()) {
        std::size_t end = text.find('\n', pos);
        if (end == std::string_view::npos) end = text.size();
        std::string_view line = text.substr(pos, end - pos);
        pos = end + 1;
        ++line_no;
        if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
        nlohmann::ordered_json row;
        try {
            row = nlohmann::ordered_json::parse(line);
        } catch (const nlohmann::ordered_json::parse_error& e) {
            throw DataError(str("JSON-lines file '", name, "' line ", line_no, " is not valid JSON (",
                                e.what(), "); fix or remove that line"));
        }
        DTUNE_CHECK_AS(DataError, row.is_object(), "JSON-lines file '", name, "' line ", line_no,
                       " is a JSON ", row.type_name(),
                       ", not an object; each line must be one {\"column\": value} row");
        for (auto it = row.begin(); it != row.end(); ++it) {
            auto [slot, inserted] = index.try_emplace(it.key(), names.size());
            if (inserted) {
                names.push_back(it.key());
                columns.emplace_back(rows);  // earlier rows lacked this key: null there
            }
            std::vector<Cell>& col = columns[slot->second];
            col.resize(rows);  // pad rows that lacked this key
            col.push_back(to_cell(it.value()));
        }
        ++rows;
    }
    Table table;
    for (std::size_t i = 0; i < names.size(); ++i) {
        columns[i].resize(rows);
        table.add_column(names[i], std::move(columns[i]));
    }
    return table;
}

Table read_jsonl(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    DTUNE_CHECK_AS(DataError, in.good(), "cannot open JSON-lines file '", path.string(),
                   "'; check the path in the dataset config");
    std::ostringstream buffer;
    buffer << in.rdbuf();
    DTUNE_CHECK_AS(DataError, !in.bad(), "cannot read JSON-lines file '", path.string(), "'");
    return parse_jsonl(buffer.str(), path.string());
}

}  // namespace dtune::io
