// CLIP BPE tokenizer: file loading, normalisation, pre-tokenisation and BPE (see the header for
// the pipeline and what it must equal).
#include "models/clip/clip_tokenizer.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/fs.h"
#include "models/clip/unicode_text.h"

namespace dtune::models {
namespace stdfs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kEndOfWord = "</w>";

json read_json_file(const stdfs::path& path, const std::string& what) {
    DTUNE_CHECK_AS(DataError, stdfs::is_regular_file(path), what, " not found: ", path.string(),
                   "; point the tokenizer at a folder holding vocab.json + merges.txt or tokenizer.json");
    try {
        return json::parse(fs::read_file(path));
    } catch (const json::exception& e) {
        throw DataError(str(what, " ", path.string(), " is not valid JSON (", e.what(),
                            "); re-download the tokenizer files"));
    }
}

// A token string from special_tokens_map.json / tokenizer_config.json: a plain string or an
// AddedToken object {"content": ...}.
std::string token_string(const json& value) {
    if (value.is_string()) return value.get<std::string>();
    if (value.is_object() && value.contains("content")) return value["content"].get<std::string>();
    return {};
}

void read_special_tokens(const stdfs::path& dir, CLIPSpecialTokens& special, int& max_length) {
    // tokenizer_config.json first, then special_tokens_map.json (which transformers lets win).
    for (const char* name : {"tokenizer_config.json", "special_tokens_map.json"}) {
        const stdfs::path path = dir / name;
        if (!stdfs::is_regular_file(path)) continue;
        const json j = read_json_file(path, name);
        const auto take = [&](const char* key, std::string& into) {
            if (!j.contains(key)) return;
            std::string s = token_string(j[key]);
            if (!s.empty()) into = s;
        };
        take("bos_token", special.bos);
        take("eos_token", special.eos);
        take("unk_token", special.unk);
        take("pad_token", special.pad);
        // Very large values mean "no limit" in transformers; CLIP's positions cap it anyway.
        if (j.contains("model_max_length") && j["model_max_length"].is_number_integer()) {
            const auto v = j["model_max_length"].get<int64_t>();
            if (v > 2 && v < 100000) max_length = static_cast<int>(v);
        }
    }
}

// GPT-2's reversible byte -> printable code point table: printable Latin-1 bytes map to
// themselves, the others (controls, space, ...) to U+0100 onward in byte order.
void build_byte_table(std::string (&table)[256]) {
    const auto printable = [](int b) {
        return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    int next = 0;
    for (int b = 0; b < 256; ++b) {
        table[b].clear();
        unicode::append_utf8(table[b],
                             printable(b) ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + next++));
    }
}

uint64_t pair_key(int64_t left, int64_t right) {
    return (static_cast<uint64_t>(left) << 32) | static_cast<uint64_t>(right);
}

// CLIP's pre-tokenisation regex as a scanner over lower-cased code points: returns the pieces
// ('s|'t|'re|'ve|'m|'ll|'d|\p{L}+|\p{N}|[^\s\p{L}\p{N}]+), dropping white space between them.
std::vector<std::string> split_pieces(const std::vector<char32_t>& cps) {
    static const std::u32string kContractions[] = {U"'s", U"'t", U"'re", U"'ve", U"'m", U"'ll", U"'d"};
    std::vector<std::string> pieces;
    const std::size_t n = cps.size();
    std::size_t i = 0;
    const auto other = [&](char32_t c) {
        return !unicode::is_space(c) && !unicode::is_letter(c) && !unicode::is_number(c);
    };
    while (i < n) {
        const char32_t c = cps[i];
        std::size_t end = i;
        if (c == U'\'') {  // alternation order: a contraction wins over a punctuation run
            for (const auto& k : kContractions) {
                if (i + k.size() <= n && std::equal(k.begin(), k.end(), cps.begin() + static_cast<long>(i))) {
                    end = i + k.size();
                    break;
                }
            }
        }
        if (end == i) {
            if (unicode::is_letter(c)) {
                while (end < n && unicode::is_letter(cps[end])) ++end;
            } else if (unicode::is_number(c)) {
                end = i + 1;
            } else if (other(c)) {
                while (end < n && other(cps[end])) ++end;
            } else {  // white space: not part of any piece
                ++i;
                continue;
            }
        }
        pieces.push_back(unicode::encode_utf8(
            std::vector<char32_t>(cps.begin() + static_cast<long>(i), cps.begin() + static_cast<long>(end))));
        i = end;
    }
    return pieces;
}

// NFC, white-space runs -> " ", lower case (the reference normaliser's order).
std::vector<char32_t> normalise(std::string_view segment) {
    const std::vector<char32_t> cps = unicode::decode_utf8(unicode::nfc(segment));
    std::vector<char32_t> collapsed;
    collapsed.reserve(cps.size());
    bool in_run = false;  // inside a white-space run, already emitted as one " "
    for (char32_t c : cps) {
        const bool space = unicode::is_space(c);
        if (!space)
            collapsed.push_back(c);
        else if (!in_run)
            collapsed.push_back(U' ');
        in_run = space;
    }
    return unicode::lowercase_each(collapsed);
}

}  // namespace

