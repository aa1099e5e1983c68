// libFuzzer target: the safetensors header parser must reject any malformed input with a
// dtune::Error, never crash, hang or read out of bounds. Built by scripts/fuzz.sh with clang.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "io/safetensors_header.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    try {
        auto header = dtune::io::parse_safetensors_header(data, size, size, "fuzz-input");
        // Invariants the parser promises: every tensor lies inside the data buffer.
        for (const auto& t : header.tensors) {
            if (t.end > header.data_size || t.begin > t.end) __builtin_trap();
        }
        // Serialising what we parsed must be parseable again.
        std::string again = dtune::io::build_safetensors_header(header.tensors, header.metadata);
        std::string file = again + std::string(header.data_size, '\0');
        dtune::io::parse_safetensors_header(reinterpret_cast<const uint8_t*>(file.data()), file.size(),
                                            file.size(), "fuzz-roundtrip");
    } catch (const dtune::Error&) {
    }
    return 0;
}
