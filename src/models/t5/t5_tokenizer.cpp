// T5 unigram tokenizer: spiece.model (protobuf) and tokenizer.json loading, the precompiled
// charsmap normaliser, pre-tokenisation and Viterbi (see the header for what each must equal).
#include "models/t5/t5_tokenizer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>

#include "core/error.h"
#include "core/fs.h"
#include "models/clip/unicode_text.h"

namespace dtune::models {
namespace stdfs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::string_view kSpace = "\xE2\x96\x81";        // U+2581 "▁", SentencePiece's space
constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD, for invalid UTF-8 bytes
constexpr double kUnkPenalty = 10.0;                       // unk score = min score - 10 (both libraries)

// Length of the UTF-8 sequence at text[0], or 0 when it is not a valid one (strict: no overlong
// forms, surrogates or values above U+10FFFF).
std::size_t utf8_length(std::string_view text) {
    const auto b = [&](std::size_t i) { return static_cast<uint8_t>(text[i]); };
    const auto cont = [&](std::size_t i) { return i < text.size() && (b(i) & 0xC0) == 0x80; };
    const uint8_t c = b(0);
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        if (!cont(1) || !cont(2)) return 0;
        if (c == 0xE0 && b(1) < 0xA0) return 0;   // overlong
        if (c == 0xED && b(1) >= 0xA0) return 0;  // surrogate
        return 3;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (!cont(1) || !cont(2) || !cont(3)) return 0;
        if (c == 0xF0 && b(1) < 0x90) return 0;   // overlong
        if (c == 0xF4 && b(1) >= 0x90) return 0;  // > U+10FFFF
        return 4;
    }
    return 0;
}

// Length of one character for stepping through normalised text (always valid UTF-8 there).
std::size_t char_length(std::string_view text) {
    const std::size_t n = utf8_length(text);
    return n == 0 ? 1 : std::min(n, text.size());
}

// ---- protobuf wire format -------------------------------------------------------------------

// A reader over one message's bytes. Errors throw DataError naming `source`.
class WireReader {
  public:
    WireReader(std::string_view data, const std::string& source) : data_(data), source_(source) {}
    bool done() const { return pos_ >= data_.size(); }

    uint64_t varint() {
        uint64_t value = 0;
        for (int shift = 0; shift < 64; shift += 7) {
            need(1);
            const auto byte = static_cast<uint8_t>(data_[pos_++]);
            value |= static_cast<uint64_t>(byte & 0x7F) << shift;
            if ((byte & 0x80) == 0) return value;
        }
        fail("a varint longer than 10 bytes");
    }
    // Next field: number and wire type.
    std::pair<uint32_t, int> tag() {
        const uint64_t t = varint();
        const int type = static_cast<int>(t & 7);
        if (t >> 3 == 0 || t >> 3 > (1u << 29)) fail("field number 0 or out of range");
        return {static_cast<uint32_t>(t >> 3), type};
    }
    std::string_view bytes() {
        const uint64_t n = varint();
        if (n > data_.size() - pos_) fail("a length-delimited field running past the end");
        const std::string_view out = data_.substr(pos_, n);
        pos_ += n;
        return out;
    }
    float fixed32_float() {
        need(4);
        uint32_t bits = 0;
        for (int i = 3; i >= 0; --i) bits = (bits << 8) | static_cast<uint8_t>(data_[pos_ + i]);
        pos_ += 4;
        float f;
        std::memcpy(&f, &bits, 4);
        return f;
    }
    void skip(int type) {
        switch (type) {
            case 0: varint(); return;
            case 1:
                need(8);
                pos_ += 8;
                return;
            case 2: bytes(); return;
            case 5:
                need(4);
                pos_ += 4;
                return;
            default: fail("wire type " + std::to_string(type) + " (not a SentencePiece model)");
        }
    }
    void expect(int got, int want, const char* field) {
        if (got != want) fail(str("field ", field, " with wire type ", got, " instead of ", want));
    }
    [[noreturn]] void fail(const std::string& what) const {
        throw DataError(str("SentencePiece model ", source_, " is corrupt: ", what, " at byte ", pos_,
                            "; re-download spiece.model (or point at the folder's tokenizer.json)"));
    }

  private:
    void need(std::size_t n) const {
        if (n > data_.size() - pos_) fail("truncated data");
    }
    std::string_view data_;
    std::size_t pos_ = 0;
    const std::string& source_;
};

// ---- precompiled charsmap -------------------------------------------------------------------

