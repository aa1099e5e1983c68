// UNet2DConditionModel without reference outputs: an SD 1.x-style config (conv projections,
// int attention_head_dim, no addition embedding, upcast_attention) builds with diffusers' key
// names and round-trips through safetensors; gradient checkpointing gives the plain gradients;
// channels-last and bf16 agree with fp32; unsupported config values and missing files give errors
// naming the key or path.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/autocast_mode.h>

#include <cmath>
#include <fstream>
#include <set>

#include "core/error.h"
#include "io/safetensors.h"
#include "model_test_util.h"
#include "models/common/blocks.h"
#include "models/common/checkpoint.h"
#include "models/common/unit_hooks.h"
#include "models/common/weights.h"
#include "models/unet/unet_2d_condition.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_unet_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

// A tiny SD 1.x-shaped config in diffusers' spelling (no use_linear_projection key: conv proj).
nlohmann::json sd1_config() {
    return nlohmann::json::parse(R"({
      "_class_name": "UNet2DConditionModel", "act_fn": "silu", "attention_head_dim": 4,
      "block_out_channels": [32, 64, 64], "center_input_sample": false, "cross_attention_dim": 48,
      "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
      "downsample_padding": 1, "flip_sin_to_cos": true, "freq_shift": 0, "in_channels": 4,
      "layers_per_block": 1, "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32,
      "out_channels": 4, "sample_size": 16, "upcast_attention": true,
      "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]})");
}

UNet2DConditionModel build(const nlohmann::json& json) {
    return UNet2DConditionModel(UNet2DConditionConfig::from_json(ConfigReader(json, "test config.json")));
}

struct Inputs {
    at::Tensor sample, timestep, context;
};

Inputs inputs(int64_t h = 16, int64_t w = 16) {
    at::manual_seed(3);
    return {at::randn({2, 4, h, w}), at::tensor({10, 700}, at::kLong), at::randn({2, 7, 48})};
}

TEST(UNetUnit, TimestepEmbeddingIsTheClosedForm) {
    // dim 4, half 2: frequencies exp(-ln(1e4) * i / 2) = {1, 0.01}; flip puts cos first.
    const at::Tensor e = timestep_embedding(at::tensor({0.0, 1.0}), 4, /*flip_sin_to_cos=*/true, 0.0);
    const double expected[2][4] = {{1, 1, 0, 0},
                                   {std::cos(1.0), std::cos(0.01), std::sin(1.0), std::sin(0.01)}};
    for (int r = 0; r < 2; ++r)
        for (int c = 0; c < 4; ++c)
            EXPECT_NEAR(e[r][c].item<double>(), expected[r][c], 1e-6) << r << "," << c;
    // freq_shift 1: denominator half - 1 = 1, so frequencies {1, 1e-4}; no flip keeps sin first.
    const at::Tensor s = timestep_embedding(at::tensor({1.0}), 4, false, 1.0);
    EXPECT_NEAR(s[0][1].item<double>(), std::sin(1e-4), 1e-9);
    EXPECT_NEAR(s[0][3].item<double>(), std::cos(1e-4), 1e-6);
}

