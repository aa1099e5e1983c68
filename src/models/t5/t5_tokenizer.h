// T5's SentencePiece *unigram* tokenizer (google/t5-v1_1-xxl, Flux.1's tokenizer_2): ids equal to
// sentencepiece's `sp.encode(text) + [eos]` for a spiece.model, and to transformers' T5 tokenizer
// (the `tokenizers`-backed one diffusers' Flux pipelines load) for a tokenizer.json.
//
// Two inputs, one model:
//   * spiece.model — a SentencePiece ModelProto, read with a small protobuf wire-format reader
//     (pieces: string, float score, type; normalizer spec: precompiled charsmap, add_dummy_prefix,
//     remove_extra_whitespaces, escape_whitespaces). Normalisation is sentencepiece's: at every
//     position the longest rule of the precompiled charsmap (a Darts double-array trie over UTF-8
//     bytes + a blob of replacement strings; "nmt_nfkc" is NFKC plus T5's white-space and
//     control-character rules) replaces its match, invalid UTF-8 bytes become U+FFFD, white-space runs
//     collapse to one, leading/trailing ones go, a "▁" is prepended and every " " becomes "▁".
//     Viterbi then runs over the whole normalised string.
//   * tokenizer.json with model "Unigram" — transformers 5 writes normalizer Precompiled and
//     pre_tokenizer Sequence[WhitespaceSplit, Metaspace("▁", "always", split)]; the files on the
//     Hub (older converter) have normalizer Sequence[Precompiled, Replace(" {2,}" -> " ")] and
//     pre_tokenizer Metaspace alone. Supported steps: normalizers Precompiled, Replace (String or an
//     ECMAScript-compatible Regex, applied to the UTF-8 bytes), Strip, Prepend, Sequence;
//     pre-tokenizers WhitespaceSplit, Metaspace (prepend_scheme always/first/never or the older
//     add_prefix_space, split true/false), Sequence. Anything else is refused naming the file and the
//     type. The added tokens ("</s>", "<pad>", "<unk>", "<extra_id_N>") are cut out of the raw text
//     first (leftmost, longest) and map straight to their ids, as `tokenizers` does; sentencepiece
//     has no such step and tokenises their characters (the one known disagreement between the two
//     references, see tools/ref/gen_t5_tokenizer_ref.py). Viterbi runs per pre-token.
//     Known approximation: `tokenizers`' Precompiled applies the charsmap per grapheme cluster
//     (whole cluster when shorter than 6 bytes, else per code point) where sentencepiece takes the
//     longest rule at each position; both are done here the sentencepiece way. They differ only
//     where a charsmap rule would span a grapheme boundary or a cluster of 6+ bytes would match
//     as a whole (e.g. some Hangul jamo sequences); every case in the reference data agrees.
//     "first" prepends the "▁" only to a pre-token that starts the raw text.
//
// Viterbi: the path over the lattice of vocabulary pieces (CONTROL/UNKNOWN pieces excluded for
// spiece.model; UNUSED pieces skipped) that maximises the sum of piece scores, sums in double,
// ties going to the first path found (sentencepiece's order: end positions ascending, start
// positions ascending). A character no piece covers becomes the unk id with score
// min(normal scores) - 10; consecutive unks merge into one. Byte fallback is refused.
//
// Post-processing as T5's tokenizer: eos ("</s>") appended; with max_length, truncated keeping the
// eos last and padded with the pad id ("<pad>"); the Flux pipelines use max_length 512 ([dev]) or
// 256 ([schnell]).
//
// Thread safety: const methods may be called concurrently (no caches).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace dtune::models {

class T5Tokenizer {
  public:
    using Ids = std::vector<int64_t>;

    // `path`: a tokenizer.json, a spiece.model, or a folder holding either (tokenizer.json wins,
    // as in transformers). Throws DataError naming the path when the file is missing, unreadable,
    // corrupt, or not a unigram model (naming the model type).
    static T5Tokenizer load(const std::filesystem::path& path);

    // Ids of the text with eos appended; no truncation, no padding.
    Ids encode(const std::string& text) const;
    // encode(), truncated to max_length (eos kept last) and padded with the pad id; max_length >= 1.
    Ids encode(const std::string& text, int64_t max_length) const;
    // [B, max_length] int64 on the CPU: encode(text, max_length) per row.
    at::Tensor encode_batch(const std::vector<std::string>& texts, int64_t max_length) const;
    // [B, max_length] int64: 1 where encode_batch has a token (eos included), 0 on padding.
    at::Tensor attention_mask(const std::vector<std::string>& texts, int64_t max_length) const;

    int64_t pad_id() const { return pad_id_; }
    int64_t eos_id() const { return eos_id_; }
    int64_t unk_id() const { return unk_id_; }
    std::size_t vocab_size() const { return vocab_size_; }
    // The id of a piece (e.g. "▁cat"); throws UsageError when the vocabulary lacks it.
    int64_t piece_id(const std::string& piece) const;

    T5Tokenizer(T5Tokenizer&&) noexcept;
    T5Tokenizer& operator=(T5Tokenizer&&) noexcept;
    ~T5Tokenizer();

    struct Impl;  // the loaded model and normalisation steps (t5_tokenizer.cpp)

  private:
    explicit T5Tokenizer(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
    int64_t pad_id_ = 0, eos_id_ = 1, unk_id_ = 2;
    std::size_t vocab_size_ = 0;
};

}  // namespace dtune::models
