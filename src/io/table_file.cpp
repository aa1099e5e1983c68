// Extension dispatch between the Parquet and JSON-lines readers.
#include "io/table_file.h"

#include <algorithm>
#include <cctype>

#include "core/error.h"
#include "io/jsonl_table.h"
#include "io/parquet.h"

namespace dtune::io {

Table read_table_file(const std::filesystem::path& path, const std::vector<std::string>& columns) {
    std::string ext = path.extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
    if (ext == ".parquet") return ParquetFile::open(path).read_table(columns);
    DTUNE_CHECK_AS(UsageError, ext == ".jsonl" || ext == ".ndjson" || ext == ".json", "metadata table '",
                   path.string(), "' has extension '", ext,
                   "'; use a .parquet file or a JSON-lines file (.jsonl, one object per line)");
    Table all = read_jsonl(path);
    if (columns.empty()) return all;
    Table selected;
    for (const auto& name : columns) {
        const auto& cells = all.column(name);  // DataError naming the missing column
        selected.add_column(name, cells);
    }
    return selected;
}

}  // namespace dtune::io
