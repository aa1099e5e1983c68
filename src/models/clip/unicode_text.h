// The Unicode operations CLIP's tokenizer needs: UTF-8 decoding, NFC, per-code-point lower-casing,
// white-space collapsing and the letter/number general categories of the pre-tokenisation regex.
//
// NFC, case mapping and categories come from ICU (the Unicode consortium's library, on every
// Debian/Ubuntu system) rather than hand-written tables: NFC needs the full canonical composition
// data and the regex every L*/N* category of current Unicode, which ICU keeps up to date. ICU is
// loaded at run time (see unicode_text.cpp for why), so building needs no ICU package; running the
// tokenizer on non-ASCII text needs libicuuc. This header exposes only std types.
//
// Invariant: every function takes and returns valid UTF-8; invalid input bytes throw DataError
// (the caller names the prompt).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace dtune::models::unicode {

// Decodes UTF-8 into code points; throws DataError on malformed sequences.
std::vector<char32_t> decode_utf8(std::string_view text);
std::string encode_utf8(const std::vector<char32_t>& code_points);
void append_utf8(std::string& out, char32_t code_point);

// Canonical composition (NFC), as the `tokenizers` NFC normaliser does.
std::string nfc(std::string_view text);

// Full lower-case mapping applied one code point at a time (no context such as Greek final
// sigma), which is what Rust's char::to_lowercase, used by `tokenizers`, does.
std::vector<char32_t> lowercase_each(const std::vector<char32_t>& code_points);

// Unicode White_Space (what Oniguruma's \s matches in UTF-8 mode).
bool is_space(char32_t c);
bool is_letter(char32_t c);  // General_Category L (Lu Ll Lt Lm Lo)
bool is_number(char32_t c);  // General_Category N (Nd Nl No)

}  // namespace dtune::models::unicode