// SentencePiece's compiled normalisation rules: uint32 (little-endian) trie size in bytes, a
// Darts-clone double array of that many bytes (uint32 units) mapping UTF-8 byte strings to offsets,
// then NUL-terminated replacement strings at those offsets.
class CharsMap {
  public:
    CharsMap() = default;
    CharsMap(std::string_view blob, const std::string& source) {
        const auto bad = [&](const std::string& what) {
            return DataError(str("the precompiled charsmap of ", source, " is corrupt (", what,
                                 "); re-download the tokenizer files"));
        };
        if (blob.size() < 4) throw bad("shorter than its 4-byte header");
        uint32_t trie_bytes = 0;
        for (int i = 3; i >= 0; --i) trie_bytes = (trie_bytes << 8) | static_cast<uint8_t>(blob[i]);
        if (trie_bytes % 4 != 0 || trie_bytes == 0 || trie_bytes > blob.size() - 4)
            throw bad(str("trie size ", trie_bytes, " for a blob of ", blob.size(), " bytes"));
        units_.resize(trie_bytes / 4);
        for (std::size_t u = 0; u < units_.size(); ++u) {
            uint32_t v = 0;
            for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(blob[4 + u * 4 + i]);
            units_[u] = v;
        }
        normalized_.assign(blob.substr(4 + trie_bytes));
        normalized_.push_back('\0');  // every replacement is terminated, even in a damaged blob
    }
    bool empty() const { return units_.empty(); }

    // The longest rule matching a prefix of `text`: (match length in bytes, replacement), or
    // length 0 when none does.
    std::pair<std::size_t, std::string_view> longest_match(std::string_view text) const {
        std::size_t best_len = 0;
        uint32_t best_value = 0;
        // Darts-clone unit fields: label (low byte + bit 31 marking a leaf), has_leaf (bit 8),
        // offset to the children (bits 10.. shifted by 8 more when bit 9 is set), value (leaf).
        const auto offset = [](uint32_t u) { return (u >> 10) << ((u & (1u << 9)) >> 6); };
        std::size_t node = offset(unit(0));
        for (std::size_t i = 0; i < text.size(); ++i) {
            const auto byte = static_cast<uint8_t>(text[i]);
            node ^= byte;
            const uint32_t u = unit(node);
            if ((u & ((1u << 31) | 0xFFu)) != byte) break;
            node ^= offset(u);
            if ((u >> 8) & 1u) {
                best_len = i + 1;
                best_value = unit(node) & ((1u << 31) - 1);
            }
        }
        if (best_len == 0 || best_value >= normalized_.size()) return {0, {}};
        return {best_len, std::string_view(normalized_.c_str() + best_value)};
    }

  private:
    uint32_t unit(std::size_t i) const { return i < units_.size() ? units_[i] : 0u; }  // 0 never matches
    std::vector<uint32_t> units_;
    std::string normalized_;
};

// The charsmap applied at every position (longest rule first); invalid UTF-8 bytes become U+FFFD.
std::string apply_charsmap(const CharsMap& map, std::string_view text) {
    std::string out;
    out.reserve(text.size());
    while (!text.empty()) {
        const auto [len, rep] =
            map.empty() ? std::pair<std::size_t, std::string_view>{0, {}} : map.longest_match(text);
        if (len > 0) {
            out.append(rep);
            text.remove_prefix(len);
            continue;
        }
        const std::size_t n = utf8_length(text);
        if (n == 0) {
            out.append(kReplacement);
            text.remove_prefix(1);
        } else {
            out.append(text.substr(0, n));
            text.remove_prefix(n);
        }
    }
    return out;
}

std::string base64_decode(const std::string& in, const std::string& source) {
    std::string out;
    uint32_t acc = 0;
    int bits = 0;
    for (char ch : in) {
        int v;
        if (ch >= 'A' && ch <= 'Z')
            v = ch - 'A';
        else if (ch >= 'a' && ch <= 'z')
            v = ch - 'a' + 26;
        else if (ch >= '0' && ch <= '9')
            v = ch - '0' + 52;
        else if (ch == '+')
            v = 62;
        else if (ch == '/')
            v = 63;
        else if (ch == '=')
            break;
        else
            throw DataError(
                str(source, ": precompiled_charsmap is not base64; re-download the tokenizer files"));
        acc = (acc << 6) | static_cast<uint32_t>(v);
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out.push_back(static_cast<char>((acc >> bits) & 0xFF));
        }
    }
    return out;
}