CLIPTokenizer::CLIPTokenizer(CLIPTokenizer&&) noexcept = default;
CLIPTokenizer& CLIPTokenizer::operator=(CLIPTokenizer&&) noexcept = default;
CLIPTokenizer::~CLIPTokenizer() = default;

CLIPTokenizer CLIPTokenizer::from_folder(const stdfs::path& dir) {
    DTUNE_CHECK_AS(DataError, stdfs::is_directory(dir), "tokenizer folder not found: ", dir.string(),
                   "; pass the pipeline's tokenizer/ or tokenizer_2/ folder");
    CLIPSpecialTokens special;
    int max_length = 77;
    read_special_tokens(dir, special, max_length);
    if (stdfs::is_regular_file(dir / "vocab.json") || stdfs::is_regular_file(dir / "merges.txt"))
        return from_files(dir / "vocab.json", dir / "merges.txt", special, max_length);
    if (stdfs::is_regular_file(dir / "tokenizer.json"))
        return from_tokenizer_json(dir / "tokenizer.json", special, max_length);
    throw DataError(str("tokenizer folder ", dir.string(),
                        " has neither vocab.json + merges.txt nor tokenizer.json; copy the tokenizer files "
                        "from the original model"));
}

CLIPTokenizer CLIPTokenizer::from_files(const stdfs::path& vocab_json, const stdfs::path& merges_txt,
                                        const CLIPSpecialTokens& special, int max_length) {
    CLIPTokenizer tok;
    const json vocab = read_json_file(vocab_json, "vocab file");
    DTUNE_CHECK_AS(DataError, vocab.is_object(), "vocab file ", vocab_json.string(),
                   " must be a JSON object {token: id}; re-download it");
    for (const auto& [token, id] : vocab.items()) {
        DTUNE_CHECK_AS(DataError, id.is_number_integer(), "vocab file ", vocab_json.string(), ": token '",
                       token, "' has a non-integer id; re-download it");
        tok.vocab_.emplace(token, id.get<int64_t>());
    }
    DTUNE_CHECK_AS(DataError, stdfs::is_regular_file(merges_txt),
                   "merges file not found: ", merges_txt.string(),
                   "; a CLIP tokenizer needs vocab.json and merges.txt side by side");
    tok.load_merges(fs::read_file(merges_txt), merges_txt.string(), vocab_json.string(), 0);
    tok.finish_setup(special, max_length, vocab_json.parent_path().string());
    return tok;
}

