// A small column-oriented table of nullable scalar cells: what the Parquet and JSON-lines readers
// return and what dataset metadata code consumes. Invariant: every column holds num_rows() cells
// and names are unique.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace dtune::io {

// One non-null value. Integers of every width widen to int64, FLOAT widens to double, byte
// arrays (UTF-8 strings or raw bytes) become std::string.
using Value = std::variant<std::int64_t, double, bool, std::string>;
// A value or null.
using Cell = std::optional<Value>;

class Table {
  public:
    // Appends a column; throws UsageError when the name is taken or the length does not match.
    void add_column(std::string name, std::vector<Cell> cells);

    std::size_t num_rows() const { return num_rows_; }
    std::size_t num_columns() const { return names_.size(); }
    const std::vector<std::string>& names() const { return names_; }

    // Index of a column, or -1 when absent.
    int index_of(std::string_view name) const;
    bool has_column(std::string_view name) const { return index_of(name) >= 0; }
    const std::vector<Cell>& column(std::size_t index) const { return columns_.at(index); }
    // Throws DataError naming the missing column and the columns present.
    const std::vector<Cell>& column(std::string_view name) const;
    const Cell& at(std::size_t row, std::string_view name) const { return column(name).at(row); }
    // One row as cells in column order (copies; prefer column() for bulk access).
    std::vector<Cell> row(std::size_t index) const;

  private:
    std::vector<std::string> names_;
    std::vector<std::vector<Cell>> columns_;
    std::size_t num_rows_ = 0;
};

// Readable form of a cell for messages and debugging: null, 12, 1.5, true, "text".
std::string to_display(const Cell& cell);

// Lenient conversions for metadata columns (a width stored as 1024.0 or "1024" is still 1024).
// They return nullopt for null cells and for values that do not convert exactly.
std::optional<std::int64_t> as_int64(const Cell& cell);
std::optional<double> as_double(const Cell& cell);
std::optional<std::string> as_string(const Cell& cell);

}  // namespace dtune::io