// Code points of valid UTF-8 (normalised text); used for Unicode white space tests.
bool space_at(std::string_view text, std::size_t& len) {
    len = char_length(text);
    const std::vector<char32_t> cp = unicode::decode_utf8(text.substr(0, len));
    return cp.size() == 1 && unicode::is_space(cp[0]);
}

}  // namespace

// ---- the model ----------------------------------------------------------------------------------

struct T5Tokenizer::Impl {
    struct Step {  // one tokenizer.json normaliser or pre-tokeniser step
        enum Kind { kCharsMap, kReplace, kStrip, kPrepend, kWhitespaceSplit, kMetaspace } kind;
        std::shared_ptr<const CharsMap> charsmap;  // kCharsMap
        std::optional<std::regex> regex;           // kReplace with a Regex pattern
        std::string pattern, content;      // kReplace (String pattern), kPrepend, Metaspace's replacement
        bool left = false, right = false;  // kStrip
        int prepend = 0;                   // kMetaspace: 0 never, 1 always, 2 first
        bool split = true;                 // kMetaspace
    };

    std::string source;
    bool from_json = false;
    std::unordered_map<std::string, int32_t> pieces;  // matchable pieces -> id
    std::vector<float> scores;                        // per id
    std::vector<uint8_t> user_defined;                // per id (spiece.model USER_DEFINED)
    std::size_t max_piece_bytes = 0;
    double unk_score = 0, max_score = 0;
    int64_t unk_id = -1;
    // spiece.model
    CharsMap charsmap;
    bool add_dummy_prefix = true, remove_extra_whitespaces = true, escape_whitespaces = true;
    // tokenizer.json
    std::vector<Step> normalizers, pre_tokenizers;
    std::vector<std::pair<std::string, int64_t>> added;  // split out of raw text

    void finish() {
        for (const auto& [piece, id] : pieces) max_piece_bytes = std::max(max_piece_bytes, piece.size());
    }

    // Viterbi over `text`, appending ids (consecutive unks merged) to `out`.
    void viterbi(std::string_view text, Ids& out) const {
        const std::size_t n = text.size();
        if (n == 0) return;
        struct Best {
            double score = 0;
            std::size_t start = 0;
            int64_t id = -1;
            bool set = false;
        };
        std::vector<Best> best(n + 1);
        best[0].set = true;
        std::string key;
        for (std::size_t start = 0; start < n;) {
            const std::size_t first = char_length(text.substr(start));
            if (!best[start].set) {  // unreachable only for damaged input; step on
                start += first;
                continue;
            }
            const double base = best[start].score;
            bool single = false;
            // Candidate pieces end at character boundaries, shortest first (sentencepiece's order).
            for (std::size_t end = start + first; end <= n && end - start <= max_piece_bytes;) {
                key.assign(text.substr(start, end - start));
                const auto it = pieces.find(key);
                if (it != pieces.end()) {
                    const int32_t id = it->second;
                    const double s = user_defined[static_cast<std::size_t>(id)]
                                         ? static_cast<double>(end - start) * max_score - 0.1
                                         : static_cast<double>(scores[static_cast<std::size_t>(id)]);
                    Best& b = best[end];
                    if (!b.set || base + s > b.score) b = {base + s, start, id, true};
                    if (end == start + first) single = true;
                }
                if (end == n) break;
                end += char_length(text.substr(end));
            }
            if (!single) {
                Best& b = best[start + first];
                if (!b.set || base + unk_score > b.score) b = {base + unk_score, start, unk_id, true};
            }
            start += first;
        }
        Ids path;
        for (std::size_t end = n; end > 0;) {
            const Best& b = best[end];
            if (!b.set) break;  // cannot happen: the unk node reaches every boundary
            path.push_back(b.id);
            end = b.start;
        }
        std::reverse(path.begin(), path.end());
        for (std::size_t i = 0; i < path.size(); ++i) {
            if (path[i] == unk_id && i > 0 && path[i - 1] == unk_id) continue;
            out.push_back(path[i]);
        }
    }