TEST(UNetUnit, SD1ConfigBuildsWithDiffusersNamesAndShapes) {
    UNet2DConditionModel unet = build(sd1_config());
    auto params = unet->named_parameters(true);
    // Conv projections (SD 1.x) are 1x1 convolutions; 4 heads on 32 channels.
    const at::Tensor* proj_in = params.find("down_blocks.0.attentions.0.proj_in.weight");
    ASSERT_NE(proj_in, nullptr);
    EXPECT_EQ(proj_in->sizes(), (std::vector<int64_t>{32, 32, 1, 1}));
    EXPECT_NE(params.find("down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight"), nullptr);
    EXPECT_EQ(params.find("down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight")->size(1), 48);
    EXPECT_NE(params.find("down_blocks.0.attentions.0.transformer_blocks.0.ff.net.2.weight"), nullptr);
    EXPECT_NE(params.find("up_blocks.2.attentions.1.transformer_blocks.0.attn1.to_out.0.bias"), nullptr);
    EXPECT_NE(params.find("down_blocks.1.downsamplers.0.conv.weight"), nullptr);
    EXPECT_NE(params.find("up_blocks.0.upsamplers.0.conv.weight"), nullptr);
    EXPECT_EQ(params.find("up_blocks.0.attentions.0.norm.weight"), nullptr);  // UpBlock2D has no attention
    EXPECT_EQ(params.find("add_embedding.linear_1.weight"), nullptr);
    // Up block 2 ResNet 0: 64 from below + 32 skip channels in.
    EXPECT_EQ(params.find("up_blocks.2.resnets.0.conv1.weight")->size(1), 96);

    torch::NoGradGuard no_grad;
    const Inputs in = inputs();
    EXPECT_EQ(unet->forward(in.sample, in.timestep, in.context).sizes(), in.sample.sizes());
    // 18x14 is not a multiple of the factor 4: upsampling follows the skips' sizes.
    const Inputs odd = inputs(18, 14);
    EXPECT_EQ(unet->forward(odd.sample, odd.timestep, odd.context).sizes(), odd.sample.sizes());
}

TEST(UNetUnit, SaveAndLoadRoundTripsAFolder) {
    test::TempDir dir;
    const auto folder = dir.path() / "unet";
    std::filesystem::create_directories(folder);
    UNet2DConditionModel a = build(sd1_config());
    io::save_safetensors(folder / "diffusion_pytorch_model.safetensors", state_dict(*a));
    std::ofstream(folder / "config.json") << sd1_config().dump();
    UNet2DConditionModel b = load_unet(folder);
    torch::NoGradGuard no_grad;
    const Inputs in = inputs();
    EXPECT_TRUE(at::equal(a->forward(in.sample, in.timestep, in.context),
                          b->forward(in.sample, in.timestep, in.context)));

    ComponentLoadOptions bf16;
    bf16.dtype = at::kBFloat16;
    UNet2DConditionModel c = load_unet(folder, bf16);
    EXPECT_EQ(c->parameters()[0].scalar_type(), at::kBFloat16);
    const at::Tensor ref = a->forward(in.sample, in.timestep, in.context);
    const at::Tensor low = c->forward(in.sample, in.timestep, in.context);
    EXPECT_EQ(low.scalar_type(), at::kBFloat16);
    EXPECT_LE(test::max_abs_diff(low, ref), 0.1 * ref.abs().max().item<double>());
}

TEST(UNetUnit, ShardedWeightsLoadAndMismatchesAreListed) {
    test::TempDir dir;
    const auto folder = dir.path() / "unet";
    std::filesystem::create_directories(folder);
    std::ofstream(folder / "config.json") << sd1_config().dump();
    EXPECT_THROW(load_unet(folder), DataError);  // config but no weights

    UNet2DConditionModel a = build(sd1_config());
    const auto files =
        io::save_sharded_safetensors(folder, "diffusion_pytorch_model", state_dict(*a), 1 << 20);
    ASSERT_GT(files.size(), 2u);  // an index and several shards
    UNet2DConditionModel b = load_unet(folder);
    EXPECT_TRUE(at::equal(a->named_parameters()["up_blocks.2.resnets.1.conv2.weight"],
                          b->named_parameters()["up_blocks.2.resnets.1.conv2.weight"]));

    // A checkpoint from another config (no conv_shortcut in that ResNet) is reported by name.
    std::filesystem::remove_all(folder);
    std::filesystem::create_directories(folder);
    std::ofstream(folder / "config.json") << sd1_config().dump();
    io::TensorList partial = state_dict(*a);
    std::erase_if(partial,
                  [](const auto& kv) { return kv.first == "up_blocks.0.resnets.0.conv_shortcut.bias"; });
    io::save_safetensors(folder / "diffusion_pytorch_model.safetensors", partial);
    try {
        load_unet(folder);
        ADD_FAILURE() << "missing key not reported";
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("up_blocks.0.resnets.0.conv_shortcut.bias"), std::string::npos)
            << e.what();
    }
}

