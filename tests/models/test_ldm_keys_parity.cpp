// ldm single-file key map (src/io/ldm_keys): the tiny fixture pipeline is written as an SDXL
// single file with diffusers_to_ldm and read back with ldm_to_diffusers; every key and tensor must
// come back identical. Spot checks pin names to the real SDXL single-file layout (names as they
// appear in sd_xl_base_1.0.safetensors), so a map that is merely self-consistent fails.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>

#include "core/error.h"
#include "io/ldm_keys.h"
#include "io/safetensors.h"
#include "models/clip/sdxl_text_encoders.h"
#include "support/test_support.h"

namespace dtune::io {
namespace {

struct Component {
    LdmComponent kind;
    const char* folder;
    const char* stem;
};
const Component kComponents[] = {{LdmComponent::kUNet, "unet", "diffusion_pytorch_model"},
                                 {LdmComponent::kVAE, "vae", "diffusion_pytorch_model"},
                                 {LdmComponent::kTextEncoder, "text_encoder", "model"},
                                 {LdmComponent::kTextEncoder2, "text_encoder_2", "model"}};

TensorList fixture_component(const Component& c) {
    const auto source = WeightSource::open(test::fixtures_dir() / "tiny-sdxl" / c.folder, c.stem);
    TensorList out;
    for (const auto& k : source.keys()) out.emplace_back(k, source.get(k));
    return out;
}

}  // namespace

TEST(LdmKeys, TinyPipelineRoundTripsThroughASingleFile) {
    test::TempDir dir;
    TensorList single;
    std::map<LdmComponent, TensorList> originals;
    for (const auto& c : kComponents) {
        originals[c.kind] = fixture_component(c);
        for (auto& kv : diffusers_to_ldm(originals[c.kind], c.kind)) single.push_back(std::move(kv));
    }
    save_safetensors(dir / "sdxl_single.safetensors", single);
    const auto file = WeightSource::open(dir / "sdxl_single.safetensors");
    EXPECT_TRUE(is_ldm_sdxl_checkpoint(file.keys()));
    for (const auto& c : kComponents) {
        std::map<std::string, at::Tensor> back;
        for (auto& [k, v] : ldm_to_diffusers(file, c.kind))
            EXPECT_TRUE(back.emplace(k, v).second) << "dup " << k;
        const TensorList& orig = originals[c.kind];
        EXPECT_EQ(back.size(), orig.size()) << c.folder;
        for (const auto& [k, v] : orig) {
            // transformers 5 saves text_encoder without "text_model."; the single file always has it.
            const std::string name =
                c.kind == LdmComponent::kTextEncoder ? models::clip_text_key_to_module(k) : k;
            const auto it = back.find(name);
            ASSERT_NE(it, back.end()) << c.folder << ": " << name << " did not come back";
            EXPECT_TRUE(at::equal(it->second, v)) << c.folder << ": " << name;
        }
    }
}

TEST(LdmKeys, SingleFileNamesMatchTheSDXLLayout) {
    // UNet (layers_per_block 2): input_blocks 1-2 / 4-5 / 7-8 hold the resnets (+ attentions) of
    // down blocks 0/1/2, 3 and 6 the downsamplers; up block 0/1 upsamplers sit at .2 after attention.
    const std::set<int> up_attn = {0, 1};
    const std::pair<const char*, const char*> unet[] = {
        {"conv_in.weight", "input_blocks.0.0.weight"},
        {"time_embedding.linear_2.bias", "time_embed.2.bias"},
        {"add_embedding.linear_1.weight", "label_emb.0.0.weight"},
        {"down_blocks.0.resnets.1.conv2.weight", "input_blocks.2.0.out_layers.3.weight"},
        {"down_blocks.0.downsamplers.0.conv.weight", "input_blocks.3.0.op.weight"},
        {"down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight",
         "input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight"},
        {"down_blocks.1.resnets.0.conv_shortcut.weight", "input_blocks.4.0.skip_connection.weight"},
        {"down_blocks.2.resnets.1.time_emb_proj.bias", "input_blocks.8.0.emb_layers.1.bias"},
        {"mid_block.resnets.1.norm1.weight", "middle_block.2.in_layers.0.weight"},
        {"mid_block.attentions.0.proj_out.weight", "middle_block.1.proj_out.weight"},
        {"up_blocks.0.resnets.2.conv1.weight", "output_blocks.2.0.in_layers.2.weight"},
        {"up_blocks.0.upsamplers.0.conv.weight", "output_blocks.2.2.conv.weight"},
        {"up_blocks.1.attentions.2.norm.weight", "output_blocks.5.1.norm.weight"},
        {"up_blocks.2.resnets.2.norm2.bias", "output_blocks.8.0.out_layers.0.bias"},
        {"conv_norm_out.weight", "out.0.weight"},
        {"conv_out.bias", "out.2.bias"}};
    for (const auto& [d, l] : unet) {
        EXPECT_EQ(diffusers_unet_key_to_ldm(d, 2, up_attn), l) << d;
        EXPECT_EQ(ldm_unet_key_to_diffusers(l, 2), d) << l;
    }
    // A UNet without attention in up block 1 puts that upsampler at .1 (SD 1.x-style numbering).
    EXPECT_EQ(diffusers_unet_key_to_ldm("up_blocks.1.upsamplers.0.conv.weight", 2, {}),
              "output_blocks.5.1.conv.weight");
    EXPECT_EQ(ldm_unet_key_to_diffusers("output_blocks.5.1.conv.weight", 2),
              "up_blocks.1.upsamplers.0.conv.weight");

    const std::pair<const char*, const char*> vae[] = {
        {"encoder.down_blocks.0.resnets.1.conv2.weight", "encoder.down.0.block.1.conv2.weight"},
        {"encoder.down_blocks.1.downsamplers.0.conv.bias", "encoder.down.1.downsample.conv.bias"},
        {"encoder.down_blocks.1.resnets.0.conv_shortcut.weight",
         "encoder.down.1.block.0.nin_shortcut.weight"},
        {"encoder.mid_block.attentions.0.to_q.weight", "encoder.mid.attn_1.q.weight"},
        {"decoder.mid_block.attentions.0.group_norm.bias", "decoder.mid.attn_1.norm.bias"},
        {"decoder.mid_block.attentions.0.to_out.0.weight", "decoder.mid.attn_1.proj_out.weight"},
        {"decoder.mid_block.resnets.1.norm1.weight", "decoder.mid.block_2.norm1.weight"},
        {"decoder.up_blocks.0.resnets.2.conv1.weight", "decoder.up.3.block.2.conv1.weight"},
        {"decoder.up_blocks.0.upsamplers.0.conv.weight", "decoder.up.3.upsample.conv.weight"},
        {"decoder.up_blocks.3.resnets.0.conv_shortcut.bias", "decoder.up.0.block.0.nin_shortcut.bias"},
        {"encoder.conv_norm_out.weight", "encoder.norm_out.weight"},
        {"post_quant_conv.weight", "post_quant_conv.weight"}};
    for (const auto& [d, l] : vae) {
        EXPECT_EQ(diffusers_vae_key_to_ldm(d, 4), l) << d;
        EXPECT_EQ(ldm_vae_key_to_diffusers(l, 4), d) << l;
    }
    const std::pair<const char*, const char*> clip[] = {
        {"text_model.embeddings.position_embedding.weight", "positional_embedding"},
        {"text_model.final_layer_norm.bias", "ln_final.bias"},
        {"text_model.encoder.layers.31.mlp.fc1.weight", "transformer.resblocks.31.mlp.c_fc.weight"},
        {"text_model.encoder.layers.0.layer_norm2.bias", "transformer.resblocks.0.ln_2.bias"},
        {"text_model.encoder.layers.3.self_attn.out_proj.weight",
         "transformer.resblocks.3.attn.out_proj.weight"}};
    for (const auto& [d, l] : clip) {
        EXPECT_EQ(transformers_key_to_open_clip(d), l) << d;
        EXPECT_EQ(open_clip_key_to_transformers(l), d) << l;
    }
    EXPECT_EQ(ldm_unet_key_to_diffusers("input_blocks.4.7.weight", 2), "");
    EXPECT_EQ(ldm_vae_key_to_diffusers("encoder.down.9.block.0.conv1.weight", 4), "");
}

TEST(LdmKeys, OpenClipTensorsAreSplitAndTransposed) {
    // A hand-made OpenCLIP layer: q/k/v must be the row thirds of in_proj, the projection transposed.
    test::TempDir dir;
    const at::Tensor in_w = at::arange(6 * 2, at::kFloat).view({6, 2});  // D = 2
    const at::Tensor in_b = at::arange(6, at::kFloat);
    const at::Tensor proj = at::arange(2 * 3, at::kFloat).view({2, 3});  // [D, P]
    const std::string p = ldm_prefix(LdmComponent::kTextEncoder2);
    save_safetensors(dir / "f.safetensors", {{p + "transformer.resblocks.0.attn.in_proj_weight", in_w},
                                             {p + "transformer.resblocks.0.attn.in_proj_bias", in_b},
                                             {p + "text_projection", proj},
                                             {p + "logit_scale", at::ones({})}});
    std::map<std::string, at::Tensor> got;
    for (auto& [k, v] :
         ldm_to_diffusers(WeightSource::open(dir / "f.safetensors"), LdmComponent::kTextEncoder2))
        got[k] = v;
    ASSERT_EQ(got.size(), 7u);
    const std::string l = "text_model.encoder.layers.0.self_attn.";
    EXPECT_TRUE(
        at::equal(got[l + "q_proj.weight"], at::tensor(std::vector<float>{0.f, 1, 2, 3}).view({2, 2})));
    EXPECT_TRUE(
        at::equal(got[l + "v_proj.weight"], at::tensor(std::vector<float>{8.f, 9, 10, 11}).view({2, 2})));
    EXPECT_TRUE(at::equal(got[l + "k_proj.bias"], at::tensor(std::vector<float>{2.f, 3})));
    EXPECT_TRUE(at::equal(got["text_projection.weight"],
                          at::tensor(std::vector<float>{0.f, 3, 1, 4, 2, 5}).view({3, 2})));
}

TEST(LdmKeys, UnknownAndAbsentComponentsAreErrors) {
    test::TempDir dir;
    save_safetensors(dir / "f.safetensors",
                     {{"model.diffusion_model.input_blocks.4.9.weight", at::ones({1})}});
    const auto file = WeightSource::open(dir / "f.safetensors");
    try {
        ldm_to_diffusers(file, LdmComponent::kUNet);
        FAIL();
    } catch (const dtune::DataError& e) {
        EXPECT_NE(std::string(e.what()).find("input_blocks.4.9.weight"), std::string::npos) << e.what();
    }
    try {
        ldm_to_diffusers(file, LdmComponent::kVAE);
        FAIL();
    } catch (const dtune::DataError& e) {
        EXPECT_NE(std::string(e.what()).find("first_stage_model."), std::string::npos) << e.what();
    }
    EXPECT_FALSE(is_ldm_sdxl_checkpoint(file.keys()));
}

}  // namespace dtune::io
