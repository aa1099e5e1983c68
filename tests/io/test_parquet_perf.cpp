// Throughput of the Parquet reader on the 2,500-row fixtures (ctest label perf, never in CI):
// prints rows/s per file for a full read_table(), open included.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>

#include "io/parquet.h"
#include "support/test_support.h"

namespace dtune::io {
namespace test_parquet_perf_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

TEST(ParquetPerf, RowsPerSecond) {
    for (const char* name :
         {"snappy_dict_v1", "gzip_plain_v1", "zstd_dict_v2", "none_plain_v2", "snappy_small_rowgroups"}) {
        const auto path = test::fixtures_dir() / "parquet" / (std::string(name) + ".parquet");
        const int iterations = 40;
        std::size_t rows = 0;
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < iterations; ++i) rows += ParquetFile::open(path).read_table().num_rows();
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        ASSERT_EQ(rows, 2500u * iterations);
        std::printf("%-24s %10.0f rows/s (%.2f ms per 2,500-row file)\n", name, rows / seconds,
                    1e3 * seconds / iterations);
    }
}

}  // namespace
}  // namespace test_parquet_perf_local
}  // namespace dtune::io
