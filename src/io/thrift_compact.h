// A bounds-checked reader for the Thrift compact protocol, enough to decode Parquet metadata
// (FileMetaData, PageHeader). Invariants: it never reads outside [data, data + size); nesting is
// limited to kMaxDepth so hostile input cannot exhaust the stack; every failure is a DataError
// that starts with the caller's context ("footer of 'x.parquet'") and the byte offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace dtune::io::thrift {

// Compact protocol type ids (the low nibble of a field header).
enum class Type : std::uint8_t {
    kStop = 0,
    kTrue = 1,  // a boolean field whose value is true
    kFalse = 2,
    kByte = 3,
    kI16 = 4,
    kI32 = 5,
    kI64 = 6,
    kDouble = 7,
    kBinary = 8,
    kList = 9,
    kSet = 10,
    kMap = 11,
    kStruct = 12,
};

struct ListHeader {
    Type elem_type;
    std::size_t size;
};

class CompactReader {
  public:
    static constexpr int kMaxDepth = 64;

    CompactReader(const std::uint8_t* data, std::size_t size, std::string context)
        : data_(data), size_(size), context_(std::move(context)) {}

    // Reads a struct: calls on_field(id, type) for each field; on_field must consume the value
    // (with the typed readers below or skip(type)). Tracks the delta-encoded field ids.
    void read_struct(const std::function<void(std::int16_t id, Type type)>& on_field);

    // Typed readers; each checks that the wire type is the one the schema expects.
    bool read_bool(Type type);
    std::int32_t read_i32(Type type);
    std::int64_t read_i64(Type type);
    double read_double(Type type);
    std::string read_string(Type type);
    // Reads a list/set header; size is checked against the remaining bytes (each element takes
    // at least one byte), so callers may reserve() it safely.
    ListHeader read_list_header(Type type);
    // Reads one list element of a scalar type (elements carry no field header).
    std::int32_t read_list_i32(Type elem_type) { return read_i32(elem_type); }

    // Skips a value of any type, recursing into containers.
    void skip(Type type);

    std::size_t position() const { return pos_; }
    [[noreturn]] void fail(const std::string& what) const;

  private:
    std::uint8_t byte();
    std::uint64_t varint();
    std::int64_t zigzag() {
        const std::uint64_t v = varint();
        return static_cast<std::int64_t>(v >> 1) ^ -static_cast<std::int64_t>(v & 1);
    }
    void expect(Type got, Type want);
    void skip_value(Type type);
    void enter();

    const std::uint8_t* data_;
    std::size_t size_;
    std::size_t pos_ = 0;
    int depth_ = 0;
    std::string context_;
};

}  // namespace dtune::io::thrift
