// safetensors header parsing and validation (no libtorch).
#include "io/safetensors_header.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "core/error.h"

namespace dtune::io {
namespace {

using nlohmann::json;

struct DTypeRow {
    StDType dtype;
    const char* name;
    std::size_t size;
};

constexpr DTypeRow kDTypes[] = {
    {StDType::F64, "F64", 8},   {StDType::F32, "F32", 4},         {StDType::F16, "F16", 2},
    {StDType::BF16, "BF16", 2}, {StDType::F8_E4M3, "F8_E4M3", 1}, {StDType::F8_E5M2, "F8_E5M2", 1},
    {StDType::I64, "I64", 8},   {StDType::I32, "I32", 4},         {StDType::I16, "I16", 2},
    {StDType::I8, "I8", 1},     {StDType::U8, "U8", 1},           {StDType::BOOL, "BOOL", 1},
};

[[noreturn]] void bad(std::string_view file, const std::string& what) {
    throw DataError(str("safetensors file '", file, "': ", what,
                        "; the file is corrupt or truncated: re-download or re-export it"));
}

bool mul_overflows(uint64_t a, uint64_t b, uint64_t* out) {
    return __builtin_mul_overflow(a, b, out);
}

TensorInfo parse_entry(const std::string& name, const json& entry, uint64_t data_size,
                       std::string_view file) {
    if (!entry.is_object()) bad(file, str("entry '", name, "' is not an object"));
    TensorInfo info;
    info.name = name;
    auto dt = entry.find("dtype");
    if (dt == entry.end() || !dt->is_string()) bad(file, str("tensor '", name, "' has no string \"dtype\""));
    info.dtype = st_dtype_from_name(dt->get<std::string>(), file);

    auto shape = entry.find("shape");
    if (shape == entry.end() || !shape->is_array())
        bad(file, str("tensor '", name, "' has no \"shape\" array"));
    uint64_t numel = 1;
    for (const json& d : *shape) {
        if (!d.is_number_unsigned())
            bad(file, str("tensor '", name, "' has a shape entry that is not a non-negative integer"));
        const uint64_t dim = d.get<uint64_t>();
        if (dim > static_cast<uint64_t>(INT64_MAX) || mul_overflows(numel, dim, &numel))
            bad(file, str("tensor '", name, "' has a shape whose element count overflows"));
        info.shape.push_back(static_cast<int64_t>(dim));
    }

    auto offsets = entry.find("data_offsets");
    if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
        !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned())
        bad(file, str("tensor '", name, "' has no \"data_offsets\" pair of non-negative integers"));
    info.begin = (*offsets)[0].get<uint64_t>();
    info.end = (*offsets)[1].get<uint64_t>();
    if (info.begin > info.end)
        bad(file, str("tensor '", name, "' has data_offsets [", info.begin, ", ", info.end,
                      "] that run backwards"));
    if (info.end > data_size)
        bad(file, str("tensor '", name, "' ends at byte ", info.end,
                      " of the data buffer but the buffer holds only ", data_size, " bytes"));
    uint64_t expected = 0;
    if (mul_overflows(numel, st_dtype_size(info.dtype), &expected) || expected != info.end - info.begin)
        bad(file, str("tensor '", name, "' (", st_dtype_name(info.dtype), ", ", numel, " elements) needs ",
                      expected, " bytes but its data_offsets span ", info.end - info.begin));
    return info;
}

}  // namespace

StDType st_dtype_from_name(std::string_view name, std::string_view file) {
    for (const auto& row : kDTypes)
        if (name == row.name) return row.dtype;
    throw DataError(
        str("safetensors file '", file, "': dtype '", name,
            "' is not supported (supported: F64 F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 I16 I8 U8 BOOL); ",
            "convert the tensor to one of these"));
}

const char* st_dtype_name(StDType dtype) {
    for (const auto& row : kDTypes)
        if (row.dtype == dtype) return row.name;
    return "?";
}

std::size_t st_dtype_size(StDType dtype) {
    for (const auto& row : kDTypes)
        if (row.dtype == dtype) return row.size;
    return 0;
}

uint64_t TensorInfo::numel() const {
    uint64_t n = 1;
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    return n;
}

SafetensorsHeader parse_safetensors_header(const uint8_t* bytes, std::size_t available, uint64_t file_size,
                                           std::string_view file) {
    if (file_size < 8)
        bad(file, str("it is ", file_size, " bytes long, shorter than the 8-byte header length"));
    if (available < 8) bad(file, "the 8-byte header length could not be read");
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];  // little endian
    if (n > kMaxHeaderBytes) bad(file, str("the header claims ", n, " bytes, more than the 100 MiB limit"));
    if (n > file_size - 8)
        bad(file, str("the header claims ", n, " bytes but only ", file_size - 8, " follow"));
    if (available < 8 + n) bad(file, "the header could not be read in full");

    const char* text = reinterpret_cast<const char*>(bytes + 8);
    json root = json::parse(text, text + n, nullptr, /*allow_exceptions=*/false);
    if (root.is_discarded()) bad(file, "the header is not valid JSON");
    if (!root.is_object()) bad(file, "the header is not a JSON object");

    SafetensorsHeader header;
    header.data_offset = 8 + n;
    header.data_size = file_size - header.data_offset;
    for (auto it = root.begin(); it != root.end(); ++it) {
        if (it.key() == "__metadata__") {
            if (!it->is_object()) bad(file, "\"__metadata__\" is not an object");
            for (auto m = it->begin(); m != it->end(); ++m) {
                if (!m->is_string()) bad(file, str("metadata value '", m.key(), "' is not a string"));
                header.metadata[m.key()] = m->get<std::string>();
            }
            continue;
        }
        header.tensors.push_back(parse_entry(it.key(), *it, header.data_size, file));
    }
    // nlohmann's object keeps unique keys (a duplicate key overwrites), so names are unique here.
    std::sort(header.tensors.begin(), header.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
        return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    for (std::size_t i = 1; i < header.tensors.size(); ++i) {
        const TensorInfo& prev = header.tensors[i - 1];
        const TensorInfo& cur = header.tensors[i];
        // Zero-sized tensors occupy no bytes and cannot overlap anything.
        if (cur.begin < prev.end && cur.nbytes() > 0)
            bad(file, str("tensors '", prev.name, "' and '", cur.name, "' overlap in the data buffer"));
    }
    return header;
}

std::string build_safetensors_header(const std::vector<TensorInfo>& tensors,
                                     const std::map<std::string, std::string>& metadata) {
    json root = json::object();
    if (!metadata.empty()) root["__metadata__"] = metadata;
    for (const TensorInfo& t : tensors) {
        root[t.name] = {
            {"dtype", st_dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
    }
    std::string text = root.dump();
    while ((8 + text.size()) % 8 != 0) text.push_back(' ');
    std::string out(8, '\0');
    uint64_t n = text.size();
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return out + text;
}

}  // namespace dtune::io
