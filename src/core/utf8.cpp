#include "core/utf8.h"

#include <cstdint>

namespace dtune {

namespace {

// Length of the sequence led by `b`, 0 for a byte that cannot lead one (C0/C1 would be overlong).
int sequence_length(uint8_t b) {
    if (b < 0x80) return 1;
    if (b >= 0xC2 && b <= 0xDF) return 2;
    if (b >= 0xE0 && b <= 0xEF) return 3;
    if (b >= 0xF0 && b <= 0xF4) return 4;
    return 0;
}

}  // namespace

std::optional<std::size_t> first_invalid_utf8(std::string_view text) {
    const auto* s = reinterpret_cast<const uint8_t*>(text.data());
    const std::size_t n = text.size();
    for (std::size_t i = 0; i < n;) {
        const int len = sequence_length(s[i]);
        if (len == 0 || i + static_cast<std::size_t>(len) > n) return i;
        uint32_t c = len == 1 ? s[i] : (s[i] & (0x7F >> len));
        for (int k = 1; k < len; ++k) {
            if ((s[i + k] & 0xC0) != 0x80) return i;
            c = (c << 6) | (s[i + k] & 0x3F);
        }
        if ((len == 3 && c < 0x800) || (len == 4 && (c < 0x10000 || c > 0x10FFFF)) ||
            (c >= 0xD800 && c < 0xE000))
            return i;
        i += static_cast<std::size_t>(len);
    }
    return std::nullopt;
}

}  // namespace dtune
