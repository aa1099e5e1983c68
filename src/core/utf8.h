// UTF-8 validation shared by the caption reader (which names the file at fault) and the CLIP
// tokenizer's decoder (which refuses text it cannot tokenize).
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

namespace dtune {

// Offset of the first byte that does not lead or continue a valid UTF-8 sequence, or nothing when
// the whole text is valid. Strict: overlong forms, surrogates and values above U+10FFFF are invalid.
std::optional<std::size_t> first_invalid_utf8(std::string_view text);

}  // namespace dtune