TEST(UNetUnit, CheckpointingGivesTheSameGradients) {
    UNet2DConditionModel unet = build(sd1_config());
    const Inputs in = inputs();
    auto grads = [&](bool checkpoint) {
        unet->set_gradient_checkpointing(checkpoint);
        unet->zero_grad();
        unet->forward(in.sample, in.timestep, in.context).square().mean().backward();
        std::vector<at::Tensor> out;
        for (const auto& p : unet->parameters()) out.push_back(p.grad().clone());
        return out;
    };
    const auto plain = grads(false);
    const auto recomputed = grads(true);
    ASSERT_EQ(plain.size(), recomputed.size());
    for (std::size_t i = 0; i < plain.size(); ++i) {
        ASSERT_TRUE(recomputed[i].defined()) << i;
        EXPECT_LE(test::max_abs_diff(plain[i], recomputed[i]),
                  1e-6 + 1e-5 * plain[i].abs().max().item<double>())
            << i;
    }
}

// Backward-graph nodes reachable from `out` whose name contains `what`.
int64_t count_nodes(const at::Tensor& out, const std::string& what) {
    std::vector<torch::autograd::Node*> todo{out.grad_fn().get()};
    std::set<torch::autograd::Node*> seen;
    int64_t found = 0;
    while (!todo.empty()) {
        torch::autograd::Node* n = todo.back();
        todo.pop_back();
        if (!n || !seen.insert(n).second) continue;
        if (n->name().find(what) != std::string::npos) ++found;
        for (const auto& e : n->next_edges()) todo.push_back(e.function.get());
    }
    return found;
}

// gradient_checkpointing_interval: every n-th ResNet/transformer block (forward order) gets one
// recompute node in the backward graph, the rest none; gradients stay those of the plain model.
TEST(UNetUnit, CheckpointingIntervalPicksEveryNthBlock) {
    UNet2DConditionModel unet = build(sd1_config());
    const Inputs in = inputs();
    auto run = [&](bool enabled, int64_t interval, std::vector<at::Tensor>* grads) {
        unet->set_gradient_checkpointing(enabled, interval);
        unet->zero_grad();
        const at::Tensor loss = unet->forward(in.sample, in.timestep, in.context).square().mean();
        const int64_t nodes = count_nodes(loss, "Recompute");
        loss.backward();
        for (const auto& p : unet->parameters()) grads->push_back(p.grad().clone());
        return nodes;
    };
    std::vector<at::Tensor> plain;
    EXPECT_EQ(run(false, 1, &plain), 0);
    std::vector<at::Tensor> all;
    const int64_t units = run(true, 1, &all);
    EXPECT_EQ(unet->checkpointed_blocks(), std::make_pair(units, units));
    EXPECT_GE(units, 6);  // the tiny config's ResNets and transformer blocks
    for (int64_t interval : {int64_t{2}, int64_t{3}, units + 1}) {
        SCOPED_TRACE("interval " + std::to_string(interval));
        std::vector<at::Tensor> grads;
        const int64_t nodes = run(true, interval, &grads);
        EXPECT_EQ(nodes, (units + interval - 1) / interval);
        EXPECT_EQ(unet->checkpointed_blocks(), std::make_pair(nodes, units));
        ASSERT_EQ(grads.size(), plain.size());
        for (size_t i = 0; i < plain.size(); ++i)
            EXPECT_LE(test::max_abs_diff(plain[i], grads[i]),
                      1e-6 + 1e-5 * plain[i].abs().max().item<double>())
                << i;
    }
    EXPECT_THROW(unet->set_gradient_checkpointing(true, 0), UsageError);
}

