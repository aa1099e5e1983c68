// Implementation of unicode_text.h: UTF-8 coding and White_Space are ours; NFC, lower-casing and
// general categories come from ICU's C library, resolved at run time.
//
// Why dlopen instead of linking: ICU renames every exported symbol with its major version
// (u_charType_72), so code must be compiled against headers of exactly the installed version, and
// the GPU machines ship libicuuc.so.74 without headers (Debian dev boxes have 72). The C ABI of the
// five functions below has been stable since ICU 4.4; resolving them by name + version suffix (as
// .NET's System.Globalization.Native does) lets one build run against any installed ICU, with no
// -dev package at build time.
#include "models/clip/unicode_text.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "core/utf8.h"

namespace dtune::models::unicode {
namespace {

using UErrorCode = int;  // ICU's enum: 0 = success, > 0 = failure, < 0 = warning
struct UNormalizer2;

struct IcuApi {
    int8_t (*char_type)(int32_t) = nullptr;  // u_charType -> UCharCategory
    const UNormalizer2* (*nfc_instance)(UErrorCode*) = nullptr;
    int32_t (*normalize)(const UNormalizer2*, const char16_t*, int32_t, char16_t*, int32_t,
                         UErrorCode*) = nullptr;
    int32_t (*to_lower)(char16_t*, int32_t, const char16_t*, int32_t, const char*, UErrorCode*) = nullptr;
    const char* (*error_name)(UErrorCode) = nullptr;
    const UNormalizer2* nfc = nullptr;
};

template <typename Fn>
bool resolve(void* lib, const std::string& name, const std::string& suffix, Fn& into) {
    into = reinterpret_cast<Fn>(dlsym(lib, (name + suffix).c_str()));
    return into != nullptr;
}

IcuApi load_icu() {
    // Newest first; an unversioned library (a custom build without renaming) is tried last.
    for (int version = 90; version >= 50; --version) {
        const std::string so = "libicuuc.so." + std::to_string(version);
        void* lib = dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (lib == nullptr) continue;
        for (const std::string& suffix : {"_" + std::to_string(version), std::string()}) {
            IcuApi api;
            if (resolve(lib, "u_charType", suffix, api.char_type) &&
                resolve(lib, "unorm2_getNFCInstance", suffix, api.nfc_instance) &&
                resolve(lib, "unorm2_normalize", suffix, api.normalize) &&
                resolve(lib, "u_strToLower", suffix, api.to_lower) &&
                resolve(lib, "u_errorName", suffix, api.error_name)) {
                UErrorCode status = 0;
                api.nfc = api.nfc_instance(&status);
                DTUNE_CHECK(status <= 0 && api.nfc != nullptr, so, " has no NFC data (",
                            api.error_name(status), "); reinstall the ICU package");
                return api;
            }
        }
        dlclose(lib);
    }
    throw Error(
        "the CLIP tokenizer needs ICU's libicuuc.so.<version> (Unicode normalisation and categories) and "
        "none "
        "was found; install the libicu package of your distribution (Debian 12: libicu72, Ubuntu 24.04: "
        "libicu74)");
}

const IcuApi& icu() {
    static const IcuApi api = load_icu();  // thread-safe one-time initialisation
    return api;
}

std::u16string to_utf16(const std::vector<char32_t>& cps) {
    std::u16string out;
    out.reserve(cps.size());
    for (char32_t c : cps) {
        if (c < 0x10000) {
            out += static_cast<char16_t>(c);
        } else {
            out += static_cast<char16_t>(0xD800 + ((c - 0x10000) >> 10));
            out += static_cast<char16_t>(0xDC00 + ((c - 0x10000) & 0x3FF));
        }
    }
    return out;
}

std::vector<char32_t> from_utf16(const char16_t* s, int32_t n) {
    std::vector<char32_t> out;
    for (int32_t i = 0; i < n; ++i) {
        const char32_t hi = s[i];
        if (hi >= 0xD800 && hi < 0xDC00 && i + 1 < n && s[i + 1] >= 0xDC00 && s[i + 1] < 0xE000) {
            out.push_back(0x10000 + ((hi - 0xD800) << 10) + (s[i + 1] - 0xDC00));
            ++i;
        } else {
            out.push_back(hi);
        }
    }
    return out;
}

}  // namespace

std::vector<char32_t> decode_utf8(std::string_view text) {
    if (const auto at = first_invalid_utf8(text))
        throw DataError(str("text is not valid UTF-8 at byte ", *at, "; re-save the prompt as UTF-8"));
    std::vector<char32_t> out;
    out.reserve(text.size());
    const auto* s = reinterpret_cast<const uint8_t*>(text.data());
    for (std::size_t i = 0; i < text.size();) {
        // Valid (checked above): the lead byte gives the length.
        const int len = s[i] < 0x80 ? 1 : s[i] < 0xE0 ? 2 : s[i] < 0xF0 ? 3 : 4;
        char32_t c = len == 1 ? s[i] : (s[i] & (0x7F >> len));
        for (int k = 1; k < len; ++k) c = (c << 6) | (s[i + k] & 0x3F);
        out.push_back(c);
        i += static_cast<std::size_t>(len);
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
    const bool ascii =
        std::all_of(text.begin(), text.end(), [](char ch) { return static_cast<uint8_t>(ch) < 0x80; });
    if (ascii) return std::string(text);  // ASCII is already NFC; skips ICU for most prompts
    const std::u16string in = to_utf16(decode_utf8(text));
    const IcuApi& api = icu();
    const auto length = static_cast<int32_t>(in.size());
    UErrorCode status = 0;
    // Composition never lengthens beyond 3x in UTF-16 (Unicode's stated NFC bound); retry if ICU asks.
    std::u16string out(static_cast<std::size_t>(length) * 3 + 8, u'\0');
    int32_t n =
        api.normalize(api.nfc, in.data(), length, out.data(), static_cast<int32_t>(out.size()), &status);
    if (status > 0 && n > static_cast<int32_t>(out.size())) {
        out.assign(static_cast<std::size_t>(n), u'\0');
        status = 0;
        n = api.normalize(api.nfc, in.data(), length, out.data(), n, &status);
    }
    DTUNE_CHECK(status <= 0, "NFC normalisation failed: ", api.error_name(status));
    return encode_utf8(from_utf16(out.data(), n));
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
        const std::u16string in = to_utf16({c});
        char16_t lowered[8];
        UErrorCode status = 0;
        const IcuApi& api = icu();
        const int32_t n = api.to_lower(lowered, 8, in.data(), static_cast<int32_t>(in.size()), "", &status);
        DTUNE_CHECK(status <= 0 && n <= 8, "lower-casing U+", std::hex, static_cast<uint32_t>(c),
                    " failed: ", api.error_name(status));
        for (char32_t d : from_utf16(lowered, n)) out.push_back(d);
    }
    return out;
}

bool is_space(char32_t c) {
    // The Unicode White_Space property (PropList.txt; unchanged since Unicode 6.3).
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
           c == 0x3000;
}

// UCharCategory values: 1-5 are Lu Ll Lt Lm Lo, 9-11 are Nd Nl No (stable ICU enum).
bool is_letter(char32_t c) {
    if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
    const int8_t t = icu().char_type(static_cast<int32_t>(c));
    return t >= 1 && t <= 5;
}

bool is_number(char32_t c) {
    if (c < 0x80) return c >= '0' && c <= '9';
    const int8_t t = icu().char_type(static_cast<int32_t>(c));
    return t >= 9 && t <= 11;
}

}  // namespace dtune::models::unicode
