// Parity: reads every Parquet file in the shared fixtures (written by pyarrow 25 and pandas 3,
// see fixtures/gen/gen_parquet.py) and compares each cell with expected_rows.jsonl, which is
// parsed here with nlohmann::json directly, independently of our readers.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/jsonl_table.h"
#include "io/parquet.h"
#include "io/table_file.h"
#include "support/test_support.h"

namespace dtune::io {
namespace test_parquet_fixtures_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using parquet::PhysicalType;

std::filesystem::path parquet_dir() {
    return test::fixtures_dir() / "parquet";
}

std::vector<nlohmann::json> expected_rows() {
    std::ifstream in(parquet_dir() / "expected_rows.jsonl");
    std::vector<nlohmann::json> rows;
    std::string line;
    while (std::getline(in, line)) rows.push_back(nlohmann::json::parse(line));
    return rows;
}

// Compares one cell with a JSON value: null, string, integer, float or bool, exactly.
::testing::AssertionResult cell_matches(const Cell& cell, const nlohmann::json& want) {
    if (want.is_null()) {
        if (!cell) return ::testing::AssertionSuccess();
        return ::testing::AssertionFailure() << "expected null, got " << to_display(cell);
    }
    if (!cell) return ::testing::AssertionFailure() << "expected " << want.dump() << ", got null";
    bool ok = false;
    if (want.is_string()) {
        ok = std::holds_alternative<std::string>(*cell) &&
             std::get<std::string>(*cell) == want.get<std::string>();
    } else if (want.is_boolean()) {
        ok = std::holds_alternative<bool>(*cell) && std::get<bool>(*cell) == want.get<bool>();
    } else if (want.is_number_integer()) {
        ok = std::holds_alternative<std::int64_t>(*cell) &&
             std::get<std::int64_t>(*cell) == want.get<std::int64_t>();
    } else if (want.is_number_float()) {
        ok = std::holds_alternative<double>(*cell) && std::get<double>(*cell) == want.get<double>();
    }
    if (ok) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "expected " << want.dump() << ", got " << to_display(cell);
}

const std::vector<std::string> kColumns = {"filename", "width", "height", "caption", "aesthetic", "nsfw"};

class ParquetVariant : public ::testing::TestWithParam<const char*> {};

TEST_P(ParquetVariant, MatchesExpectedRows) {
    const auto rows = expected_rows();
    ASSERT_EQ(rows.size(), 2500u);
    const ParquetFile file = ParquetFile::open(parquet_dir() / (std::string(GetParam()) + ".parquet"));
    ASSERT_EQ(file.num_rows(), 2500);
    ASSERT_EQ(file.columns().size(), kColumns.size());
    const std::vector<PhysicalType> types = {PhysicalType::kByteArray, PhysicalType::kInt64,
                                             PhysicalType::kInt32,     PhysicalType::kByteArray,
                                             PhysicalType::kDouble,    PhysicalType::kBoolean};
    for (std::size_t c = 0; c < kColumns.size(); ++c) {
        EXPECT_EQ(file.columns()[c].name, kColumns[c]);
        EXPECT_EQ(file.columns()[c].type, types[c]) << kColumns[c];
        EXPECT_TRUE(file.columns()[c].nullable) << kColumns[c];  // pyarrow fields are nullable by default
    }
    EXPECT_EQ(file.columns()[0].type_name(), "STRING");
    EXPECT_EQ(file.columns()[2].type_name(), "INT32");
    const Table table = file.read_table();
    ASSERT_EQ(table.num_rows(), rows.size());
    for (const auto& name : kColumns) {
        const auto& column = table.column(name);
        for (std::size_t r = 0; r < rows.size(); ++r) {
            ASSERT_TRUE(cell_matches(column[r], rows[r].at(name)))
                << GetParam() << " row " << r << " " << name;
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Pyarrow, ParquetVariant,
                         ::testing::Values("snappy_dict_v1", "gzip_plain_v1", "zstd_dict_v2", "none_plain_v2",
                                           "snappy_small_rowgroups"));

TEST(ParquetFixtures, SmallRowGroupsSpanSeveralGroups) {
    // row_group_size=300 over 2,500 rows: ceil(2500 / 300) = 9 groups.
    EXPECT_EQ(ParquetFile::open(parquet_dir() / "snappy_small_rowgroups.parquet").num_row_groups(), 9u);
}

TEST(ParquetFixtures, LaionStyleColumns) {
    const auto rows = expected_rows();
    const ParquetFile file = ParquetFile::open(parquet_dir() / "laion_style.parquet");
    ASSERT_EQ(file.num_rows(), 500);
    std::vector<std::string> names;
    for (const auto& c : file.columns()) names.push_back(c.name);
    EXPECT_EQ(names, (std::vector<std::string>{"URL", "TEXT", "WIDTH", "HEIGHT", "similarity"}));
    EXPECT_EQ(file.columns()[2].type, PhysicalType::kDouble);
    const Table t = file.read_table();
    for (std::size_t r = 0; r < 500; ++r) {
        const auto& want = rows[r];
        ASSERT_TRUE(cell_matches(t.at(r, "URL"),
                                 "https://example.invalid/" + want.at("filename").get<std::string>()));
        ASSERT_TRUE(cell_matches(t.at(r, "TEXT"), want.at("caption"))) << r;
        ASSERT_TRUE(cell_matches(t.at(r, "WIDTH"), static_cast<double>(want.at("width").get<std::int64_t>())))
            << r;
        ASSERT_TRUE(
            cell_matches(t.at(r, "HEIGHT"), static_cast<double>(want.at("height").get<std::int64_t>())))
            << r;
        // The generator computed aesthetic / 10 in Python doubles; IEEE division gives the same bits here.
        ASSERT_TRUE(cell_matches(t.at(r, "similarity"), want.at("aesthetic").get<double>() / 10)) << r;
    }
}

TEST(ParquetFixtures, PandasWrittenFile) {
    const auto rows = expected_rows();
    const ParquetFile file = ParquetFile::open(parquet_dir() / "pandas_written.parquet");
    ASSERT_EQ(file.num_rows(), 200);
    // A RangeIndex is stored only in the "pandas" footer metadata, not as an __index_level_0__ column.
    std::vector<std::string> names;
    for (const auto& c : file.columns()) names.push_back(c.name);
    EXPECT_EQ(names, kColumns);
    bool has_pandas = false;
    for (const auto& [key, value] : file.key_value_metadata()) {
        if (key == "pandas") {
            has_pandas = true;
            const auto meta = nlohmann::json::parse(value);
            EXPECT_EQ(meta.at("index_columns").at(0).at("kind"), "range");
            EXPECT_EQ(meta.at("index_columns").at(0).at("stop"), 200);
        }
    }
    EXPECT_TRUE(has_pandas);
    for (const auto& name : kColumns) {
        const std::vector<Cell> column = file.read_column(name);
        ASSERT_EQ(column.size(), 200u);
        for (std::size_t r = 0; r < 200; ++r)
            ASSERT_TRUE(cell_matches(column[r], rows[r].at(name))) << name << r;
    }
}

TEST(ParquetFixtures, EveryFileInTheFolderOpens) {
    int files = 0;
    for (const auto& entry : std::filesystem::directory_iterator(parquet_dir())) {
        if (entry.path().extension() != ".parquet") continue;
        ++files;
        const ParquetFile file = ParquetFile::open(entry.path());
        const Table t = file.read_table();
        EXPECT_EQ(static_cast<std::int64_t>(t.num_rows()), file.num_rows()) << entry.path();
    }
    EXPECT_EQ(files, 7);
}

TEST(ParquetFixtures, MissingColumnNamesThosePresent) {
    const ParquetFile file = ParquetFile::open(parquet_dir() / "laion_style.parquet");
    try {
        file.read_column("caption");
        FAIL() << "expected DataError";
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("URL, TEXT"), std::string::npos) << e.what();
    }
}

TEST(JsonlFixtures, ExpectedRowsReadLikeParquet) {
    const auto rows = expected_rows();
    const Table jsonl = read_jsonl(parquet_dir() / "expected_rows.jsonl");
    EXPECT_EQ(jsonl.names(), kColumns);
    ASSERT_EQ(jsonl.num_rows(), rows.size());
    const Table pq = read_parquet(parquet_dir() / "zstd_dict_v2.parquet");
    for (const auto& name : kColumns) {
        for (std::size_t r = 0; r < rows.size(); ++r) {
            ASSERT_TRUE(cell_matches(jsonl.at(r, name), rows[r].at(name))) << r << name;
            ASSERT_EQ(jsonl.at(r, name), pq.at(r, name)) << r << name;
        }
    }
}

TEST(TableFileFixtures, DispatchesByExtensionAndSelectsColumns) {
    const std::vector<std::string> wanted = {"caption", "filename"};
    const Table pq = read_table_file(parquet_dir() / "snappy_dict_v1.parquet", wanted);
    const Table jl = read_table_file(parquet_dir() / "expected_rows.jsonl", wanted);
    EXPECT_EQ(pq.names(), wanted);
    EXPECT_EQ(jl.names(), wanted);
    ASSERT_EQ(pq.num_rows(), 2500u);
    for (const auto& name : wanted) EXPECT_EQ(pq.column(name), jl.column(name)) << name;
    EXPECT_THROW(read_table_file(parquet_dir() / "expected_rows.jsonl", {"nope"}), DataError);
    EXPECT_THROW(read_table_file(parquet_dir() / "README.json.csv"), UsageError);
}

}  // namespace
}  // namespace test_parquet_fixtures_local
}  // namespace dtune::io