TEST(UNetUnit, CheckpointedFunctionRecomputesInBackward) {
    at::Tensor x = torch::randn({3, 4}, torch::requires_grad());
    at::Tensor w = torch::randn({4}, torch::requires_grad());
    int calls = 0;
    auto fn = [&](const std::vector<at::Tensor>& in) {
        ++calls;
        return (in[0] * w).sin();
    };
    checkpointed(fn, {x}, {w}).sum().backward();
    EXPECT_EQ(calls, 2);  // once in forward, once in backward
    // d/dx sum(sin(x*w)) = cos(x*w) * w; d/dw = sum_rows cos(x*w) * x
    const at::Tensor c = (x * w).cos().detach();
    EXPECT_LE(test::max_abs_diff(x.grad(), c * w.detach()), 1e-6);
    EXPECT_LE(test::max_abs_diff(w.grad(), (c * x.detach()).sum(0)), 1e-6);
}

// Each checkpointed() call has its own number, seen by its body in the forward and again in its
// recomputation (and 0 outside): what attention_stash.h matches a kept output to its recomputation by.
TEST(UNetUnit, CheckpointCallNumberIsTheSameInForwardAndRecomputation) {
    EXPECT_EQ(checkpoint_call(), 0u);
    const at::Tensor x = at::randn({3, 4}).requires_grad_(true);
    std::vector<std::pair<uint64_t, bool>> seen;  // (call, in recomputation)
    const CheckpointFn fn = [&](const std::vector<at::Tensor>& in) {
        seen.emplace_back(checkpoint_call(), in_recompute());
        return in[0].sin();
    };
    // Two calls, one loss: both forwards run before either recomputation (which go in reverse).
    (checkpointed(fn, {x}, {}) + checkpointed(fn, {x * 2}, {})).sum().backward();
    ASSERT_EQ(seen.size(), 4u);
    EXPECT_NE(seen[0].first, 0u);
    EXPECT_NE(seen[1].first, seen[0].first);
    EXPECT_FALSE(seen[0].second || seen[1].second);
    EXPECT_TRUE(seen[2].second && seen[3].second);
    EXPECT_EQ(seen[2].first, seen[1].first);  // the second call's recomputation comes first
    EXPECT_EQ(seen[3].first, seen[0].first);
    EXPECT_EQ(checkpoint_call(), 0u);
}

TEST(UNetUnit, CheckpointRecomputesUnderTheForwardsAutocast) {
    // Under CPU bf16 autocast the matmul rounds to bf16. Backward runs after the autocast scope has
    // closed, so a recomputation that did not re-enter it would give float32 gradients instead.
    at::manual_seed(3);
    const at::Tensor x0 = at::randn({8, 16}), w0 = at::randn({16, 16});
    auto grad_of_w = [&](bool checkpoint, bool autocast) {
        at::Tensor w = w0.clone().requires_grad_(true);
        const CheckpointFn fn = [&](const std::vector<at::Tensor>& in) { return at::mm(in[0], w).sin(); };
        at::Tensor out;
        at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
        at::autocast::set_autocast_enabled(at::kCPU, autocast);
        out = checkpoint ? checkpointed(fn, {x0}, {w}) : fn({x0});
        at::autocast::set_autocast_enabled(at::kCPU, false);
        at::autocast::clear_cache();
        out.to(at::kFloat).sum().backward();
        return w.grad();
    };
    const at::Tensor plain = grad_of_w(false, true);
    EXPECT_GT(test::max_abs_diff(plain, grad_of_w(false, false)), 1e-3);  // bf16 really differs
    EXPECT_LE(test::max_abs_diff(grad_of_w(true, true), plain), 1e-6);
}

