// The safetensors header: parsing and validation, with no libtorch dependency (so the fuzzer and
// tools can use it alone).
//
// File layout: 8-byte little-endian header length N, N bytes of JSON, then the data buffer.
// The JSON maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative
// to the data buffer) plus an optional "__metadata__" object of string to string.
//
// Invariants after parse_header() returns: every tensor's [begin, end) lies inside the data
// buffer, its byte size equals numel x element size (no overflow), no two tensors overlap, and
// names are unique. Anything else throws DataError naming the file and the fault.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace dtune::io {

enum class StDType { F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U8, BOOL };

// "F32" -> StDType::F32; throws DataError for an unknown or unsupported name.
StDType st_dtype_from_name(std::string_view name, std::string_view file_for_errors);
const char* st_dtype_name(StDType dtype);
std::size_t st_dtype_size(StDType dtype);

struct TensorInfo {
    std::string name;
    StDType dtype;
    std::vector<int64_t> shape;
    uint64_t begin = 0;  // byte offsets inside the data buffer
    uint64_t end = 0;
    uint64_t numel() const;
    uint64_t nbytes() const { return end - begin; }
};

struct SafetensorsHeader {
    std::vector<TensorInfo> tensors;  // in file order of data offsets
    std::map<std::string, std::string> metadata;
    uint64_t data_offset = 0;  // where the data buffer starts in the file (8 + N)
    uint64_t data_size = 0;    // file size - data_offset
};

// Largest header we accept; the reference implementation uses the same cap against hostile files.
inline constexpr uint64_t kMaxHeaderBytes = 100ull * 1024 * 1024;

// `bytes` is the start of the file, `file_size` its full length (bytes must cover at least
// min(file_size, 8 + N)). `file` only names the file in error messages.
SafetensorsHeader parse_safetensors_header(const uint8_t* bytes, std::size_t available, uint64_t file_size,
                                           std::string_view file);

// Serialises a header JSON for the given tensors (offsets already assigned) and metadata,
// padded with spaces so the data buffer starts 8-byte aligned. Returns the 8-byte length prefix
// followed by the JSON.
std::string build_safetensors_header(const std::vector<TensorInfo>& tensors,
                                     const std::map<std::string, std::string>& metadata);

}  // namespace dtune::io