    // sentencepiece's Normalizer::Normalize.
    std::string normalize_spm(std::string_view input) const {
        std::string out;
        const std::string space = escape_whitespaces ? std::string(kSpace) : std::string(" ");
        const auto next = [&](std::string_view in) -> std::pair<std::size_t, std::string> {
            const auto [len, rep] = charsmap.empty() ? std::pair<std::size_t, std::string_view>{0, {}}
                                                     : charsmap.longest_match(in);
            if (len > 0) return {len, std::string(rep)};
            const std::size_t u = utf8_length(in);
            if (u == 0) return {1, std::string(kReplacement)};
            return {u, std::string(in.substr(0, u))};
        };
        if (remove_extra_whitespaces) {  // leading white space (after normalisation)
            while (!input.empty()) {
                const auto [len, rep] = next(input);
                if (rep != " ") break;
                input.remove_prefix(len);
            }
        }
        if (input.empty()) return out;
        if (add_dummy_prefix) out += space;
        bool prev_space = remove_extra_whitespaces;
        while (!input.empty()) {
            auto [len, rep] = next(input);
            std::string_view sp = rep;
            if (prev_space)
                while (!sp.empty() && sp.front() == ' ') sp.remove_prefix(1);
            if (!sp.empty()) {
                for (char ch : sp) {
                    if (escape_whitespaces && ch == ' ')
                        out += kSpace;
                    else
                        out += ch;
                }
                prev_space = sp.back() == ' ';
            }
            input.remove_prefix(len);
            prev_space = prev_space && remove_extra_whitespaces;
        }
        if (remove_extra_whitespaces)
            while (out.size() >= space.size() &&
                   out.compare(out.size() - space.size(), space.size(), space) == 0)
                out.resize(out.size() - space.size());
        return out;
    }

    // tokenizer.json: normaliser steps, then pre-tokeniser steps -> words.
    std::vector<std::string> words_json(std::string_view segment, bool at_text_start) const {
        std::string text;
        // Raw text is made valid UTF-8 first (Python strings always are).
        for (std::string_view in = segment; !in.empty();) {
            const std::size_t u = utf8_length(in);
            text.append(u == 0 ? kReplacement : in.substr(0, u));
            in.remove_prefix(u == 0 ? 1 : u);
        }
        for (const Step& s : normalizers) {
            switch (s.kind) {
                case Step::kCharsMap: text = apply_charsmap(*s.charsmap, text); break;
                case Step::kReplace:
                    if (s.regex) {
                        text = std::regex_replace(text, *s.regex, s.content);
                    } else if (!s.pattern.empty()) {
                        std::string r;
                        for (std::size_t p = 0;;) {
                            const std::size_t q = text.find(s.pattern, p);
                            r.append(text, p, q == std::string::npos ? std::string::npos : q - p);
                            if (q == std::string::npos) break;
                            r += s.content;
                            p = q + s.pattern.size();
                        }
                        text = std::move(r);
                    }
                    break;
                case Step::kStrip: {
                    std::size_t len = 0;
                    if (s.left)
                        while (!text.empty() && space_at(text, len)) text.erase(0, len);
                    if (s.right) {
                        while (!text.empty()) {  // last character
                            std::size_t p = text.size() - 1;
                            while (p > 0 && (static_cast<uint8_t>(text[p]) & 0xC0) == 0x80) --p;
                            if (!space_at(std::string_view(text).substr(p), len)) break;
                            text.resize(p);
                        }
                    }
                    break;
                }
                case Step::kPrepend:
                    if (!text.empty()) text = s.content + text;
                    break;
                default: break;
            }
        }
        // Pre-tokens with "starts the raw text" flags (for Metaspace's "first").
        std::vector<std::pair<std::string, bool>> parts{{text, at_text_start}};
        for (const Step& s : pre_tokenizers) {
            std::vector<std::pair<std::string, bool>> next;
            for (auto& [part, starts] : parts) {
                if (s.kind == Step::kWhitespaceSplit) {
                    std::string_view v = part;
                    std::size_t word_start = 0, pos = 0, len = 0;
                    while (pos < v.size()) {
                        if (space_at(v.substr(pos), len)) {
                            if (pos > word_start)
                                next.emplace_back(std::string(v.substr(word_start, pos - word_start)),
                                                  starts && word_start == 0);
                            pos += len;
                            word_start = pos;
                        } else {
                            pos += len;
                        }
                    }
                    if (pos > word_start)
                        next.emplace_back(std::string(v.substr(word_start)), starts && word_start == 0);
                } else if (s.kind == Step::kMetaspace) {
                    std::string w;
                    for (char ch : part) {
                        if (ch == ' ')
                            w += s.content;
                        else
                            w += ch;
                    }
                    const bool prepend = s.prepend == 1 || (s.prepend == 2 && starts);
                    if (prepend && w.compare(0, s.content.size(), s.content) != 0) w = s.content + w;
                    if (!s.split || s.content.empty()) {
                        next.emplace_back(std::move(w), starts);
                        continue;
                    }
                    // Split before every replacement character (merged with the next piece).
                    std::size_t piece_start = 0;
                    for (std::size_t p = 0; p < w.size();) {
                        if (p > piece_start && w.compare(p, s.content.size(), s.content) == 0) {
                            next.emplace_back(w.substr(piece_start, p - piece_start),
                                              starts && piece_start == 0);
                            piece_start = p;
                        }
                        p += w.compare(p, s.content.size(), s.content) == 0
                                 ? s.content.size()
                                 : char_length(std::string_view(w).substr(p));
                    }
                    if (piece_start < w.size())
                        next.emplace_back(w.substr(piece_start), starts && piece_start == 0);
                }
            }
            parts = std::move(next);
        }
        std::vector<std::string> words;
        for (auto& [w, starts] : parts)
            if (!w.empty()) words.push_back(std::move(w));
        return words;
    }