TEST(UNetUnit, NormsKeepBf16UnderAutocast) {
    at::manual_seed(5);
    torch::nn::GroupNorm gn(torch::nn::GroupNormOptions(4, 16).eps(1e-5));
    torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({16}).eps(1e-5));
    torch::NoGradGuard no_grad;
    gn->weight.uniform_(0.5, 1.5), gn->bias.uniform_(-0.5, 0.5);
    ln->weight.uniform_(0.5, 1.5), ln->bias.uniform_(-0.5, 0.5);
    const at::Tensor x = at::randn({2, 16, 4, 4}) * 3 + 1;  // [B, C, H, W]
    const at::Tensor seq = x.flatten(2).transpose(1, 2);    // [B, HW, C]
    // Without autocast: exactly the module.
    EXPECT_TRUE(at::equal(norm_forward(*gn, x), gn->forward(x)));
    EXPECT_TRUE(at::equal(norm_forward(*ln, seq), ln->forward(seq)));
    // Under autocast a bf16 input stays bf16 and matches the float32 result to bf16 precision.
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    const at::Tensor g16 = norm_forward(*gn, x.to(at::kBFloat16));
    const at::Tensor l16 = norm_forward(*ln, seq.to(at::kBFloat16));
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    EXPECT_EQ(g16.scalar_type(), at::kBFloat16);
    EXPECT_EQ(l16.scalar_type(), at::kBFloat16);
    EXPECT_LE(test::max_abs_diff(g16.to(at::kFloat), gn->forward(x.to(at::kBFloat16).to(at::kFloat))), 0.05);
    EXPECT_LE(test::max_abs_diff(l16.to(at::kFloat), ln->forward(seq.to(at::kBFloat16).to(at::kFloat))),
              0.05);
}

TEST(UNetUnit, ChannelsLastMatchesContiguous) {
    UNet2DConditionModel unet = build(sd1_config());
    torch::NoGradGuard no_grad;
    const Inputs in = inputs();
    const at::Tensor ref = unet->forward(in.sample, in.timestep, in.context);
    unet->set_channels_last(true);
    EXPECT_TRUE(unet->named_parameters()["conv_in.weight"].is_contiguous(at::MemoryFormat::ChannelsLast));
    EXPECT_LE(test::max_abs_diff(unet->forward(in.sample, in.timestep, in.context), ref), 1e-5);
}

void expect_usage_error(nlohmann::json json, const std::string& key) {
    try {
        build(json);
        ADD_FAILURE() << "no error for " << key;
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("`" + key + "`"), std::string::npos) << e.what();
    }
}

TEST(UNetUnit, UnsupportedConfigValuesNameTheKey) {
    auto j = sd1_config();
    j["addition_embed_type"] = "text";
    expect_usage_error(j, "addition_embed_type");
    j = sd1_config();
    j["resnet_time_scale_shift"] = "scale_shift";
    expect_usage_error(j, "resnet_time_scale_shift");
    j = sd1_config();
    j["down_block_types"][0] = "AttnDownBlock2D";
    expect_usage_error(j, "down_block_types");
    j = sd1_config();
    j["class_embed_type"] = "timestep";
    expect_usage_error(j, "class_embed_type");
    j = sd1_config();
    j["attention_head_dim"] = {4, 4};  // wrong length is a DataError naming the key
    EXPECT_THROW(build(j), DataError);
}

TEST(UNetUnit, MissingFolderOrConfigNamesThePath) {
    test::TempDir dir;
    try {
        load_unet(dir / "nope");
        ADD_FAILURE();
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find((dir / "nope").string()), std::string::npos) << e.what();
    }
    try {
        load_unet(dir.path());
        ADD_FAILURE();
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find((dir / "config.json").string()), std::string::npos) << e.what();
    }
}

TEST(UNetUnit, SDXLWithoutAddedConditioningIsAUsageError) {
    auto j = sd1_config();
    j["addition_embed_type"] = "text_time";
    j["addition_time_embed_dim"] = 8;
    j["projection_class_embeddings_input_dim"] = 80;
    UNet2DConditionModel unet = build(j);
    torch::NoGradGuard no_grad;
    const Inputs in = inputs();
    EXPECT_THROW(unet->forward(in.sample, in.timestep, in.context), UsageError);
    // 32 pooled + 6 ids * 8 = 80 features
    EXPECT_EQ(
        unet->forward(in.sample, in.timestep, in.context, {at::randn({2, 32}), at::randn({2, 6})}).sizes(),
        in.sample.sizes());
}

}  // namespace
}  // namespace test_unet_unit_local
}  // namespace dtune::models
