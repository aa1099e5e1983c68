// One entry point for metadata tables on disk: picks the Parquet or JSON-lines reader by file
// extension and keeps only the requested columns, so callers (the parquet metadata backend)
// need not care which format the user exported.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "io/table.h"

namespace dtune::io {

// Reads .parquet, or .jsonl / .ndjson / .json (JSON lines). `columns` selects and orders the
// columns (all when empty); a missing one is a DataError naming it and the columns present. An
// unknown extension is a UsageError.
Table read_table_file(const std::filesystem::path& path, const std::vector<std::string>& columns = {});

}  // namespace dtune::io
