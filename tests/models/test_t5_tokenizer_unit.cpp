// T5 unigram tokenizer against sentencepiece and transformers: tools/ref/gen_t5_tokenizer_ref.py
// trained a tiny unigram SentencePiece model (tests/data/ref/tiny-t5-tokenizer: spiece.model and
// the tokenizer.json transformers made from it) and wrote every case's ids from both libraries
// (t5_tokenizer_cases.json). Loaded from spiece.model the ids must equal sentencepiece's
// (`sp.encode(text) + [eos]`), from tokenizer.json transformers' (unpadded, and padded/truncated to
// 64); missing, corrupt and non-Unigram files are refused naming the path.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "models/t5/t5_tokenizer.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_t5_tokenizer_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

const std::filesystem::path kRef = std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref";
const std::filesystem::path kFolder = kRef / "tiny-t5-tokenizer";

nlohmann::json load_cases() {
    return nlohmann::json::parse(fs::read_file(kRef / "t5_tokenizer_cases.json"));
}

std::string show(const std::string& text) {
    return "text: \"" + text + "\"";
}

// Runs `fn`, expecting a DataError whose message contains every one of `parts`.
template <typename Fn>
void expect_data_error(Fn fn, const std::vector<std::string>& parts) {
    try {
        fn();
        ADD_FAILURE() << "no DataError";
    } catch (const DataError& e) {
        for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
}

TEST(T5Tokenizer, SpieceModelMatchesSentencepiece) {
    const T5Tokenizer tok = T5Tokenizer::load(kFolder / "spiece.model");
    EXPECT_EQ(tok.pad_id(), 0);
    EXPECT_EQ(tok.eos_id(), 1);
    EXPECT_EQ(tok.unk_id(), 2);
    const auto cases = load_cases();
    EXPECT_EQ(tok.vocab_size(), cases["vocab_size"].get<std::size_t>());
    ASSERT_GE(cases["cases"].size(), 20u);
    for (const auto& c : cases["cases"]) {
        const std::string text = c["text"];
        EXPECT_EQ(tok.encode(text), c["ids_sentencepiece"].get<std::vector<int64_t>>()) << show(text);
    }
}

TEST(T5Tokenizer, TokenizerJsonMatchesTransformers) {
    const T5Tokenizer tok = T5Tokenizer::load(kFolder / "tokenizer.json");
    EXPECT_EQ(tok.pad_id(), 0);
    EXPECT_EQ(tok.eos_id(), 1);
    EXPECT_EQ(tok.unk_id(), 2);
    const auto cases = load_cases();
    const int64_t max_length = cases["max_length"];
    for (const auto& c : cases["cases"]) {
        const std::string text = c["text"];
        EXPECT_EQ(tok.encode(text), c["ids_transformers_unpadded"].get<std::vector<int64_t>>()) << show(text);
        EXPECT_EQ(tok.encode(text, max_length), c["ids_transformers"].get<std::vector<int64_t>>())
            << show(text);
    }
}

TEST(T5Tokenizer, BothFilesAgreeWhereTheLibrariesDo) {
    const T5Tokenizer spm = T5Tokenizer::load(kFolder / "spiece.model");
    const T5Tokenizer fast = T5Tokenizer::load(kFolder);  // a folder: tokenizer.json wins
    int agreeing = 0;
    const auto cases = load_cases();
    for (const auto& c : cases["cases"]) {
        const std::string text = c["text"];
        if (!c["agree"].get<bool>()) continue;
        ++agreeing;
        EXPECT_EQ(spm.encode(text, 64), fast.encode(text, 64)) << show(text);
    }
    EXPECT_GE(agreeing, 20);
}

TEST(T5Tokenizer, BatchIsPaddedAndTruncatedWithEosLast) {
    const T5Tokenizer tok = T5Tokenizer::load(kFolder / "tokenizer.json");
    const auto cases = load_cases()["cases"];
    const std::string longest = cases.back()["text"];
    const std::vector<std::string> texts = {"a photo of a cat", "", longest};
    const at::Tensor ids = tok.encode_batch(texts, 16);
    const at::Tensor mask = tok.attention_mask(texts, 16);
    ASSERT_EQ(ids.sizes(), (at::IntArrayRef{3, 16}));
    EXPECT_EQ(ids.scalar_type(), at::kLong);
    for (int64_t b = 0; b < 3; ++b) {
        const auto want = tok.encode(texts[static_cast<std::size_t>(b)], 16);
        const auto unpadded = tok.encode(texts[static_cast<std::size_t>(b)]);
        for (int64_t i = 0; i < 16; ++i) {
            EXPECT_EQ(ids[b][i].item<int64_t>(), want[static_cast<std::size_t>(i)]);
            EXPECT_EQ(mask[b][i].item<int64_t>(), i < static_cast<int64_t>(unpadded.size()) ? 1 : 0);
        }
    }
    EXPECT_EQ(ids[1][0].item<int64_t>(), tok.eos_id());  // "" -> just eos
    EXPECT_EQ(ids[1][1].item<int64_t>(), tok.pad_id());
    EXPECT_EQ(ids[2][15].item<int64_t>(), tok.eos_id());  // truncated, eos kept last
    EXPECT_THROW(tok.encode("x", 0), UsageError);
}

TEST(T5Tokenizer, MissingFileIsADataErrorNamingThePath) {
    test::TempDir dir;
    const auto missing = dir / "nope" / "spiece.model";
    expect_data_error([&] { T5Tokenizer::load(missing); }, {missing.string()});
    std::filesystem::create_directories(dir / "empty");
    expect_data_error([&] { T5Tokenizer::load(dir / "empty"); },
                      {(dir / "empty").string(), "tokenizer.json"});
}

TEST(T5Tokenizer, CorruptFilesAreDataErrorsNamingThePath) {
    test::TempDir dir;
    const auto garbage = dir / "spiece.model";
    std::ofstream(garbage, std::ios::binary) << "this is not a protobuf at all";
    expect_data_error([&] { T5Tokenizer::load(garbage); }, {garbage.string()});
    // A truncated copy of the real model: a length-delimited field runs past the end.
    const std::string real = fs::read_file(kFolder / "spiece.model");
    const auto truncated = dir / "truncated.model";
    std::ofstream(truncated, std::ios::binary) << real.substr(0, real.size() / 2);
    expect_data_error([&] { T5Tokenizer::load(truncated); }, {truncated.string()});
    const auto bad_json = dir / "tokenizer.json";
    std::ofstream(bad_json) << R"({"model": {"type": "Unigram", "vocab": [)";
    expect_data_error([&] { T5Tokenizer::load(bad_json); }, {bad_json.string()});
}

TEST(T5Tokenizer, RefusesANonUnigramTokenizerJsonNamingFileAndType) {
    test::TempDir dir;
    const auto path = dir / "tokenizer.json";
    std::ofstream(path) << R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})";
    expect_data_error([&] { T5Tokenizer::load(path); }, {path.string(), "BPE", "Unigram"});
}