CLIPTokenizer CLIPTokenizer::from_merges(std::string_view merges_txt, const std::string& source,
                                         const CLIPSpecialTokens& special, int max_length) {
    // OpenAI CLIP's vocabulary rule: the 256 byte symbols (printable ones first, in the order of
    // GPT-2's byte table), the same with "</w>", one entry per merge, then <|startoftext|> and
    // <|endoftext|>: 256 + 256 + 48,894 + 2 = 49,408 ids for CLIP's merges.
    CLIPTokenizer tok;
    build_byte_table(tok.byte_symbol_);
    std::vector<std::string> symbols;
    for (int b = 0; b < 256; ++b)
        if (unicode::decode_utf8(tok.byte_symbol_[b]).front() < 256) symbols.push_back(tok.byte_symbol_[b]);
    for (int b = 0; b < 256; ++b)
        if (unicode::decode_utf8(tok.byte_symbol_[b]).front() >= 256) symbols.push_back(tok.byte_symbol_[b]);
    for (const auto& s : symbols) tok.vocab_.emplace(s, static_cast<int64_t>(tok.vocab_.size()));
    for (const auto& s : symbols) tok.vocab_.emplace(s + kEndOfWord, static_cast<int64_t>(tok.vocab_.size()));
    tok.load_merges(merges_txt, source, source, /*add_to_vocab=*/true);
    for (const char* s : {"<|startoftext|>", "<|endoftext|>"})
        tok.vocab_.emplace(s, static_cast<int64_t>(tok.vocab_.size()));
    tok.finish_setup(special, max_length, source);
    return tok;
}

void CLIPTokenizer::load_merges(std::string_view text, const std::string& source,
                                const std::string& vocab_source, bool add_to_vocab) {
    int64_t line_no = 0;
    int32_t rank = 0;
    for (std::size_t begin = 0; begin < text.size();) {
        std::size_t end = text.find('\n', begin);
        if (end == std::string_view::npos) end = text.size();
        std::string line(text.substr(begin, end - begin));
        begin = end + 1;
        ++line_no;
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
        const auto space = line.find(' ');
        DTUNE_CHECK_AS(DataError,
                       space != std::string::npos && space > 0 && space + 1 < line.size() &&
                           line.find(' ', space + 1) == std::string::npos,
                       "merges file ", source, " line ", line_no, " is '", line,
                       "', expected two symbols separated by one space; re-download merges.txt");
        const std::string left = line.substr(0, space), right = line.substr(space + 1);
        if (add_to_vocab) vocab_.emplace(left + right, static_cast<int64_t>(vocab_.size()));
        const auto l = vocab_.find(left), r = vocab_.find(right), m = vocab_.find(left + right);
        DTUNE_CHECK_AS(DataError, l != vocab_.end() && r != vocab_.end() && m != vocab_.end(), "merges file ",
                       source, " line ", line_no, " ('", line, "') uses a symbol missing from ", vocab_source,
                       "; vocab.json and merges.txt must come from the same tokenizer");
        merges_.emplace(pair_key(l->second, r->second), Merge{rank++, static_cast<int32_t>(m->second)});
    }
}

