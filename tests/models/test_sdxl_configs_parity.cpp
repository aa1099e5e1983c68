// Built-in SDXL base configs and tokenizers (models/sdxl/sdxl_configs.h) against the fixtures:
// the compiled-in configs equal fixtures/sdxl-base-configs, the vocabulary derived from the
// compiled-in merges equals the real CLIP vocab.json entry for entry, the built-in tokenizers
// reproduce every transformers case, the built-in UNet config has SDXL's parameter count, and the
// architecture check accepts SDXL base shapes and rejects a tiny single file with the fix named.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>

#include "core/error.h"
#include "core/fs.h"
#include "io/ldm_keys.h"
#include "io/safetensors.h"
#include "models/common/layers.h"
#include "models/sdxl/sdxl_configs.h"
#include "models/unet/unet_2d_condition.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_sdxl_configs_parity_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

nlohmann::json fixture_json(const std::string& relative) {
    return nlohmann::json::parse(fs::read_file(test::fixtures_dir() / relative));
}

TEST(SDXLConfigsParity, BuiltinConfigsEqualTheSdxlBaseFiles) {
    const SDXLConfigs c = SDXLConfigs::builtin();
    EXPECT_EQ(c.unet.json(), fixture_json("sdxl-base-configs/unet/config.json"));
    EXPECT_EQ(c.vae.json(), fixture_json("sdxl-base-configs/vae/config.json"));
    EXPECT_EQ(c.scheduler, fixture_json("sdxl-base-configs/scheduler/scheduler_config.json"));
    const auto te1 = fixture_json("sdxl-base-configs/text_encoder/config.json");
    const auto te2 = fixture_json("sdxl-base-configs/text_encoder_2/config.json");
    EXPECT_EQ(c.text_encoder.hidden_size, te1.at("hidden_size").get<int64_t>());
    EXPECT_EQ(c.text_encoder.num_hidden_layers, te1.at("num_hidden_layers").get<int64_t>());
    EXPECT_FALSE(c.text_encoder.with_projection);
    EXPECT_EQ(c.text_encoder_2.hidden_size, te2.at("hidden_size").get<int64_t>());
    EXPECT_EQ(c.text_encoder_2.num_hidden_layers, te2.at("num_hidden_layers").get<int64_t>());
    EXPECT_TRUE(c.text_encoder_2.with_projection);
    EXPECT_TRUE(c.force_zeros_for_empty_prompt);
}

TEST(SDXLConfigsParity, VocabularyFromMergesEqualsClipVocabJson) {
    const SDXLConfigs c = SDXLConfigs::builtin();
    const auto vocab = fixture_json("tiny-sdxl/tokenizer/vocab.json");
    ASSERT_EQ(vocab.size(), 49408u);
    EXPECT_EQ(c.tokenizer.vocab_size(), vocab.size());
    std::size_t wrong = 0;
    for (const auto& [token, id] : vocab.items())
        if (c.tokenizer.token_id(token) != id.get<int64_t>() && ++wrong <= 5)
            ADD_FAILURE() << "token '" << token << "': " << c.tokenizer.token_id(token) << " vs " << id;
    EXPECT_EQ(wrong, 0u);
}

TEST(SDXLConfigsParity, BuiltinTokenizersMatchTransformersCases) {
    const SDXLConfigs c = SDXLConfigs::builtin();
    EXPECT_EQ(c.tokenizer.pad_id(), 49407);  // <|endoftext|>
    EXPECT_EQ(c.tokenizer_2.pad_id(), 0);    // "!"
    const auto cases = fixture_json("reference/tokenizer_cases.json")["cases"];
    ASSERT_EQ(cases.size(), 15u);
    for (const auto& k : cases) {
        const std::string text = k["text"];
        EXPECT_EQ(c.tokenizer.encode(text), k["ids_tokenizer"].get<std::vector<int64_t>>()) << text;
        EXPECT_EQ(c.tokenizer_2.encode(text), k["ids_tokenizer_2"].get<std::vector<int64_t>>()) << text;
    }
}

TEST(SDXLConfigsParity, BuiltinUNetHasSdxlParameterCount) {
    // Allocated uninitialised in bf16: untouched pages cost no memory, so this is cheap.
    UninitializedParameters scope(at::kBFloat16, c10::Device(c10::kCPU));
    UNet2DConditionModel unet(UNet2DConditionConfig::from_json(SDXLConfigs::builtin().unet));
    int64_t n = 0;
    for (const auto& p : unet->parameters()) n += p.numel();
    EXPECT_EQ(n, 2567463684);  // fixtures README: the full-size SDXL UNet
}

// A safetensors file whose header lists `tensors` (zero-filled, sparse on disk: no real data).
std::filesystem::path sparse_file(const test::TempDir& dir,
                                  const std::vector<std::pair<std::string, std::vector<int64_t>>>& tensors) {
    std::vector<io::TensorInfo> infos;
    uint64_t offset = 0;
    for (const auto& [name, shape] : tensors) {
        io::TensorInfo t;
        t.name = name;
        t.dtype = io::StDType::BF16;
        t.shape = shape;
        t.begin = offset;
        t.end = offset + t.numel() * 2;
        offset = t.end;
        infos.push_back(t);
    }
    const std::string header = io::build_safetensors_header(infos, {});
    const auto path = dir / "sdxl_shapes.safetensors";
    test::write_bytes(path, header);
    std::filesystem::resize_file(path, header.size() + offset);
    return path;
}

TEST(SDXLConfigsParity, ArchitectureCheckAcceptsSdxlBaseShapes) {
    test::TempDir dir;
    const auto path = sparse_file(
        dir,
        {{"model.diffusion_model.input_blocks.0.0.weight", {320, 4, 3, 3}},
         {"model.diffusion_model.label_emb.0.0.weight", {1280, 2816}},
         {"model.diffusion_model.middle_block.1.transformer_blocks.9.attn2.to_k.weight", {1280, 2048}},
         {"conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight", {49408, 768}},
         {"conditioner.embedders.1.model.token_embedding.weight", {49408, 1280}},
         {"first_stage_model.decoder.conv_in.weight", {512, 4, 3, 3}}});
    EXPECT_NO_THROW(check_builtin_architecture(io::WeightSource::open(path), path));
}

TEST(SDXLConfigsParity, ArchitectureCheckRejectsOtherShapesNamingTheFix) {
    test::TempDir dir;
    const auto path = sparse_file(
        dir,
        {{"model.diffusion_model.input_blocks.0.0.weight", {32, 4, 3, 3}},
         {"conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight", {49408, 32}},
         {"conditioner.embedders.1.model.token_embedding.weight", {49408, 32}}});
    try {
        check_builtin_architecture(io::WeightSource::open(path), path);
        FAIL() << "a tiny model is not SDXL base";
    } catch (const DataError& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("input_blocks.0.0.weight is [32, 4, 3, 3]"), std::string::npos) << msg;
        EXPECT_NE(msg.find("--config_folder"), std::string::npos) << msg;
    }
    const auto unet_only =
        sparse_file(dir, {{"model.diffusion_model.input_blocks.0.0.weight", {320, 4, 3, 3}}});
    EXPECT_THROW(check_builtin_architecture(io::WeightSource::open(unet_only), unet_only), DataError);
}

}  // namespace
}  // namespace test_sdxl_configs_parity_local
}  // namespace dtune::models
