// JSON-lines tables: one JSON object per line becomes one row of a Table (the same cells the
// Parquet reader returns), for metadata exported as .jsonl instead of .parquet.
// Invariants: columns appear in first-seen key order; a key missing from a row is null there;
// integers become int64, other numbers double, strings/bools as such; nested arrays/objects are
// kept as their compact JSON text. Blank lines are skipped. A line that is not a JSON object is
// a DataError naming the file and the 1-based line number.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

#include "io/table.h"

namespace dtune::io {

Table read_jsonl(const std::filesystem::path& path);
// Parses JSON-lines text already in memory; `name` stands for the file in messages.
Table parse_jsonl(std::string_view text, const std::string& name);

}  // namespace dtune::io
