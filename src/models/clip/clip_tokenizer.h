// CLIP's byte-level BPE tokenizer, equal (id for id) to transformers' CLIPTokenizer (the
// `tokenizers`-backed one that diffusers' SDXL pipelines load).
//
// Pipeline of encode(), in the reference's order:
//   1. special-token split: the special strings (BOS, EOS, UNK, PAD — e.g. "!" for SDXL's
//      tokenizer_2) are cut out of the raw text, leftmost-longest, and map straight to their ids;
//   2. per remaining segment: NFC, every run of white space -> one " ", per-code-point lower case;
//   3. pre-tokenisation: the matches of
//        's|'t|'re|'ve|'m|'ll|'d|\p{L}+|\p{N}|[^\s\p{L}\p{N}]+
//      (white space between matches is dropped; one digit per piece);
//   4. each piece's UTF-8 bytes mapped through GPT-2's byte->printable-char table, "</w>" appended
//      to the last symbol, then BPE merges by rank (cached per piece);
//   5. with special tokens: BOS + ids[:max_length-2] + EOS, padded with the pad id to max_length.
//
// Long prompts: encode_chunked() is the common "chunked" scheme (A1111, compel, SimpleTuner's
// long-prompt option): the unpadded ids are cut into chunks of max_length-2 tokens, each chunk
// is wrapped in BOS/EOS and padded to max_length, so an encoder sees several ordinary 77-token
// windows whose hidden states the caller concatenates along the sequence. It is opt-in; encode()
// truncates, as diffusers does.
//
// Thread safety: encode*() may be called concurrently (the BPE cache is mutex-guarded).
// Torch-free on purpose: the data layer's caption cache can use it with no model code.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace dtune::models {

struct CLIPSpecialTokens {
    std::string bos = "<|startoftext|>";
    std::string eos = "<|endoftext|>";
    std::string unk = "<|endoftext|>";
    std::string pad = "<|endoftext|>";
};

class CLIPTokenizer {
  public:
    using Ids = std::vector<int64_t>;

    // A tokenizer folder: vocab.json + merges.txt, or tokenizer.json; special tokens and
    // model_max_length from special_tokens_map.json / tokenizer_config.json when present.
    // Throws DataError naming the folder and the missing/malformed file.
    static CLIPTokenizer from_folder(const std::filesystem::path& dir);
    static CLIPTokenizer from_files(const std::filesystem::path& vocab_json,
                                    const std::filesystem::path& merges_txt,
                                    const CLIPSpecialTokens& special = {}, int max_length = 77);
    // CLIP's merges.txt alone: the vocabulary follows from the merges by OpenAI CLIP's rule (byte
    // symbols, the same with "</w>", one entry per merge, then BOS and EOS), which is exactly
    // CLIP's vocab.json. `source` names the merges in errors.
    static CLIPTokenizer from_merges(std::string_view merges_txt, const std::string& source,
                                     const CLIPSpecialTokens& special = {}, int max_length = 77);
    // A `tokenizers` tokenizer.json (model.type "BPE").
    static CLIPTokenizer from_tokenizer_json(const std::filesystem::path& tokenizer_json,
                                             const CLIPSpecialTokens& special = {}, int max_length = 77);

    // Ids of the text with no BOS/EOS, no truncation, no padding.
    Ids encode_raw(std::string_view text) const;
    // BOS + ids + EOS, truncated (EOS kept last) and padded to `max_length` (<= 0: model_max_length).
    Ids encode(std::string_view text, int max_length = 0) const;
    // The chunked long-prompt encoding (see the file comment); at least one chunk, each
    // model_max_length long. `max_chunks` > 0 caps the count (later tokens are dropped).
    std::vector<Ids> encode_chunked(std::string_view text, int max_chunks = 0) const;

    int64_t bos_id() const { return bos_id_; }
    int64_t eos_id() const { return eos_id_; }
    int64_t pad_id() const { return pad_id_; }
    int model_max_length() const { return max_length_; }
    std::size_t vocab_size() const { return vocab_.size(); }
    // The id of a vocabulary entry (e.g. "cat</w>"); throws UsageError when absent.
    int64_t token_id(const std::string& token) const;

    CLIPTokenizer(CLIPTokenizer&&) noexcept;
    CLIPTokenizer& operator=(CLIPTokenizer&&) noexcept;
    ~CLIPTokenizer();

  private:
    CLIPTokenizer() = default;
    void finish_setup(const CLIPSpecialTokens& special, int max_length, const std::string& source);
    // merges.txt lines -> merges_ by rank; `add_to_vocab` gives each merge result the next id first.
    void load_merges(std::string_view text, const std::string& source, const std::string& vocab_source,
                     bool add_to_vocab);
    void append_piece_ids(const std::string& piece, Ids& out) const;
    Ids bpe(const std::string& piece) const;
    void encode_segment(std::string_view segment, Ids& out) const;

    struct Merge {
        int32_t rank;
        int32_t merged_id;
    };
    std::unordered_map<std::string, int64_t> vocab_;
    std::unordered_map<uint64_t, Merge> merges_;             // (left id << 32 | right id) -> rank, result
    std::vector<std::pair<std::string, int64_t>> specials_;  // split out of raw text
    int64_t bos_id_ = 0, eos_id_ = 0, pad_id_ = 0, unk_id_ = 0;
    int max_length_ = 77;
    std::string byte_symbol_[256];  // GPT-2 byte -> printable char, as UTF-8
    mutable std::unique_ptr<std::mutex> cache_mutex_;
    mutable std::unordered_map<std::string, Ids> cache_;
};

}  // namespace dtune::models
