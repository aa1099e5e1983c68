// Unit tests of the JSON-lines table reader and the Table cell helpers.
#include <gtest/gtest.h>

#include "core/error.h"
#include "io/jsonl_table.h"

namespace dtune::io {
namespace test_jsonl_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

TEST(JsonlUnit, ColumnsInFirstSeenOrderWithNullsForMissingKeys) {
    const Table t = parse_jsonl(
        "{\"file\": \"a.jpg\", \"w\": 1024, \"score\": 0.5}\n"
        "\n"
        "{\"w\": 768, \"file\": \"b.jpg\", \"tags\": [1, 2], \"ok\": true}\r\n"
        "{\"file\": null, \"big\": 18446744073709551615}\n",
        "meta.jsonl");
    EXPECT_EQ(t.names(), (std::vector<std::string>{"file", "w", "score", "tags", "ok", "big"}));
    ASSERT_EQ(t.num_rows(), 3u);
    EXPECT_EQ(t.at(0, "file"), Cell(std::string("a.jpg")));
    EXPECT_EQ(t.at(1, "w"), Cell(std::int64_t{768}));
    EXPECT_EQ(t.at(0, "score"), Cell(0.5));
    EXPECT_EQ(t.at(1, "score"), Cell());
    EXPECT_EQ(t.at(1, "tags"), Cell(std::string("[1,2]")));
    EXPECT_EQ(t.at(1, "ok"), Cell(true));
    EXPECT_EQ(t.at(2, "file"), Cell());
    EXPECT_EQ(t.at(2, "w"), Cell());
    EXPECT_EQ(t.at(2, "big"), Cell(18446744073709551615.0));
}

TEST(JsonlUnit, BadLineNamesItsNumber) {
    try {
        parse_jsonl("{\"a\": 1}\n\n{\"a\": 2,}\n", "meta.jsonl");
        FAIL() << "expected DataError";
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("'meta.jsonl' line 3"), std::string::npos) << e.what();
    }
    try {
        parse_jsonl("[1, 2]\n", "meta.jsonl");
        FAIL() << "expected DataError";
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("line 1 is a JSON array"), std::string::npos) << e.what();
    }
}

TEST(JsonlUnit, MissingFileIsDataError) {
    EXPECT_THROW(read_jsonl("/nonexistent/meta.jsonl"), DataError);
}

TEST(TableUnit, LenientConversions) {
    EXPECT_EQ(as_int64(Cell(1024.0)), 1024);
    EXPECT_EQ(as_int64(Cell(1024.5)), std::nullopt);
    EXPECT_EQ(as_int64(Cell(std::string("768"))), 768);
    EXPECT_EQ(as_int64(Cell(std::string("768px"))), std::nullopt);
    EXPECT_EQ(as_int64(Cell()), std::nullopt);
    EXPECT_EQ(as_double(Cell(std::int64_t{3})), 3.0);
    EXPECT_EQ(as_string(Cell(std::int64_t{3})), "3");
    EXPECT_EQ(to_display(Cell(std::string("x"))), "\"x\"");
    EXPECT_EQ(to_display(Cell()), "null");
}

TEST(TableUnit, RejectsDuplicateNamesAndRaggedColumns) {
    Table t;
    t.add_column("a", {Cell(), Cell()});
    EXPECT_THROW(t.add_column("a", {Cell(), Cell()}), UsageError);
    EXPECT_THROW(t.add_column("b", {Cell()}), UsageError);
    EXPECT_THROW(t.column("zzz"), DataError);
    t.add_column("b", {Cell(std::int64_t{1}), Cell(std::string("x"))});
    EXPECT_EQ(t.row(1), (std::vector<Cell>{Cell(), Cell(std::string("x"))}));
    EXPECT_THROW(t.row(2), UsageError);
}

}  // namespace
}  // namespace test_jsonl_unit_local
}  // namespace dtune::io
