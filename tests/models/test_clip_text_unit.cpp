// Unit tests for the CLIP text side: pooling rules on hand-built configs, config parsing, module
// names, tokenizer errors on bad input. Small synthetic inputs only.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <set>

#include "core/error.h"
#include "io/safetensors.h"
#include "models/clip/clip_text_model.h"
#include "models/clip/clip_tokenizer.h"
#include "models/clip/sdxl_text_encoders.h"
#include "models/common/weights.h"
#include "support/test_support.h"

namespace dtune::models {
namespace {

CLIPTextConfig tiny_config(int64_t eos_token_id) {
    CLIPTextConfig c;
    c.vocab_size = 50;
    c.hidden_size = 8;
    c.intermediate_size = 12;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 2;
    c.max_position_embeddings = 6;
    c.projection_dim = 4;
    c.eos_token_id = eos_token_id;
    return c;
}

template <typename E>
std::string error_of(const std::function<void()>& f) {
    try {
        f();
    } catch (const E& e) {
        return e.what();
    }
    ADD_FAILURE() << "no exception of the expected type";
    return {};
}

// A minimal tokenizer folder: bytes a-c, "</w>" variants, two merges.
void write_small_vocab(const test::TempDir& dir, const std::string& merges) {
    test::write_bytes(dir / "vocab.json",
                      R"({"a": 0, "b": 1, "c": 2, "a</w>": 3, "b</w>": 4, "c</w>": 5, "ab": 6, "ab</w>": 7,)"
                      R"( "<|startoftext|>": 8, "<|endoftext|>": 9})");
    test::write_bytes(dir / "merges.txt", merges);
}

}  // namespace

TEST(CLIPPooling, EosRulePicksFirstEosPosition) {
    // eos 7 appears at positions 2 and 4 (as when pad == eos): the first one is pooled.
    const at::Tensor ids = at::tensor({1, 9, 7, 3, 7, 5, 8, 7, 7, 7}, at::kLong).view({2, 5});
    const at::Tensor pos = clip_eos_positions(ids, 7);
    EXPECT_EQ(pos[0].item<int64_t>(), 2);
    EXPECT_EQ(pos[1].item<int64_t>(), 2);
}

TEST(CLIPPooling, LegacyRuleIsArgmaxOfIds) {
    // eos_token_id == 2 (real SDXL configs): the position of the largest id, whatever it is.
    const at::Tensor ids =
        at::tensor({49406, 320, 49407, 0, 0, 49406, 49407, 49407, 49407, 49407}, at::kLong).view({2, 5});
    const at::Tensor pos = clip_eos_positions(ids, 2);
    EXPECT_EQ(pos[0].item<int64_t>(), 2);
    EXPECT_EQ(pos[1].item<int64_t>(), 1);  // first maximum
    // With the EOS rule and eos 320 the answer differs, so the two rules are really distinct.
    EXPECT_EQ(clip_eos_positions(ids, 320)[0].item<int64_t>(), 1);
}

TEST(CLIPPooling, ModelPoolsFinalNormedStateAtTheRulePosition) {
    torch::manual_seed(0);
    for (const int64_t eos : {int64_t{2}, int64_t{40}}) {
        CLIPTextModelWithProjection m(tiny_config(eos));
        m->eval();
        torch::NoGradGuard no_grad;
        // Row 0: largest id 45 at position 1, id 40 at position 3.
        const at::Tensor ids = at::tensor({0, 45, 3, 40, 1, 1}, at::kLong).view({1, 6});
        const CLIPTextOutput out = m->forward(ids);
        const int64_t expect_at = eos == 2 ? 1 : 3;
        EXPECT_TRUE(at::allclose(out.pooler_output[0], out.last_hidden_state[0][expect_at])) << "eos " << eos;
        const at::Tensor projected = at::matmul(out.pooler_output, m->text_projection->weight.t());
        EXPECT_TRUE(at::allclose(out.text_embeds, projected));
    }
}

TEST(CLIPTextModelUnit, CausalMaskMakesEarlyPositionsIgnoreLaterTokens) {
    torch::manual_seed(1);
    CLIPTextModel m(tiny_config(40));
    torch::NoGradGuard no_grad;
    const at::Tensor a = at::tensor({3, 4, 5, 40, 6, 7}, at::kLong).view({1, 6});
    const at::Tensor b = at::tensor({3, 4, 5, 40, 9, 1}, at::kLong).view({1, 6});
    const auto oa = m->forward(a), ob = m->forward(b);
    EXPECT_TRUE(at::allclose(oa.last_hidden_state.slice(1, 0, 4), ob.last_hidden_state.slice(1, 0, 4)));
    EXPECT_FALSE(at::allclose(oa.last_hidden_state.slice(1, 4, 6), ob.last_hidden_state.slice(1, 4, 6)));
}

TEST(CLIPTextModelUnit, ParameterNamesAreTransformersKeys) {
    CLIPTextModelWithProjection m(tiny_config(2));
    std::set<std::string> names;
    for (const auto& [k, v] : state_dict(*m)) names.insert(k);
    for (const char* key :
         {"text_model.embeddings.token_embedding.weight", "text_model.embeddings.position_embedding.weight",
          "text_model.encoder.layers.0.self_attn.q_proj.weight", "text_model.encoder.layers.1.mlp.fc2.bias",
          "text_model.encoder.layers.1.layer_norm2.weight", "text_model.final_layer_norm.bias",
          "text_projection.weight"})
        EXPECT_EQ(names.count(key), 1u) << key;
    EXPECT_EQ(names.size(), 2u + 2 * 16 + 2 + 1);
    EXPECT_EQ(clip_text_key_to_module("encoder.layers.0.mlp.fc1.weight"),
              "text_model.encoder.layers.0.mlp.fc1.weight");
    EXPECT_EQ(clip_text_key_to_module("text_projection.weight"), "text_projection.weight");
    EXPECT_EQ(clip_text_key_to_module("text_model.embeddings.position_ids"), "");
}

TEST(CLIPTextModelUnit, ConfigParsesRealSDXLFiles) {
    const auto dir = test::fixtures_dir() / "sdxl-base-configs";
    const auto c1 = CLIPTextConfig::from_json_file(dir / "text_encoder" / "config.json");
    const auto c2 = CLIPTextConfig::from_json_file(dir / "text_encoder_2" / "config.json");
    EXPECT_EQ(c1.eos_token_id, 2);
    EXPECT_EQ(c1.hidden_act, "quick_gelu");
    EXPECT_FALSE(c1.with_projection);
    EXPECT_EQ(c2.hidden_size, 1280);
    EXPECT_EQ(c2.num_hidden_layers, 32);
    EXPECT_TRUE(c2.with_projection);
    const std::string msg =
        error_of<DataError>([] { CLIPTextConfig::from_json_text(R"({"hidden_act": "relu"})", "cfg.json"); });
    EXPECT_NE(msg.find("relu"), std::string::npos) << msg;
    EXPECT_NE(error_of<DataError>([] { CLIPTextConfig::from_json_text("{", "cfg.json"); }).find("cfg.json"),
              std::string::npos);
}

TEST(CLIPTextModelUnit, MissingWeightsAreListed) {
    test::TempDir dir;
    const CLIPTextConfig c = tiny_config(2);
    test::write_bytes(dir / "config.json",
                      R"({"architectures": ["CLIPTextModel"], "vocab_size": 50, "hidden_size": 8,)"
                      R"( "intermediate_size": 12, "num_hidden_layers": 2, "num_attention_heads": 2,)"
                      R"( "max_position_embeddings": 6, "eos_token_id": 2})");
    CLIPTextModel m(c);
    auto sd = state_dict(*m);
    io::TensorList unprefixed;  // transformers 5 layout, minus one tensor
    for (auto& [k, v] : sd)
        if (k != "text_model.final_layer_norm.bias") unprefixed.emplace_back(k.substr(11), v);
    io::save_safetensors(dir / "model.safetensors", unprefixed);
    const std::string msg = error_of<DataError>([&] { load_clip_text_model(dir.path()); });
    EXPECT_NE(msg.find("final_layer_norm.bias"), std::string::npos) << msg;
}

TEST(CLIPTokenizerUnit, MissingVocabFileNamesTheFile) {
    test::TempDir dir;
    test::write_bytes(dir / "merges.txt", "#version: 0.2\na b\n");
    const std::string msg = error_of<DataError>([&] { CLIPTokenizer::from_folder(dir.path()); });
    EXPECT_NE(msg.find("vocab.json"), std::string::npos) << msg;
    const std::string none = error_of<DataError>([&] { CLIPTokenizer::from_folder(dir / "nope"); });
    EXPECT_NE(none.find("nope"), std::string::npos) << none;
}

TEST(CLIPTokenizerUnit, MalformedMergesNameTheLine) {
    test::TempDir dir;
    write_small_vocab(dir, "#version: 0.2\na b\nabc\n");
    const std::string msg = error_of<DataError>([&] { CLIPTokenizer::from_folder(dir.path()); });
    EXPECT_NE(msg.find("line 3"), std::string::npos) << msg;
    write_small_vocab(dir, "#version: 0.2\na zz\n");
    const std::string unknown = error_of<DataError>([&] { CLIPTokenizer::from_folder(dir.path()); });
    EXPECT_NE(unknown.find("missing from"), std::string::npos) << unknown;
}

TEST(CLIPTokenizerUnit, SmallVocabularyMergesAndSpecialSplit) {
    test::TempDir dir;
    write_small_vocab(dir, "#version: 0.2\na b</w>\na b\n");
    // "ab</w>" needs merge "a b</w>" which yields "ab</w>" = 7; "abc": a b -> ab, then "ab c</w>" has no
    // merge.
    const CLIPTokenizer tok = CLIPTokenizer::from_folder(dir.path());
    EXPECT_EQ(tok.encode_raw("AB abc"), (CLIPTokenizer::Ids{7, 6, 5}));
    EXPECT_EQ(tok.encode_raw("ab<|endoftext|>ab"), (CLIPTokenizer::Ids{7, 9, 7}));
    EXPECT_EQ(tok.encode("ab", 5), (CLIPTokenizer::Ids{8, 7, 9, 9, 9}));
    EXPECT_EQ(tok.encode("a a a a a", 4), (CLIPTokenizer::Ids{8, 3, 3, 9}));  // EOS stays last
}

TEST(CLIPTokenizerUnit, TokenizerJsonLoads) {
    test::TempDir dir;
    test::write_bytes(
        dir / "tokenizer.json",
        R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "a</w>": 2, "b</w>": 3, "ab</w>": 4,)"
        R"( "<|startoftext|>": 5, "<|endoftext|>": 6}, "merges": [["a", "b</w>"]]}})");
    const CLIPTokenizer tok = CLIPTokenizer::from_folder(dir.path());
    EXPECT_EQ(tok.encode_raw("ab b"), (CLIPTokenizer::Ids{4, 3}));
    test::write_bytes(dir / "tokenizer.json", R"({"model": {"type": "WordPiece", "vocab": {}}})");
    EXPECT_NE(error_of<DataError>([&] { CLIPTokenizer::from_folder(dir.path()); }).find("BPE"),
              std::string::npos);
}

}  // namespace dtune::models