    Ids encode_raw(std::string_view text) const {
        Ids out;
        if (!from_json) {
            viterbi(normalize_spm(text), out);
            return out;
        }
        // Added tokens first: leftmost match, the longest at that position.
        std::size_t pos = 0, seg_start = 0;
        const auto flush = [&](std::size_t end) {
            if (end > seg_start)
                for (const std::string& w :
                     words_json(text.substr(seg_start, end - seg_start), seg_start == 0))
                    viterbi(w, out);
        };
        while (pos < text.size()) {
            const std::pair<std::string, int64_t>* hit = nullptr;
            for (const auto& a : added)
                if (!a.first.empty() && text.compare(pos, a.first.size(), a.first) == 0 &&
                    (hit == nullptr || a.first.size() > hit->first.size()))
                    hit = &a;
            if (hit == nullptr) {
                ++pos;
                continue;
            }
            flush(pos);
            out.push_back(hit->second);
            pos += hit->first.size();
            seg_start = pos;
        }
        flush(text.size());
        return out;
    }
};

namespace {

using Impl = T5Tokenizer::Impl;

void load_spiece(Impl& m, const std::string& data) {
    WireReader r(data, m.source);
    double min_score = std::numeric_limits<double>::infinity();
    double max_score = -std::numeric_limits<double>::infinity();
    std::string model_type_error;
    while (!r.done()) {
        const auto [field, type] = r.tag();
        if (field == 1) {  // repeated SentencePiece pieces
            r.expect(type, 2, "pieces");
            WireReader p(r.bytes(), m.source);
            std::string piece;
            float score = 0;
            uint64_t kind = 1;  // NORMAL
            while (!p.done()) {
                const auto [f, t] = p.tag();
                if (f == 1) {
                    p.expect(t, 2, "piece");
                    piece.assign(p.bytes());
                } else if (f == 2) {
                    p.expect(t, 5, "score");
                    score = p.fixed32_float();
                } else if (f == 3) {
                    p.expect(t, 0, "type");
                    kind = p.varint();
                } else {
                    p.skip(t);
                }
            }
            const auto id = static_cast<int32_t>(m.scores.size());
            m.scores.push_back(score);
            m.user_defined.push_back(kind == 4 ? 1 : 0);
            if (kind == 6)
                throw DataError(
                    str("SentencePiece model ", m.source, " uses byte fallback (piece '", piece,
                        "'), which the T5 tokenizer does not support; T5's spiece.model has none"));
            if (kind == 2) m.unk_id = id;
            if (kind == 1 || kind == 4 || kind == 5) {
                if (!m.pieces.emplace(piece, kind == 5 ? -1 : id).second)
                    throw DataError(str("SentencePiece model ", m.source, " lists piece '", piece,
                                        "' twice; re-download spiece.model"));
            }  // CONTROL / UNKNOWN pieces are never matched in text
            if (kind == 1) {
                min_score = std::min(min_score, static_cast<double>(score));
                max_score = std::max(max_score, static_cast<double>(score));
            }
        } else if (field == 2) {  // TrainerSpec: model_type (3) must be UNIGRAM (1, the default)
            r.expect(type, 2, "trainer_spec");
            WireReader t(r.bytes(), m.source);
            while (!t.done()) {
                const auto [f, wt] = t.tag();
                if (f == 3 && wt == 0) {
                    const uint64_t v = t.varint();
                    if (v != 1) {
                        static const char* kNames[] = {"?", "UNIGRAM", "BPE", "WORD", "CHAR"};
                        model_type_error = v < 5 ? kNames[v] : std::to_string(v);
                    }
                } else {
                    t.skip(wt);
                }
            }
        } else if (field == 3) {  // NormalizerSpec
            r.expect(type, 2, "normalizer_spec");
            WireReader n(r.bytes(), m.source);
            while (!n.done()) {
                const auto [f, wt] = n.tag();
                if (f == 2 && wt == 2)
                    m.charsmap = CharsMap(n.bytes(), m.source);
                else if (f == 3 && wt == 0)
                    m.add_dummy_prefix = n.varint() != 0;
                else if (f == 4 && wt == 0)
                    m.remove_extra_whitespaces = n.varint() != 0;
                else if (f == 5 && wt == 0)
                    m.escape_whitespaces = n.varint() != 0;
                else
                    n.skip(wt);
            }
        } else {
            r.skip(type);
        }
    }
    if (!model_type_error.empty())
        throw DataError(str("SentencePiece model ", m.source, " is a ", model_type_error,
                            " model; the T5 tokenizer reads unigram models only"));
    if (m.scores.empty())
        throw DataError(str("SentencePiece model ", m.source,
                            " has no pieces (not a SentencePiece model?); re-download spiece.model"));
    for (auto it = m.pieces.begin(); it != m.pieces.end();)  // UNUSED pieces never match
        it = it->second < 0 ? m.pieces.erase(it) : std::next(it);
    if (m.unk_id < 0)
        throw DataError(
            str("SentencePiece model ", m.source, " has no UNKNOWN piece; re-download spiece.model"));
    m.unk_score = (std::isfinite(min_score) ? min_score : 0.0) - kUnkPenalty;
    m.max_score = std::isfinite(max_score) ? max_score : 0.0;
}

void add_normalizer(const json& j, const std::string& source, std::vector<Impl::Step>& out) {
    if (j.is_null()) return;
    const std::string type = j.value("type", "");
    Impl::Step s{};
    if (type == "Sequence") {
        for (const json& n : j.at("normalizers")) add_normalizer(n, source, out);
        return;
    } else if (type == "Precompiled") {
        s.kind = Impl::Step::kCharsMap;
        const json& cm = j.at("precompiled_charsmap");
        if (cm.is_null()) return;  // no rules: the identity
        s.charsmap = std::make_shared<CharsMap>(base64_decode(cm.get<std::string>(), source), source);
    } else if (type == "Replace") {
        s.kind = Impl::Step::kReplace;
        const json& p = j.at("pattern");
        s.content = j.at("content").get<std::string>();
        if (p.contains("String")) {
            s.pattern = p["String"].get<std::string>();
        } else if (p.contains("Regex")) {
            const std::string re = p["Regex"].get<std::string>();
            try {
                s.regex.emplace(re, std::regex::ECMAScript);
            } catch (const std::regex_error& e) {
                throw DataError(str(source, ": the Replace normalizer's regex '", re,
                                    "' is not supported here (", e.what(), "); use spiece.model instead"));
            }
        } else {
            throw DataError(str(source, ": a Replace normalizer without a String or Regex pattern"));
        }
    } else if (type == "Strip") {
        s.kind = Impl::Step::kStrip;
        s.left = j.value("strip_left", j.value("left", false));
        s.right = j.value("strip_right", j.value("right", false));
    } else if (type == "Prepend") {
        s.kind = Impl::Step::kPrepend;
        s.content = j.at("prepend").get<std::string>();
    } else {
        throw DataError(str(source, ": normalizer type '", type,
                            "' is not supported by the T5 tokenizer (Precompiled, Replace, Strip, Prepend, "
                            "Sequence are); load the folder's spiece.model instead"));
    }
    out.push_back(std::move(s));
}

void add_pre_tokenizer(const json& j, const std::string& source, std::vector<Impl::Step>& out) {
    if (j.is_null()) return;
    const std::string type = j.value("type", "");
    Impl::Step s{};
    if (type == "Sequence") {
        for (const json& p : j.at("pretokenizers")) add_pre_tokenizer(p, source, out);
        return;
    } else if (type == "WhitespaceSplit") {
        s.kind = Impl::Step::kWhitespaceSplit;
    } else if (type == "Metaspace") {
        s.kind = Impl::Step::kMetaspace;
        s.content = j.value("replacement", std::string(kSpace));
        s.split = j.value("split", true);
        if (j.contains("prepend_scheme")) {
            const std::string scheme = j["prepend_scheme"].get<std::string>();
            if (scheme == "always")
                s.prepend = 1;
            else if (scheme == "first")
                s.prepend = 2;
            else if (scheme == "never")
                s.prepend = 0;
            else
                throw DataError(str(source, ": Metaspace prepend_scheme '", scheme, "' is unknown"));
        } else {
            s.prepend = j.value("add_prefix_space", true) ? 1 : 0;
        }
    } else {
        throw DataError(
            str(source, ": pre_tokenizer type '", type,
                "' is not supported by the T5 tokenizer (Metaspace, WhitespaceSplit, Sequence are); "
                "load the folder's spiece.model instead"));
    }
    out.push_back(std::move(s));
}

void load_tokenizer_json(Impl& m, const std::string& data) {
    json j;
    try {
        j = json::parse(data);
    } catch (const json::exception& e) {
        throw DataError(str("tokenizer file ", m.source, " is not valid JSON (", e.what(),
                            "); re-download the tokenizer files"));
    }
    try {
        const json& model = j.at("model");
        const std::string type = model.value("type", "");
        if (type != "Unigram")
            throw DataError(
                str("tokenizer file ", m.source, " has model type '", type,
                    "'; the T5 tokenizer needs a SentencePiece Unigram model (T5's tokenizer_2)"));
        if (model.value("byte_fallback", false))
            throw DataError(str("tokenizer file ", m.source,
                                " uses byte_fallback, which the T5 tokenizer does not support"));
        const json& vocab = model.at("vocab");
        double min_score = std::numeric_limits<double>::infinity();
        double max_score = -std::numeric_limits<double>::infinity();
        for (const json& entry : vocab) {
            const auto id = static_cast<int32_t>(m.scores.size());
            const std::string piece = entry.at(0).get<std::string>();
            const double score = entry.at(1).get<double>();
            m.scores.push_back(static_cast<float>(score));
            m.user_defined.push_back(0);
            m.pieces.emplace(piece, id);  // `tokenizers` keeps the first of duplicates too
            min_score = std::min(min_score, score);
            max_score = std::max(max_score, score);
        }
        if (m.scores.empty())
            throw DataError(str("tokenizer file ", m.source, " has an empty Unigram vocabulary"));
        m.unk_score = min_score - kUnkPenalty;
        m.max_score = max_score;
        if (!model.contains("unk_id") || model["unk_id"].is_null())
            throw DataError(str("tokenizer file ", m.source,
                                " has no unk_id; the T5 tokenizer maps unknown characters to it"));
        m.unk_id = model["unk_id"].get<int64_t>();
        if (m.unk_id < 0 || m.unk_id >= static_cast<int64_t>(m.scores.size()))
            throw DataError(
                str("tokenizer file ", m.source, ": unk_id ", m.unk_id, " is outside the vocabulary"));
        if (j.contains("added_tokens"))
            for (const json& a : j["added_tokens"])
                m.added.emplace_back(a.at("content").get<std::string>(), a.at("id").get<int64_t>());
        add_normalizer(j.value("normalizer", json()), m.source, m.normalizers);
        add_pre_tokenizer(j.value("pre_tokenizer", json()), m.source, m.pre_tokenizers);
    } catch (const json::exception& e) {
        throw DataError(str("tokenizer file ", m.source, " is malformed (", e.what(),
                            "); re-download the tokenizer files"));
    }
}

}  // namespace

