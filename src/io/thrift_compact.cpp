// Thrift compact protocol decoding. Wire format: field header byte = (id delta << 4) | type, a
// zero delta means a zigzag varint id follows; integers are zigzag varints; binary is a varint
// length then bytes; list header byte = (size << 4) | elem type, size 15 means a varint follows.
#include "io/thrift_compact.h"

#include <cstring>

#include "core/error.h"

namespace dtune::io::thrift {

namespace {

const char* type_name(Type t) {
    static const char* const kNames[] = {"stop",   "true",   "false", "byte", "i16", "i32",   "i64",
                                         "double", "binary", "list",  "set",  "map", "struct"};
    const auto index = static_cast<std::size_t>(t);
    return index < sizeof(kNames) / sizeof(kNames[0]) ? kNames[index] : "unknown";
}

bool is_valid_type(std::uint8_t t) {
    return t <= static_cast<std::uint8_t>(Type::kStruct);
}

}  // namespace

void CompactReader::fail(const std::string& what) const {
    throw DataError(str(context_, ": corrupt Thrift metadata at byte ", pos_, ": ", what,
                        "; the file is truncated or was not written by a Parquet writer"));
}

std::uint8_t CompactReader::byte() {
    if (pos_ >= size_) fail("unexpected end of data");
    return data_[pos_++];
}

std::uint64_t CompactReader::varint() {
    std::uint64_t result = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        const std::uint8_t b = byte();
        result |= static_cast<std::uint64_t>(b & 0x7f) << shift;
        if ((b & 0x80) == 0) return result;
    }
    fail("varint longer than 10 bytes");
}

void CompactReader::expect(Type got, Type want) {
    if (got != want) fail(str("expected a ", type_name(want), " value, found ", type_name(got)));
}

void CompactReader::enter() {
    if (depth_ >= kMaxDepth) fail(str("nesting deeper than ", kMaxDepth, " levels"));
}

void CompactReader::read_struct(const std::function<void(std::int16_t, Type)>& on_field) {
    enter();
    ++depth_;
    std::int16_t last_id = 0;
    while (true) {
        const std::uint8_t header = byte();
        const std::uint8_t t = header & 0x0f;
        if (t == 0) break;
        if (!is_valid_type(t)) fail(str("unknown field type ", int(t)));
        const std::uint8_t delta = header >> 4;
        std::int64_t id = delta != 0 ? last_id + delta : zigzag();
        if (id < INT16_MIN || id > INT16_MAX) fail(str("field id ", id, " out of range"));
        last_id = static_cast<std::int16_t>(id);
        on_field(last_id, static_cast<Type>(t));
    }
    --depth_;
}

bool CompactReader::read_bool(Type type) {
    if (type == Type::kTrue) return true;
    if (type == Type::kFalse) return false;
    // Inside lists a bool is a whole byte: 1 true, 2 (or 0 from some writers) false.
    if (type == Type::kByte) return byte() == 1;
    fail(str("expected a bool value, found ", type_name(type)));
}

std::int32_t CompactReader::read_i32(Type type) {
    // Thrift may narrow enums and small ints to i16/byte on the wire in some writers; accept them.
    if (type == Type::kByte) return static_cast<std::int8_t>(byte());
    if (type != Type::kI16) expect(type, Type::kI32);
    const std::int64_t v = zigzag();
    if (v < INT32_MIN || v > INT32_MAX) fail(str("i32 value ", v, " out of range"));
    return static_cast<std::int32_t>(v);
}

std::int64_t CompactReader::read_i64(Type type) {
    if (type == Type::kI32 || type == Type::kI16) return zigzag();
    expect(type, Type::kI64);
    return zigzag();
}

double CompactReader::read_double(Type type) {
    expect(type, Type::kDouble);
    if (size_ - pos_ < 8) fail("unexpected end of data in a double");
    double v = 0;
    std::memcpy(&v, data_ + pos_, 8);  // little-endian on every platform we build for
    pos_ += 8;
    return v;
}

std::string CompactReader::read_string(Type type) {
    expect(type, Type::kBinary);
    const std::uint64_t n = varint();
    if (n > size_ - pos_) fail(str("string of ", n, " bytes runs past the end (", size_ - pos_, " left)"));
    std::string s(reinterpret_cast<const char*>(data_ + pos_), static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return s;
}

ListHeader CompactReader::read_list_header(Type type) {
    if (type != Type::kSet) expect(type, Type::kList);
    const std::uint8_t header = byte();
    std::uint64_t n = header >> 4;
    if (n == 15) n = varint();
    const std::uint8_t t = header & 0x0f;
    if (!is_valid_type(t) || t == 0) fail(str("unknown list element type ", int(t)));
    // Compact bools in lists are bytes: normalise the element type so read_bool handles them.
    const Type elem = (t == 1 || t == 2) ? Type::kByte : static_cast<Type>(t);
    if (n > size_ - pos_)
        fail(str("list of ", n, " elements is longer than the remaining ", size_ - pos_, " bytes"));
    return {elem, static_cast<std::size_t>(n)};
}

void CompactReader::skip(Type type) {
    enter();
    ++depth_;
    skip_value(type);
    --depth_;
}

void CompactReader::skip_value(Type type) {
    switch (type) {
        case Type::kTrue:
        case Type::kFalse: return;
        case Type::kByte: byte(); return;
        case Type::kI16:
        case Type::kI32:
        case Type::kI64: varint(); return;
        case Type::kDouble: read_double(type); return;
        case Type::kBinary:
            read_string(type);  // bounded by the buffer; metadata strings are small
            return;
        case Type::kList:
        case Type::kSet: {
            const ListHeader h = read_list_header(type);
            for (std::size_t i = 0; i < h.size; ++i) skip(h.elem_type);
            return;
        }
        case Type::kMap: {
            const std::uint64_t n = varint();
            if (n == 0) return;
            const std::uint8_t kv = byte();
            if (n > size_ - pos_) fail(str("map of ", n, " entries is longer than the remaining bytes"));
            if (!is_valid_type(kv >> 4) || !is_valid_type(kv & 0x0f)) fail("unknown map element type");
            // Booleans inside containers are whole bytes.
            auto as_elem = [](std::uint8_t t) {
                return t == 1 || t == 2 ? Type::kByte : static_cast<Type>(t);
            };
            for (std::uint64_t i = 0; i < n; ++i) {
                skip(as_elem(kv >> 4));
                skip(as_elem(kv & 0x0f));
            }
            return;
        }
        case Type::kStruct: read_struct([&](std::int16_t, Type t) { skip(t); }); return;
        case Type::kStop: break;
    }
    fail(str("cannot skip a value of type ", type_name(type)));
}

}  // namespace dtune::io::thrift
