// libFuzzer target for the Parquet reader: arbitrary bytes go through from_buffer, the column
// listing and every column read. The only acceptable outcome besides success is dtune::DataError;
// any other exception, crash or sanitizer report is a bug. Limits keep a hostile footer from
// asking for gigabytes (a legitimately huge file is not a bug, just not worth fuzzing).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "io/parquet.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    dtune::io::ParquetLimits limits;
    limits.max_page_bytes = std::size_t{16} << 20;
    try {
        const auto file = dtune::io::ParquetFile::from_buffer(std::vector<std::uint8_t>(data, data + size),
                                                              "fuzz.parquet", limits);
        // Null runs cost a few bytes per billion rows; cap rows so memory stays within the fuzzer's limit.
        if (file.num_rows() > 200000) return 0;
        for (std::size_t i = 0; i < file.columns().size(); ++i) {
            try {
                const auto cells = file.read_column(i);
                if (cells.size() != static_cast<std::size_t>(file.num_rows())) __builtin_trap();
            } catch (const dtune::DataError&) {
                // Rejected column: keep reading the others to reach more code.
            }
        }
    } catch (const dtune::DataError&) {
    }
    return 0;
}