T5Tokenizer::T5Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
T5Tokenizer::T5Tokenizer(T5Tokenizer&&) noexcept = default;
T5Tokenizer& T5Tokenizer::operator=(T5Tokenizer&&) noexcept = default;
T5Tokenizer::~T5Tokenizer() = default;

T5Tokenizer T5Tokenizer::load(const stdfs::path& path) {
    stdfs::path file = path;
    if (stdfs::is_directory(path)) {
        if (stdfs::is_regular_file(path / "tokenizer.json"))
            file = path / "tokenizer.json";
        else if (stdfs::is_regular_file(path / "spiece.model"))
            file = path / "spiece.model";
        else
            throw DataError(
                str("T5 tokenizer folder ", path.string(),
                    " has neither tokenizer.json nor spiece.model; pass Flux's tokenizer_2/ folder"));
    }
    DTUNE_CHECK_AS(DataError, stdfs::is_regular_file(file), "T5 tokenizer file not found: ", file.string(),
                   "; pass a tokenizer.json, a spiece.model or the folder holding them (Flux: tokenizer_2/)");
    auto m = std::make_unique<Impl>();
    m->source = file.string();
    std::string data;
    try {
        data = fs::read_file(file);
    } catch (const std::exception& e) {
        throw DataError(str("T5 tokenizer file ", file.string(), " cannot be read: ", e.what()));
    }
    m->from_json = file.extension() == ".json";
    if (m->from_json)
        load_tokenizer_json(*m, data);
    else
        load_spiece(*m, data);
    m->finish();
    T5Tokenizer tok(std::move(m));
    const auto special = [&](const char* piece) -> int64_t {
        for (const auto& [text, id] : tok.impl_->added)
            if (text == piece) return id;
        if (tok.impl_->from_json) {
            const auto it = tok.impl_->pieces.find(piece);
            if (it != tok.impl_->pieces.end()) return it->second;
        }
        return -1;
    };
    tok.unk_id_ = tok.impl_->unk_id;
    tok.vocab_size_ = tok.impl_->scores.size();
    if (tok.impl_->from_json) {
        tok.eos_id_ = special("</s>");
        tok.pad_id_ = special("<pad>");
    } else {
        // CONTROL pieces are not matchable; find them by text among all pieces.
        tok.eos_id_ = tok.pad_id_ = -1;
        WireReader r(data, tok.impl_->source);
        int64_t id = 0;
        while (!r.done()) {
            const auto [field, type] = r.tag();
            if (field != 1) {
                r.skip(type);
                continue;
            }
            WireReader p(r.bytes(), tok.impl_->source);
            while (!p.done()) {
                const auto [f, t] = p.tag();
                if (f == 1 && t == 2) {
                    const std::string_view piece = p.bytes();
                    if (piece == "</s>" && tok.eos_id_ < 0) tok.eos_id_ = id;
                    if (piece == "<pad>" && tok.pad_id_ < 0) tok.pad_id_ = id;
                } else {
                    p.skip(t);
                }
            }
            ++id;
        }
    }
    DTUNE_CHECK_AS(DataError, tok.eos_id_ >= 0, "T5 tokenizer ", file.string(),
                   " has no '</s>' piece; T5 appends it to every prompt");
    DTUNE_CHECK_AS(DataError, tok.pad_id_ >= 0, "T5 tokenizer ", file.string(),
                   " has no '<pad>' piece; T5 pads prompts with it");
    return tok;
}

