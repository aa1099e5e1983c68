// CLIP tokenizer against transformers' ids in reference/tokenizer_cases.json: every case, both
// SDXL tokenizers, with and without special tokens, exact equality.
#include <gtest/gtest.h>

#include <atomic>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.h"
#include "core/fs.h"
#include "models/clip/clip_tokenizer.h"
#include "support/test_support.h"

namespace dtune::models {
namespace {

nlohmann::json load_cases() {
    return nlohmann::json::parse(fs::read_file(test::fixtures_dir() / "reference" / "tokenizer_cases.json"));
}

std::string show(const std::string& text) {
    return "text: \"" + text + "\"";
}

}  // namespace

TEST(CLIPTokenizerParity, EveryCaseMatchesTransformers) {
    const auto root = test::fixtures_dir() / "tiny-sdxl";
    const CLIPTokenizer tok1 = CLIPTokenizer::from_folder(root / "tokenizer");
    const CLIPTokenizer tok2 = CLIPTokenizer::from_folder(root / "tokenizer_2");
    const auto cases = load_cases()["cases"];
    ASSERT_EQ(cases.size(), 15u);
    for (const auto& c : cases) {
        const std::string text = c["text"];
        EXPECT_EQ(tok1.encode_raw(text), c["ids_no_special"].get<std::vector<int64_t>>()) << show(text);
        EXPECT_EQ(tok1.encode(text), c["ids_tokenizer"].get<std::vector<int64_t>>()) << show(text);
        EXPECT_EQ(tok2.encode(text), c["ids_tokenizer_2"].get<std::vector<int64_t>>()) << show(text);
    }
}

TEST(CLIPTokenizerParity, SpecialTokensComeFromTheFolder) {
    const auto root = test::fixtures_dir() / "tiny-sdxl";
    const CLIPTokenizer tok1 = CLIPTokenizer::from_folder(root / "tokenizer");
    const CLIPTokenizer tok2 = CLIPTokenizer::from_folder(root / "tokenizer_2");
    // Values stated by the fixtures README: tokenizer pads with <|endoftext|>, tokenizer_2 with "!".
    EXPECT_EQ(tok1.pad_id(), 49407);
    EXPECT_EQ(tok2.pad_id(), 0);
    EXPECT_EQ(tok1.bos_id(), 49406);
    EXPECT_EQ(tok1.eos_id(), 49407);
    EXPECT_EQ(tok1.vocab_size(), 49408u);
    EXPECT_EQ(tok1.model_max_length(), 77);
}

TEST(CLIPTokenizerParity, ChunkedLongPromptCoversEveryToken) {
    const auto root = test::fixtures_dir() / "tiny-sdxl";
    const CLIPTokenizer tok = CLIPTokenizer::from_folder(root / "tokenizer");
    const auto cases = load_cases()["cases"];
    const std::string text = cases[13]["text"];  // the >77-token prompt
    const auto raw = cases[13]["ids_no_special"].get<std::vector<int64_t>>();
    const auto chunks = tok.encode_chunked(text);
    ASSERT_EQ(chunks.size(), (raw.size() + 74) / 75);
    std::vector<int64_t> joined;
    for (const auto& ch : chunks) {
        ASSERT_EQ(ch.size(), 77u);
        EXPECT_EQ(ch.front(), 49406);
        const auto eos = std::find(ch.begin() + 1, ch.end(), 49407);
        ASSERT_NE(eos, ch.end());
        joined.insert(joined.end(), ch.begin() + 1, eos);
    }
    EXPECT_EQ(joined, raw);
    // The first chunk is exactly the ordinary truncated encoding.
    EXPECT_EQ(chunks[0], cases[13]["ids_tokenizer"].get<std::vector<int64_t>>());
    EXPECT_EQ(tok.encode_chunked(text, 1).size(), 1u);
    EXPECT_EQ(tok.encode_chunked("").size(), 1u);
}

}  // namespace dtune::models

namespace dtune::models {

TEST(CLIPTokenizerParity, NormalisationEquivalencesOfTheReferencePipeline) {
    // Consequences of the reference normaliser (NFC, \s+ -> " ", lower case) that need no
    // reference run: decomposed accents compose, any Unicode white space separates, upper case folds.
    const CLIPTokenizer tok = CLIPTokenizer::from_folder(test::fixtures_dir() / "tiny-sdxl" / "tokenizer");
    EXPECT_EQ(tok.encode_raw("cafe\xCC\x81"), tok.encode_raw("caf\xC3\xA9"));    // e + U+0301 == é
    EXPECT_EQ(tok.encode_raw("a\xC2\xA0photo"), tok.encode_raw("a photo"));      // U+00A0
    EXPECT_EQ(tok.encode_raw("a\xE3\x80\x80photo"), tok.encode_raw("a photo"));  // U+3000
    EXPECT_EQ(tok.encode_raw("CAF\xC3\x89 \xC3\x9C"), tok.encode_raw("caf\xC3\xA9 \xC3\xBC"));  // É Ü
    EXPECT_EQ(tok.encode_raw("<|endoftext|>"), (CLIPTokenizer::Ids{49407}));  // special split
    EXPECT_THROW(tok.encode_raw("bad \xFF utf8"), DataError);
}

TEST(CLIPTokenizerParity, ConcurrentEncodingAgreesWithSerial) {
    const CLIPTokenizer tok = CLIPTokenizer::from_folder(test::fixtures_dir() / "tiny-sdxl" / "tokenizer_2");
    const auto cases = load_cases()["cases"];
    std::vector<std::thread> threads;
    std::atomic<int> mismatches{0};
    for (int t = 0; t < 4; ++t)
        threads.emplace_back([&] {
            for (int round = 0; round < 3; ++round)
                for (const auto& c : cases)
                    if (tok.encode(c["text"].get<std::string>()) !=
                        c["ids_tokenizer_2"].get<std::vector<int64_t>>())
                        ++mismatches;
        });
    for (auto& th : threads) th.join();
    EXPECT_EQ(mismatches.load(), 0);
}

}  // namespace dtune::models