CLIPTokenizer CLIPTokenizer::from_tokenizer_json(const stdfs::path& tokenizer_json,
                                                 const CLIPSpecialTokens& special, int max_length) {
    CLIPTokenizer tok;
    const json j = read_json_file(tokenizer_json, "tokenizer file");
    const auto bad = [&](const std::string& what) {
        return DataError(
            str("tokenizer file ", tokenizer_json.string(), ": ", what,
                "; expected a `tokenizers` BPE tokenizer.json (or use vocab.json + merges.txt)"));
    };
    if (!j.contains("model") || !j["model"].is_object()) throw bad("no \"model\" object");
    const json& model = j["model"];
    if (model.value("type", "BPE") != "BPE") throw bad("model.type is not BPE");
    if (!model.contains("vocab") || !model["vocab"].is_object()) throw bad("no model.vocab object");
    for (const auto& [token, id] : model["vocab"].items()) tok.vocab_.emplace(token, id.get<int64_t>());
    if (j.contains("added_tokens") && j["added_tokens"].is_array())
        for (const auto& t : j["added_tokens"])
            if (t.contains("content") && t.contains("id"))
                tok.vocab_.emplace(t["content"].get<std::string>(), t["id"].get<int64_t>());
    if (!model.contains("merges") || !model["merges"].is_array()) throw bad("no model.merges array");
    int32_t rank = 0;
    for (const auto& merge : model["merges"]) {
        std::string left, right;
        if (merge.is_string()) {  // older format: "a b"
            const std::string s = merge.get<std::string>();
            const auto space = s.find(' ');
            if (space == std::string::npos) throw bad(str("merge '", s, "' has no space"));
            left = s.substr(0, space);
            right = s.substr(space + 1);
        } else if (merge.is_array() && merge.size() == 2) {  // newer format: ["a", "b"]
            left = merge[0].get<std::string>();
            right = merge[1].get<std::string>();
        } else {
            throw bad(str("merge ", rank, " is neither \"a b\" nor [\"a\", \"b\"]"));
        }
        const auto l = tok.vocab_.find(left), r = tok.vocab_.find(right), m = tok.vocab_.find(left + right);
        if (l == tok.vocab_.end() || r == tok.vocab_.end() || m == tok.vocab_.end())
            throw bad(str("merge '", left, " ", right, "' uses a symbol missing from model.vocab"));
        tok.merges_.emplace(pair_key(l->second, r->second), Merge{rank++, static_cast<int32_t>(m->second)});
    }
    tok.finish_setup(special, max_length, tokenizer_json.string());
    return tok;
}

void CLIPTokenizer::finish_setup(const CLIPSpecialTokens& special, int max_length,
                                 const std::string& source) {
    const auto id_of = [&](const std::string& token, const char* role) {
        const auto it = vocab_.find(token);
        DTUNE_CHECK_AS(DataError, it != vocab_.end(), "tokenizer ", source, ": the ", role, " token '", token,
                       "' is not in the vocabulary; fix special_tokens_map.json / tokenizer_config.json");
        return it->second;
    };
    bos_id_ = id_of(special.bos, "bos");
    eos_id_ = id_of(special.eos, "eos");
    unk_id_ = id_of(special.unk, "unk");
    pad_id_ = id_of(special.pad, "pad");
    DTUNE_CHECK_AS(UsageError, max_length >= 2, "tokenizer ", source, ": model_max_length ", max_length,
                   " leaves no room for BOS and EOS; use 77");
    max_length_ = max_length;
    for (const std::string* s : {&special.bos, &special.eos, &special.unk, &special.pad}) {
        const bool seen =
            std::any_of(specials_.begin(), specials_.end(), [&](const auto& p) { return p.first == *s; });
        if (!seen && !s->empty()) specials_.emplace_back(*s, vocab_.at(*s));
    }
    build_byte_table(byte_symbol_);
    cache_mutex_ = std::make_unique<std::mutex>();
}

int64_t CLIPTokenizer::token_id(const std::string& token) const {
    const auto it = vocab_.find(token);
    DTUNE_CHECK_AS(UsageError, it != vocab_.end(), "token '", token, "' is not in the CLIP vocabulary");
    return it->second;
}

CLIPTokenizer::Ids CLIPTokenizer::bpe(const std::string& piece) const {
    // Symbols start as one byte-mapped char each, the last one carrying the end-of-word suffix.
    std::vector<int64_t> symbols;
    for (std::size_t b = 0; b < piece.size(); ++b) {
        std::string sym = byte_symbol_[static_cast<uint8_t>(piece[b])];
        if (b + 1 == piece.size()) sym += kEndOfWord;
        const auto it = vocab_.find(sym);
        symbols.push_back(it == vocab_.end() ? unk_id_ : it->second);
    }
    // Repeatedly apply the lowest-rank merge present (leftmost on ties), as `tokenizers` does.
    while (symbols.size() > 1) {
        int32_t best_rank = std::numeric_limits<int32_t>::max();
        std::size_t best_at = 0;
        int32_t best_id = -1;
        for (std::size_t i = 0; i + 1 < symbols.size(); ++i) {
            const auto it = merges_.find(pair_key(symbols[i], symbols[i + 1]));
            if (it != merges_.end() && it->second.rank < best_rank) {
                best_rank = it->second.rank;
                best_at = i;
                best_id = it->second.merged_id;
            }
        }
        if (best_id < 0) break;
        symbols[best_at] = best_id;
        symbols.erase(symbols.begin() + static_cast<long>(best_at) + 1);
    }
    return symbols;
}

