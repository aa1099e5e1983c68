// Test-only writer for tiny hand-built Parquet files: a Thrift compact encoder written from the
// spec (independently of the reader under test) and helpers that assemble pages, one row group
// and the footer. Only uncompressed pages; expected cell values are known by construction.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtune::io::testing {

// Thrift compact protocol encoder.
class Compact {
  public:
    Compact& field(int id, int type) {
        const int delta = id - last_.back();
        if (delta > 0 && delta <= 15) {
            out_ += static_cast<char>((delta << 4) | type);
        } else {
            out_ += static_cast<char>(type);
            varint(zigzag(id));
        }
        last_.back() = id;
        return *this;
    }
    Compact& i32(int id, std::int64_t v) { return field(id, 5).varint(zigzag(v)); }
    Compact& i64(int id, std::int64_t v) { return field(id, 6).varint(zigzag(v)); }
    Compact& boolean(int id, bool v) { return field(id, v ? 1 : 2); }
    Compact& string(int id, const std::string& s) {
        field(id, 8).varint(s.size());
        out_ += s;
        return *this;
    }
    Compact& begin_struct(int id) {
        field(id, 12);
        last_.push_back(0);
        return *this;
    }
    // A struct that is a list element (no field header).
    Compact& begin_elem() {
        last_.push_back(0);
        return *this;
    }
    Compact& end() {
        out_ += '\0';
        last_.pop_back();
        return *this;
    }
    Compact& list(int id, int elem_type, std::size_t size) {
        field(id, 9);
        if (size < 15) {
            out_ += static_cast<char>((size << 4) | elem_type);
        } else {
            out_ += static_cast<char>(0xf0 | elem_type);
            varint(size);
        }
        return *this;
    }
    Compact& raw_string(const std::string& s) {
        varint(s.size());
        out_ += s;
        return *this;
    }
    Compact& varint(std::uint64_t v) {
        while (v >= 0x80) {
            out_ += static_cast<char>((v & 0x7f) | 0x80);
            v >>= 7;
        }
        out_ += static_cast<char>(v);
        return *this;
    }
    // The bytes so far; a top-level struct needs a final end() (STOP) by the caller.
    const std::string& bytes() const { return out_; }

  private:
    static std::uint64_t zigzag(std::int64_t v) {
        return (static_cast<std::uint64_t>(v) << 1) ^ static_cast<std::uint64_t>(v >> 63);
    }
    std::string out_;
    std::vector<int> last_{0};
};

inline std::string le32(std::uint32_t v) {
    std::string s(4, '\0');
    for (int i = 0; i < 4; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
    return s;
}
inline std::string le64(std::uint64_t v) {
    return le32(static_cast<std::uint32_t>(v)) + le32(static_cast<std::uint32_t>(v >> 32));
}

// Page types and encodings, from parquet.thrift.
enum : int { kDataPage = 0, kDictionaryPage = 2, kDataPageV2 = 3 };
enum : int { kPlain = 0, kRle = 3, kRleDictionary = 8, kDeltaBinaryPacked = 5 };

// A v1 data page: header + body (uncompressed). `body` holds levels and values as written.
inline std::string data_page_v1(int num_values, int encoding, const std::string& body) {
    Compact c;
    c.i32(1, kDataPage)
        .i32(2, static_cast<std::int64_t>(body.size()))
        .i32(3, static_cast<std::int64_t>(body.size()));
    c.begin_struct(5).i32(1, num_values).i32(2, encoding).i32(3, kRle).i32(4, kRle).end();
    c.end();
    return c.bytes() + body;
}

inline std::string dictionary_page(int num_values, const std::string& body) {
    Compact c;
    c.i32(1, kDictionaryPage)
        .i32(2, static_cast<std::int64_t>(body.size()))
        .i32(3, static_cast<std::int64_t>(body.size()));
    c.begin_struct(7).i32(1, num_values).i32(2, kPlain).end();
    c.end();
    return c.bytes() + body;
}

inline std::string data_page_v2(int num_values, int num_nulls, int encoding, const std::string& levels,
                                const std::string& values) {
    Compact c;
    const auto size = static_cast<std::int64_t>(levels.size() + values.size());
    c.i32(1, kDataPageV2).i32(2, size).i32(3, size);
    c.begin_struct(8)
        .i32(1, num_values)
        .i32(2, num_nulls)
        .i32(3, num_values)
        .i32(4, encoding)
        .i32(5, static_cast<std::int64_t>(levels.size()))
        .i32(6, 0)
        .boolean(7, false)
        .end();
    c.end();
    return c.bytes() + levels + values;
}

struct TestColumn {
    std::string name;
    int type = 2;        // parquet.thrift Type: 0 BOOLEAN, 1 INT32, 2 INT64, 5 DOUBLE, 6 BYTE_ARRAY
    int repetition = 0;  // 0 REQUIRED, 1 OPTIONAL, 2 REPEATED
    std::string pages;   // concatenated pages of its one chunk
    int codec = 0;
    std::int64_t num_values = -1;  // -1: the row count
    int converted = -1;            // ConvertedType annotation, -1: none
};

// Assembles a file with one row group holding `rows` rows.
inline std::string build_file(const std::vector<TestColumn>& columns, std::int64_t rows,
                              int root_children = -1) {
    std::string body = "PAR1";
    std::vector<std::int64_t> offsets;
    for (const auto& c : columns) {
        offsets.push_back(static_cast<std::int64_t>(body.size()));
        body += c.pages;
    }
    Compact m;
    m.i32(1, 1);
    m.list(2, 12, columns.size() + 1);
    m.begin_elem()
        .string(4, "schema")
        .i32(5, root_children < 0 ? static_cast<int>(columns.size()) : root_children)
        .end();
    for (const auto& c : columns) {
        m.begin_elem().i32(1, c.type).i32(3, c.repetition).string(4, c.name);
        if (c.converted >= 0) m.i32(6, c.converted);
        m.end();
    }
    m.i64(3, rows);
    m.list(4, 12, 1).begin_elem();
    m.list(1, 12, columns.size());
    for (std::size_t i = 0; i < columns.size(); ++i) {
        const auto& c = columns[i];
        m.begin_elem().i64(2, offsets[i]).begin_struct(3);
        m.i32(1, c.type).list(2, 5, 1).varint(0).list(3, 8, 1).raw_string(c.name).i32(4, c.codec);
        m.i64(5, c.num_values < 0 ? rows : c.num_values)
            .i64(6, static_cast<std::int64_t>(c.pages.size()))
            .i64(7, static_cast<std::int64_t>(c.pages.size()))
            .i64(9, offsets[i]);
        m.end().end();
    }
    m.i64(2, 0).i64(3, rows).end();
    m.end();
    return body + m.bytes() + le32(static_cast<std::uint32_t>(m.bytes().size())) + "PAR1";
}

}  // namespace dtune::io::testing