T5Tokenizer::Ids T5Tokenizer::encode(const std::string& text) const {
    Ids ids = impl_->encode_raw(text);
    ids.push_back(eos_id_);
    return ids;
}

T5Tokenizer::Ids T5Tokenizer::encode(const std::string& text, int64_t max_length) const {
    DTUNE_CHECK_AS(UsageError, max_length >= 1, "T5 tokenizer: max_length must be at least 1 (got ",
                   max_length, "); Flux uses 512 ([dev]) or 256 ([schnell])");
    Ids ids = encode(text);
    const auto n = static_cast<std::size_t>(max_length);
    if (ids.size() > n) {
        ids.resize(n);
        ids.back() = eos_id_;
    }
    ids.resize(n, pad_id_);
    return ids;
}

at::Tensor T5Tokenizer::encode_batch(const std::vector<std::string>& texts, int64_t max_length) const {
    at::Tensor out = at::empty({static_cast<int64_t>(texts.size()), max_length}, at::kLong);
    int64_t* data = out.data_ptr<int64_t>();
    for (std::size_t b = 0; b < texts.size(); ++b) {
        const Ids ids = encode(texts[b], max_length);
        std::copy(ids.begin(), ids.end(), data + static_cast<int64_t>(b) * max_length);
    }
    return out;
}

at::Tensor T5Tokenizer::attention_mask(const std::vector<std::string>& texts, int64_t max_length) const {
    DTUNE_CHECK_AS(UsageError, max_length >= 1, "T5 tokenizer: max_length must be at least 1 (got ",
                   max_length, ")");
    at::Tensor out = at::zeros({static_cast<int64_t>(texts.size()), max_length}, at::kLong);
    int64_t* data = out.data_ptr<int64_t>();
    for (std::size_t b = 0; b < texts.size(); ++b) {
        const auto n = std::min<int64_t>(static_cast<int64_t>(encode(texts[b]).size()), max_length);
        std::fill(data + static_cast<int64_t>(b) * max_length,
                  data + static_cast<int64_t>(b) * max_length + n, 1);
    }
    return out;
}

int64_t T5Tokenizer::piece_id(const std::string& piece) const {
    const auto it = impl_->pieces.find(piece);
    DTUNE_CHECK_AS(UsageError, it != impl_->pieces.end(), "T5 tokenizer ", impl_->source, " has no piece '",
                   piece, "'");
    return it->second;
}

}  // namespace dtune::models
