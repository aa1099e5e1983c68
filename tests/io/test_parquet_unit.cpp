// Unit tests of the Parquet reader on hand-built files (every encoding path with values known by
// construction), on unsupported features, and on malformed input: each must be a DataError that
// names the problem, never a crash or another exception type.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <random>

#include "core/error.h"
#include "io/parquet.h"
#include "parquet_test_writer.h"
#include "support/test_support.h"

namespace dtune::io {
namespace test_parquet_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using testing::build_file;
using testing::data_page_v1;
using testing::data_page_v2;
using testing::dictionary_page;
using testing::le32;
using testing::le64;
using testing::TestColumn;

std::vector<std::uint8_t> bytes_of(const std::string& s) {
    return {s.begin(), s.end()};
}

ParquetFile open_string(const std::string& s) {
    return ParquetFile::from_buffer(bytes_of(s), "test.parquet");
}

// Runs f, expecting a DataError whose message contains `needle`.
template <typename F>
void expect_data_error(F f, const std::string& needle) {
    try {
        f();
        ADD_FAILURE() << "expected a DataError mentioning '" << needle << "'";
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
}

// Definition levels [1, 0, 1] as a v1 block: u32 length + one bit-packed group (header 3, bits 101).
const std::string kLevels101 = le32(2) + std::string("\x03\x05", 2);

std::string hand_built_file() {
    std::vector<TestColumn> cols;
    cols.push_back(
        {"id", 2, 0,
         data_page_v1(3, testing::kPlain, le64(1) + le64(static_cast<std::uint64_t>(-2)) + le64(3))});
    cols.push_back(
        {"s", 6, 1, data_page_v1(3, testing::kPlain, kLevels101 + le32(1) + "a" + le32(3) + "bcd")});
    cols.push_back({"flag", 0, 0, data_page_v2(3, 0, testing::kPlain, "", std::string("\x05", 1))});
    // Dictionary [10, 20]; indices [1, 1, 0]: bit width 1, one bit-packed group with bits 011.
    cols.push_back({"dict", 2, 0,
                    dictionary_page(2, le64(10) + le64(20)) +
                        data_page_v1(3, testing::kRleDictionary, std::string("\x01\x03\x03", 3))});
    // One-entry dictionary: bit width 0 and an RLE run of 3 (header 6), no value bytes.
    cols.push_back(
        {"const", 1, 0,
         dictionary_page(1, le32(7)) + data_page_v1(3, testing::kRleDictionary, std::string("\x00\x06", 2))});
    // v2 optional int32 with levels [1, 0, 1] (no length prefix in v2) and values -5, 6.
    cols.push_back({"opt", 1, 1,
                    data_page_v2(3, 1, testing::kPlain, std::string("\x03\x05", 2),
                                 le32(static_cast<std::uint32_t>(-5)) + le32(6))});
    // RLE-encoded booleans (v2 style): u32 length + RLE run of 3 trues (header 6, value 1).
    cols.push_back(
        {"rle_bool", 0, 0, data_page_v2(3, 0, testing::kRle, "", le32(2) + std::string("\x06\x01", 2))});
    double d[3] = {0.5, -1.25, 1e300};
    std::string dbytes(reinterpret_cast<const char*>(d), sizeof(d));
    cols.push_back({"x", 5, 0, data_page_v1(3, testing::kPlain, dbytes)});
    return build_file(cols, 3);
}

TEST(ParquetUnit, HandBuiltFileDecodesEveryPath) {
    const ParquetFile f = open_string(hand_built_file());
    ASSERT_EQ(f.num_rows(), 3);
    ASSERT_EQ(f.columns().size(), 8u);
    EXPECT_FALSE(f.columns()[0].nullable);
    EXPECT_TRUE(f.columns()[1].nullable);
    const Table t = f.read_table();
    EXPECT_EQ(t.column("id"), (std::vector<Cell>{std::int64_t{1}, std::int64_t{-2}, std::int64_t{3}}));
    EXPECT_EQ(t.column("s"), (std::vector<Cell>{std::string("a"), std::nullopt, std::string("bcd")}));
    EXPECT_EQ(t.column("flag"), (std::vector<Cell>{true, false, true}));
    EXPECT_EQ(t.column("dict"), (std::vector<Cell>{std::int64_t{20}, std::int64_t{20}, std::int64_t{10}}));
    EXPECT_EQ(t.column("const"), (std::vector<Cell>{std::int64_t{7}, std::int64_t{7}, std::int64_t{7}}));
    EXPECT_EQ(t.column("opt"), (std::vector<Cell>{std::int64_t{-5}, std::nullopt, std::int64_t{6}}));
    EXPECT_EQ(t.column("rle_bool"), (std::vector<Cell>{true, true, true}));
    EXPECT_EQ(t.column("x"), (std::vector<Cell>{0.5, -1.25, 1e300}));
}

TEST(ParquetUnit, RepeatedColumnIsNotSupported) {
    const std::string file = build_file({{"tags", 6, 2, data_page_v1(0, testing::kPlain, "")}}, 0);
    expect_data_error([&] { open_string(file); }, "repeated");
}

TEST(ParquetUnit, NestedSchemaIsNotSupported) {
    const std::string file =
        build_file({{"a", 2, 0, data_page_v1(1, testing::kPlain, le64(1))}}, 1, /*root_children=*/2);
    expect_data_error([&] { open_string(file); }, "nested");
}

TEST(ParquetUnit, Int96ListsButDoesNotRead) {
    const ParquetFile f =
        open_string(build_file({{"ts", 3, 0, data_page_v1(1, testing::kPlain, std::string(12, '\0'))}}, 1));
    EXPECT_EQ(f.columns()[0].type_name(), "INT96");
    EXPECT_FALSE(f.columns()[0].supported);
    expect_data_error([&] { f.read_column("ts"); }, "INT96");
}

TEST(ParquetUnit, UnsignedAndDecimalAnnotations) {
    TestColumn u{"u", 1, 0, data_page_v1(2, testing::kPlain, le32(0xffffffffu) + le32(7))};
    u.converted = 13;  // UINT_32
    const ParquetFile f = open_string(build_file({u}, 2));
    EXPECT_EQ(f.columns()[0].type_name(), "UINT32");
    EXPECT_EQ(f.read_column(0), (std::vector<Cell>{std::int64_t{4294967295}, std::int64_t{7}}));
    TestColumn d{"price", 1, 0, data_page_v1(1, testing::kPlain, le32(1234))};
    d.converted = 5;  // DECIMAL
    const ParquetFile g = open_string(build_file({d}, 1));
    EXPECT_FALSE(g.columns()[0].supported);
    expect_data_error([&] { g.read_column(0); }, "DECIMAL");
}

TEST(ParquetUnit, UnsupportedCodecIsNamed) {
    TestColumn c{"a", 2, 0, data_page_v1(1, testing::kPlain, le64(1))};
    c.codec = 5;  // LZ4 (the deprecated Hadoop framing)
    const ParquetFile f = open_string(build_file({c}, 1));
    expect_data_error([&] { f.read_column(0); }, "LZ4");
}

TEST(ParquetUnit, UnsupportedEncodingIsNamed) {
    const ParquetFile f =
        open_string(build_file({{"a", 2, 0, data_page_v1(1, testing::kDeltaBinaryPacked, le64(1))}}, 1));
    expect_data_error([&] { f.read_column(0); }, "DELTA_BINARY_PACKED");
}

TEST(ParquetUnit, TruncatedPageIsAnError) {
    std::string pages = data_page_v1(3, testing::kPlain, le64(1) + le64(2) + le64(3));
    pages.resize(pages.size() - 5);  // the chunk ends inside the page body
    const ParquetFile f = open_string(build_file({{"a", 2, 0, pages}}, 3));
    expect_data_error([&] { f.read_column(0); }, "runs past the end of the column chunk");
}

TEST(ParquetUnit, ShortPageBodyIsAnError) {
    const ParquetFile f =
        open_string(build_file({{"a", 2, 0, data_page_v1(3, testing::kPlain, le64(1) + le64(2))}}, 3));
    expect_data_error([&] { f.read_column(0); }, "column 'a'");
}

TEST(ParquetUnit, DictionaryIndexOutOfRange) {
    const std::string pages = dictionary_page(1, le64(5)) +
                              data_page_v1(1, testing::kRleDictionary, std::string("\x02\x02\x03", 3));
    const ParquetFile f = open_string(build_file({{"a", 2, 0, pages}}, 1));
    expect_data_error([&] { f.read_column(0); }, "dictionary index 3 out of range");
}

TEST(ParquetUnit, ChunkValueCountMustMatchRows) {
    TestColumn c{"a", 2, 0, data_page_v1(1, testing::kPlain, le64(1))};
    c.num_values = 2;
    const ParquetFile f = open_string(build_file({c}, 1));
    expect_data_error([&] { f.read_column(0); }, "holds 2 values for 1 rows");
}

std::string fixture_bytes(const std::string& name) {
    std::ifstream in(test::fixtures_dir() / "parquet" / name, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(ParquetMalformed, TruncatedFile) {
    const std::string good = fixture_bytes("snappy_dict_v1.parquet");
    ASSERT_GT(good.size(), 1000u);
    expect_data_error([&] { open_string(good.substr(0, good.size() / 2)); },
                      "does not end with the Parquet magic");
    expect_data_error([&] { open_string(good.substr(0, 10)); }, "too short");
}

TEST(ParquetMalformed, BadMagic) {
    std::string bad = fixture_bytes("snappy_dict_v1.parquet");
    bad.replace(0, 4, "PAR2");
    expect_data_error([&] { open_string(bad); }, "does not start with the Parquet magic");
}

TEST(ParquetMalformed, FooterLengthBeyondFile) {
    std::string bad = fixture_bytes("snappy_dict_v1.parquet");
    bad.replace(bad.size() - 8, 4, le32(static_cast<std::uint32_t>(bad.size())));
    expect_data_error([&] { open_string(bad); }, "states a footer of");
}

TEST(ParquetMalformed, CorruptedPageHeader) {
    std::string bad = fixture_bytes("snappy_dict_v1.parquet");
    // The first column chunk (filename) starts right after the leading magic.
    for (std::size_t i = 4; i < 20; ++i) bad[i] = '\xff';
    const ParquetFile f = open_string(bad);
    expect_data_error([&] { f.read_column("filename"); }, "column 'filename' row group 0 page header");
}

TEST(ParquetMalformed, CorruptedFooterThrift) {
    std::string bad = fixture_bytes("pandas_written.parquet");
    std::uint32_t len = 0;
    std::memcpy(&len, bad.data() + bad.size() - 8, 4);
    const std::size_t start = bad.size() - 8 - len;
    bad.replace(start, 8, std::string(8, '\xfe'));
    expect_data_error([&] { open_string(bad); }, "footer: corrupt Thrift metadata");
}

// A deterministic mini-fuzz: random byte edits of a real file are either read or rejected with a
// DataError; anything else (another exception type, a crash under ASan) fails.
TEST(ParquetMalformed, RandomByteEditsNeverEscapeDataError) {
    const std::string good = fixture_bytes("pandas_written.parquet");
    ASSERT_FALSE(good.empty());
    std::mt19937 rng(1234);
    ParquetLimits limits;
    limits.max_page_bytes = 16 << 20;
    int rejected = 0;
    for (int trial = 0; trial < 1500; ++trial) {
        std::string bad = good;
        const int edits = 1 + static_cast<int>(rng() % 4);
        for (int e = 0; e < edits; ++e) bad[rng() % bad.size()] = static_cast<char>(rng());
        try {
            const ParquetFile f = ParquetFile::from_buffer(bytes_of(bad), "mutant.parquet", limits);
            if (f.num_rows() > 100000) continue;
            (void)f.read_table();
        } catch (const DataError&) {
            ++rejected;
        }
    }
    EXPECT_GT(rejected, 0);
}

}  // namespace
}  // namespace test_parquet_unit_local
}  // namespace dtune::io