TEST(T5Tokenizer, HubStyleTokenizerJsonSteps) {
    // The older converter's layout (google/t5-v1_1-xxl, FLUX.1 tokenizer_2 on the Hub): normalizer
    // Sequence[Precompiled, Replace(" {2,}" -> " ")], pre_tokenizer Metaspace alone. Built from the
    // reference tokenizer.json by swapping the two steps; a trailing space then gives a lone "▁"
    // before eos, as that tokenizer does.
    auto j = nlohmann::json::parse(fs::read_file(kFolder / "tokenizer.json"));
    const auto precompiled = j["normalizer"];
    j["normalizer"] = {
        {"type", "Sequence"},
        {"normalizers",
         {precompiled, {{"type", "Replace"}, {"pattern", {{"Regex", " {2,}"}}}, {"content", " "}}}}};
    j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"add_prefix_space", true}};
    test::TempDir dir;
    std::ofstream(dir / "tokenizer.json") << j.dump();
    const T5Tokenizer hub = T5Tokenizer::load(dir / "tokenizer.json");
    const T5Tokenizer ref = T5Tokenizer::load(kFolder / "tokenizer.json");
    EXPECT_EQ(hub.encode("a photo   of a cat"), ref.encode("a photo of a cat"));
    auto want = ref.encode("a cat");
    want.insert(want.end() - 1, hub.piece_id("\u2581"));
    EXPECT_EQ(hub.encode("a cat "), want);
    // Literal ids from `tokenizers` 0.23 on this variant of the reference file: " x " after the
    // Replace -> "▁x▁" -> "▁x" ("▁" + unknown "x") and a lone "▁".
    EXPECT_EQ(hub.encode("  x  "), (T5Tokenizer::Ids{3, 2, 3, 1}));
    EXPECT_EQ(hub.encode("a cat "), (T5Tokenizer::Ids{24, 6, 3, 1}));
}

}  // namespace
}  // namespace test_t5_tokenizer_unit_local
}  // namespace dtune::models
