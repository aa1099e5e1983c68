// Table bookkeeping and cell conversions.
#include "io/table.h"

#include <charconv>
#include <cmath>
#include <sstream>

#include "core/error.h"

namespace dtune::io {

void Table::add_column(std::string name, std::vector<Cell> cells) {
    DTUNE_CHECK_AS(UsageError, index_of(name) < 0, "table already has a column named '", name,
                   "'; column names must be unique");
    DTUNE_CHECK_AS(UsageError, names_.empty() || cells.size() == num_rows_, "column '", name, "' has ",
                   cells.size(), " rows but the table has ", num_rows_, "; all columns need the same length");
    num_rows_ = cells.size();
    names_.push_back(std::move(name));
    columns_.push_back(std::move(cells));
}

int Table::index_of(std::string_view name) const {
    for (std::size_t i = 0; i < names_.size(); ++i) {
        if (names_[i] == name) return static_cast<int>(i);
    }
    return -1;
}

const std::vector<Cell>& Table::column(std::string_view name) const {
    const int index = index_of(name);
    if (index < 0) {
        std::string present;
        for (const auto& n : names_) present += (present.empty() ? "" : ", ") + n;
        throw DataError(str("no column named '", name, "' (columns: ", present,
                            "); check the column name in the dataset config"));
    }
    return columns_[static_cast<std::size_t>(index)];
}

std::vector<Cell> Table::row(std::size_t index) const {
    DTUNE_CHECK_AS(UsageError, index < num_rows_, "row ", index, " out of range for a table of ", num_rows_,
                   " rows");
    std::vector<Cell> cells;
    cells.reserve(columns_.size());
    for (const auto& column : columns_) cells.push_back(column[index]);
    return cells;
}

std::string to_display(const Cell& cell) {
    if (!cell) return "null";
    std::ostringstream out;
    out.precision(17);
    std::visit(
        [&](const auto& v) {
            using T = std::decay_t<decltype(v)>;
            if constexpr (std::is_same_v<T, std::string>) {
                out << '"' << v << '"';
            } else if constexpr (std::is_same_v<T, bool>) {
                out << (v ? "true" : "false");
            } else {
                out << v;
            }
        },
        *cell);
    return out.str();
}

std::optional<std::int64_t> as_int64(const Cell& cell) {
    if (!cell) return std::nullopt;
    if (const auto* i = std::get_if<std::int64_t>(&*cell)) return *i;
    if (const auto* d = std::get_if<double>(&*cell)) {
        // Only integral doubles inside the int64 range convert; 2^63 itself is out of range.
        if (std::isfinite(*d) && std::trunc(*d) == *d && std::fabs(*d) < 9.2e18) {
            return static_cast<std::int64_t>(*d);
        }
        return std::nullopt;
    }
    if (const auto* s = std::get_if<std::string>(&*cell)) {
        std::int64_t v = 0;
        const auto [end, ec] = std::from_chars(s->data(), s->data() + s->size(), v);
        if (ec == std::errc() && end == s->data() + s->size() && !s->empty()) return v;
    }
    return std::nullopt;
}

std::optional<double> as_double(const Cell& cell) {
    if (!cell) return std::nullopt;
    if (const auto* d = std::get_if<double>(&*cell)) return *d;
    if (const auto* i = std::get_if<std::int64_t>(&*cell)) return static_cast<double>(*i);
    if (const auto* s = std::get_if<std::string>(&*cell)) {
        double v = 0;
        const auto [end, ec] = std::from_chars(s->data(), s->data() + s->size(), v);
        if (ec == std::errc() && end == s->data() + s->size() && !s->empty()) return v;
    }
    return std::nullopt;
}

std::optional<std::string> as_string(const Cell& cell) {
    if (!cell) return std::nullopt;
    if (const auto* s = std::get_if<std::string>(&*cell)) return *s;
    std::string text = to_display(cell);
    return text;
}

}  // namespace dtune::io
