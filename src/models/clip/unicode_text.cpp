// ICU-backed implementation of unicode_text.h. ICU works in UTF-16, so text crosses that boundary
// here and nowhere else.
#include "models/clip/unicode_text.h"

#include <unicode/uchar.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>
#include <unicode/utf8.h>

#include "core/error.h"

namespace dtune::models::unicode {
namespace {

std::u16string to_utf16(std::string_view text) {
    int32_t needed = 0;
    UErrorCode status = U_ZERO_ERROR;
    u_strFromUTF8(nullptr, 0, &needed, text.data(), static_cast<int32_t>(text.size()), &status);
    if (status != U_BUFFER_OVERFLOW_ERROR && U_FAILURE(status))
        throw DataError(
            str("text is not valid UTF-8 (", u_errorName(status), "); re-save the prompt as UTF-8"));
    std::u16string out(static_cast<std::size_t>(needed), u'\0');
    status = U_ZERO_ERROR;
    u_strFromUTF8(reinterpret_cast<UChar*>(out.data()), needed, nullptr, text.data(),
                  static_cast<int32_t>(text.size()), &status);
    DTUNE_CHECK_AS(DataError, U_SUCCESS(status), "text is not valid UTF-8 (", u_errorName(status),
                   "); re-save the prompt as UTF-8");
    return out;
}

std::string to_utf8(const std::u16string& text) {
    int32_t needed = 0;
    UErrorCode status = U_ZERO_ERROR;
    const auto* src = reinterpret_cast<const UChar*>(text.data());
    u_strToUTF8(nullptr, 0, &needed, src, static_cast<int32_t>(text.size()), &status);
    std::string out(static_cast<std::size_t>(needed), '\0');
    status = U_ZERO_ERROR;
    u_strToUTF8(out.data(), needed, nullptr, src, static_cast<int32_t>(text.size()), &status);
    DTUNE_CHECK(U_SUCCESS(status), "UTF-16 to UTF-8 conversion failed: ", u_errorName(status));
    return out;
}

}  // namespace

std::vector<char32_t> decode_utf8(std::string_view text) {
    std::vector<char32_t> out;
    out.reserve(text.size());
    const auto* s = reinterpret_cast<const uint8_t*>(text.data());
    const auto length = static_cast<int32_t>(text.size());
    int32_t i = 0;
    while (i < length) {
        UChar32 c = 0;
        const int32_t at = i;
        U8_NEXT(s, i, length, c);
        DTUNE_CHECK_AS(DataError, c >= 0, "text is not valid UTF-8 at byte ", at,
                       "; re-save the prompt as UTF-8");
        out.push_back(static_cast<char32_t>(c));
    }
    return out;
}

void append_utf8(std::string& out, char32_t code_point) {
    const auto c = static_cast<uint32_t>(code_point);
    if (c < 0x80) {
        out += static_cast<char>(c);
    } else if (c < 0x800) {
        out += static_cast<char>(0xC0 | (c >> 6));
        out += static_cast<char>(0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
        out += static_cast<char>(0xE0 | (c >> 12));
        out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (c & 0x3F));
    } else {
        out += static_cast<char>(0xF0 | (c >> 18));
        out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
        out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (c & 0x3F));
    }
}

std::string encode_utf8(const std::vector<char32_t>& code_points) {
    std::string out;
    out.reserve(code_points.size());
    for (char32_t c : code_points) append_utf8(out, c);
    return out;
}

std::string nfc(std::string_view text) {
    UErrorCode status = U_ZERO_ERROR;
    const UNormalizer2* normalizer = unorm2_getNFCInstance(&status);
    DTUNE_CHECK(U_SUCCESS(status), "ICU has no NFC data (", u_errorName(status), "); reinstall libicu");
    const std::u16string in = to_utf16(text);
    const auto* src = reinterpret_cast<const UChar*>(in.data());
    const auto length = static_cast<int32_t>(in.size());
    // The common case (ASCII prompts) is already normalised; skip the copy.
    if (unorm2_isNormalized(normalizer, src, length, &status) && U_SUCCESS(status)) return std::string(text);
    status = U_ZERO_ERROR;
    const int32_t needed = unorm2_normalize(normalizer, src, length, nullptr, 0, &status);
    std::u16string out(static_cast<std::size_t>(needed), u'\0');
    status = U_ZERO_ERROR;
    unorm2_normalize(normalizer, src, length, reinterpret_cast<UChar*>(out.data()), needed, &status);
    DTUNE_CHECK(U_SUCCESS(status), "NFC normalisation failed: ", u_errorName(status));
    return to_utf8(out);
}

std::vector<char32_t> lowercase_each(const std::vector<char32_t>& code_points) {
    std::vector<char32_t> out;
    out.reserve(code_points.size());
    for (char32_t c : code_points) {
        if (c < 0x80) {  // fast path, and the only path for ASCII prompts
            out.push_back((c >= 'A' && c <= 'Z') ? c + ('a' - 'A') : c);
            continue;
        }
        // One code point in isolation, root locale: the full (possibly expanding) mapping
        // without context, e.g. U+0130 -> "i" + U+0307, U+03A3 -> U+03C3 always.
        UChar in[2];
        int32_t in_len = 0;
        U16_APPEND_UNSAFE(in, in_len, static_cast<UChar32>(c));
        UChar lowered[8];
        UErrorCode status = U_ZERO_ERROR;
        const int32_t n = u_strToLower(lowered, 8, in, in_len, "", &status);
        DTUNE_CHECK(U_SUCCESS(status), "lower-casing U+", std::hex, static_cast<uint32_t>(c),
                    " failed: ", u_errorName(status));
        for (int32_t i = 0; i < n;) {
            UChar32 d = 0;
            U16_NEXT(lowered, i, n, d);
            out.push_back(static_cast<char32_t>(d));
        }
    }
    return out;
}

bool is_space(char32_t c) {
    return u_isUWhiteSpace(static_cast<UChar32>(c)) != 0;
}

bool is_letter(char32_t c) {
    return (U_GET_GC_MASK(static_cast<UChar32>(c)) & U_GC_L_MASK) != 0;
}

bool is_number(char32_t c) {
    return (U_GET_GC_MASK(static_cast<UChar32>(c)) & U_GC_N_MASK) != 0;
}

}  // namespace dtune::models::unicode