void CLIPTokenizer::append_piece_ids(const std::string& piece, Ids& out) const {
    {
        std::lock_guard<std::mutex> lock(*cache_mutex_);
        const auto it = cache_.find(piece);
        if (it != cache_.end()) {
            out.insert(out.end(), it->second.begin(), it->second.end());
            return;
        }
    }
    Ids ids = bpe(piece);
    out.insert(out.end(), ids.begin(), ids.end());
    std::lock_guard<std::mutex> lock(*cache_mutex_);
    if (cache_.size() > 200000) cache_.clear();  // bound memory on adversarial caption sets
    cache_.emplace(piece, std::move(ids));
}

void CLIPTokenizer::encode_segment(std::string_view segment, Ids& out) const {
    for (const std::string& piece : split_pieces(normalise(segment))) append_piece_ids(piece, out);
}

CLIPTokenizer::Ids CLIPTokenizer::encode_raw(std::string_view text) const {
    Ids out;
    std::size_t start = 0, i = 0;
    while (i < text.size()) {
        // Leftmost-longest match of a special token at i.
        std::size_t best_len = 0;
        int64_t best_id = 0;
        for (const auto& [s, id] : specials_) {
            if (s.size() > best_len && text.compare(i, s.size(), s) == 0) {
                best_len = s.size();
                best_id = id;
            }
        }
        if (best_len == 0) {
            ++i;
            continue;
        }
        if (i > start) encode_segment(text.substr(start, i - start), out);
        out.push_back(best_id);
        i += best_len;
        start = i;
    }
    if (start < text.size()) encode_segment(text.substr(start), out);
    return out;
}

CLIPTokenizer::Ids CLIPTokenizer::encode(std::string_view text, int max_length) const {
    const auto length = static_cast<std::size_t>(max_length > 0 ? max_length : max_length_);
    DTUNE_CHECK_AS(UsageError, length >= 2, "max_length ", length, " leaves no room for BOS and EOS; use 77");
    const Ids raw = encode_raw(text);
    Ids out;
    out.reserve(length);
    out.push_back(bos_id_);
    const std::size_t keep = std::min(raw.size(), length - 2);
    out.insert(out.end(), raw.begin(), raw.begin() + static_cast<long>(keep));
    out.push_back(eos_id_);
    out.resize(length, pad_id_);
    return out;
}

std::vector<CLIPTokenizer::Ids> CLIPTokenizer::encode_chunked(std::string_view text, int max_chunks) const {
    const auto length = static_cast<std::size_t>(max_length_);
    const std::size_t body = length - 2;
    const Ids raw = encode_raw(text);
    std::vector<Ids> chunks;
    std::size_t at = 0;
    do {
        Ids chunk;
        chunk.reserve(length);
        chunk.push_back(bos_id_);
        const std::size_t take = std::min(body, raw.size() - at);
        chunk.insert(chunk.end(), raw.begin() + static_cast<long>(at),
                     raw.begin() + static_cast<long>(at + take));
        chunk.push_back(eos_id_);
        chunk.resize(length, pad_id_);
        chunks.push_back(std::move(chunk));
        at += take;
    } while (at < raw.size() && (max_chunks <= 0 || static_cast<int>(chunks.size()) < max_chunks));
    return chunks;
}

}  // namespace dtune::models
