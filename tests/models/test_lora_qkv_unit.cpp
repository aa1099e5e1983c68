// The fused q/k/v LoRA projections (adapters/lora_qkv.h) against the layer-by-layer path: an
// SDXL-shaped attention with LoRA on to_q/to_k/to_v/to_out.0 (self- and cross-attention, with and
// without bias and lora_dropout, float64 and bf16 autocast), packed gradients, the tiny SDXL UNet and
// the tiny Flux transformer; the cases that must fall back; names and values of the weights kept.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/autocast_mode.h>

#include <set>

#include "model_test_util.h"
#include "models/adapters/lora.h"
#include "models/adapters/lora_qkv.h"
#include "models/common/attention.h"
#include "models/common/quantize.h"
#include "models/common/weights.h"
#include "models/flux/flux_transformer.h"
#include "models/unet/unet_2d_condition.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_lora_qkv_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

// The fused path is off by default until checked on a GPU (lora_qkv.cpp); these tests turn it on
// for the whole binary and switch it per case where they compare.
const bool kFusedQkvOn = [] {
    set_fused_qkv_lora(true);
    return true;
}();

const std::vector<std::string> kQkvTargets = {"to_k", "to_q", "to_v", "to_out.0"};

LoRAConfig qkv_lora(double dropout = 0.0, int64_t rank = 4) {
    LoRAConfig c;
    c.rank = rank;
    c.alpha = 2.0 * static_cast<double>(rank);  // s = 2
    c.dropout = dropout;
    c.target_modules = kQkvTargets;
    return c;
}

AttentionOptions attention_options(int64_t query_dim, int64_t heads, int64_t head_dim, bool qkv_bias) {
    AttentionOptions o;
    o.query_dim = query_dim;
    o.heads = heads;
    o.head_dim = head_dim;
    o.qkv_bias = qkv_bias;
    return o;
}

// Non-zero factors (B is zero at init), drawn from a fixed generator.
void randomise(LoRAAdapters& adapters, uint64_t seed = 7, double scale = 0.5) {
    at::NoGradGuard no_grad;
    auto gen = at::detail::createCPUGenerator(seed);
    for (auto& t : adapters.parameters()) t.copy_(at::randn(t.sizes(), gen).to(t.scalar_type()) * scale);
}

// Everything a run produced: the output, then the input's (and context's) gradient and every
// adapter factor's gradient in adapter order.
struct QkvRun {
    at::Tensor y;
    std::vector<at::Tensor> grads;
};

double worst_relative(const QkvRun& a, const QkvRun& b) {
    double worst = test::max_abs_diff(a.y, b.y) / (b.y.abs().max().item<double>() + 1e-30);
    EXPECT_EQ(a.grads.size(), b.grads.size());
    for (std::size_t i = 0; i < a.grads.size() && i < b.grads.size(); ++i) {
        EXPECT_EQ(a.grads[i].defined(), b.grads[i].defined()) << i;
        if (!a.grads[i].defined() || !b.grads[i].defined()) continue;
        EXPECT_EQ(a.grads[i].scalar_type(), b.grads[i].scalar_type()) << i;
        worst = std::max(worst, test::max_abs_diff(a.grads[i], b.grads[i]) /
                                    (b.grads[i].abs().max().item<double>() + 1e-30));
    }
    return worst;
}

struct AttentionCase {
    bool cross = false;
    bool bias = false;
    double dropout = 0.0;
    bool autocast_bf16 = false;  // bf16 base, float32 factors, CPU autocast (how dtune trains)
    // The factors' bf16 copies (LoRAAdapters::refresh_cast_factors, as a bf16 training step makes
    // them), taken before the factors are tripled in place: a run that reads the copies gives the
    // bits of a run without them, one that reads the factors does not.
    bool stale_copies = false;
};

// One forward/backward of an SDXL-shaped attention (2 heads of 16) with LoRA on q/k/v/out, through the
// fused projections or not. `expect_fused`: whether the q/k/v group must take the fused function.
QkvRun run_attention(const AttentionCase& c, bool fused, bool expect_fused = true) {
    torch::manual_seed(3);
    AttentionOptions o;
    o.query_dim = 32;
    o.heads = 2;
    o.head_dim = 16;
    o.qkv_bias = c.bias;
    o.cross_attention_dim = c.cross ? 24 : 0;
    torch::nn::Module root;
    Attention attn = root.register_module("attn1", Attention(o));
    LoRAAdapters adapters = inject_lora(root, qkv_lora(c.dropout));
    const at::ScalarType dtype = c.autocast_bf16 ? at::kFloat : at::kDouble;
    root.to(dtype);
    if (c.autocast_bf16) {
        at::NoGradGuard no_grad;
        for (auto& item : root.named_parameters())
            if (item.key().find(".lora_") == std::string::npos)
                item.value().set_data(item.value().to(at::kBFloat16));
    }
    EXPECT_EQ(pack_lora_projection_groups(root), 1);  // .to() gave each weight its own storage again
    randomise(adapters);
    if (c.stale_copies) {
        adapters.refresh_cast_factors(at::kBFloat16);
        at::NoGradGuard no_grad;
        for (auto& t : adapters.parameters()) t.mul_(3.0);
    }
    root.train();
    if (c.dropout > 0) adapters.set_dropout_seed(11);
    const auto opts = at::TensorOptions().dtype(dtype);
    const at::Tensor x = at::randn({2, 6, 32}, opts).requires_grad_(true);
    const at::Tensor ctx = c.cross ? at::randn({2, 5, 24}, opts).requires_grad_(true) : at::Tensor();
    const at::Tensor g = at::randn({2, 6, 32}, opts);
    set_fused_qkv_lora(fused);
    const ProjectionGroup group = attn->projection_groups().at(0);
    EXPECT_EQ(projection_group_fuses(c.cross ? ctx : x, group), fused && expect_fused);
    at::Tensor y;
    if (c.autocast_bf16) {
        at::autocast::set_autocast_enabled(at::kCPU, true);
        at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    }
    y = attn->forward(x, ctx);
    if (c.autocast_bf16) at::autocast::set_autocast_enabled(at::kCPU, false);
    set_fused_qkv_lora(true);
    y.backward(g.to(y.scalar_type()));
    QkvRun run{y.detach(), {x.grad()}};
    if (c.cross) run.grads.push_back(ctx.grad());
    for (auto& t : adapters.parameters()) run.grads.push_back(t.grad());
    return run;
}

TEST(LoRAQkv, SelfAttentionMatchesLayerByLayerInFloat64) {
    for (const bool bias : {false, true}) {
        for (const double dropout : {0.0, 0.5}) {
            SCOPED_TRACE(testing::Message() << "bias " << bias << " dropout " << dropout);
            const AttentionCase c{false, bias, dropout, false};
            const QkvRun fused = run_attention(c, true), plain = run_attention(c, false);
            EXPECT_LE(worst_relative(fused, plain), 1e-12);
            for (const auto& t : fused.grads) EXPECT_GT(t.abs().max().item<double>(), 1e-3);
        }
    }
}

TEST(LoRAQkv, CrossAttentionKeyValueMatchesLayerByLayer) {
    for (const double dropout : {0.0, 0.5}) {
        SCOPED_TRACE(dropout);
        const AttentionCase c{true, false, dropout, false};
        const QkvRun fused = run_attention(c, true), plain = run_attention(c, false);
        EXPECT_LE(worst_relative(fused, plain), 1e-12);
        EXPECT_GT(fused.grads[1].abs().max().item<double>(), 1e-3);  // the context's gradient
    }
}

// bf16 autocast with float32 factors: the same dtypes as the layer-by-layer path, values within bf16
// rounding of it.
TEST(LoRAQkv, Bf16AutocastMatchesLayerByLayer) {
    for (const double dropout : {0.0, 0.5}) {
        SCOPED_TRACE(dropout);
        const AttentionCase c{false, true, dropout, true};
        const QkvRun fused = run_attention(c, true), plain = run_attention(c, false);
        EXPECT_EQ(fused.y.scalar_type(), at::kBFloat16);
        for (std::size_t i = 1; i < fused.grads.size(); ++i)
            EXPECT_EQ(fused.grads[i].scalar_type(), at::kFloat);
        EXPECT_LE(worst_relative(fused, plain), 3e-2);
    }
}

// With the factors' bf16 copies (a bf16 training step refreshes them as its forward starts) the
// fused function reads them, A_q; A_k; A_v as one view of the copies' buffer and each B: the bits
// of the run that casts the factors itself, though the factors changed after the copies were made.
TEST(LoRAQkv, Bf16FactorCopiesAreWhatTheFusedFunctionReads) {
    for (const double dropout : {0.0, 0.5}) {
        SCOPED_TRACE(dropout);
        const QkvRun cast = run_attention({false, true, dropout, true}, true);
        const QkvRun copied = run_attention({false, true, dropout, true, /*stale_copies=*/true}, true);
        EXPECT_TRUE(at::equal(copied.y, cast.y));
        ASSERT_EQ(copied.grads.size(), cast.grads.size());
        for (std::size_t i = 0; i < cast.grads.size(); ++i)
            EXPECT_TRUE(at::equal(copied.grads[i], cast.grads[i])) << i;
    }
}

// The dropout masks are each adapter's own: another seed changes the result, and the masked fused
// run is not the unmasked one.
TEST(LoRAQkv, DropoutMasksMatter) {
    const QkvRun masked = run_attention({false, false, 0.5, false}, true);
    const QkvRun unmasked = run_attention({false, false, 0.0, false}, true);
    EXPECT_GT(worst_relative(masked, unmasked), 1e-3);
}

// A tiny SDXL-like group run directly, its outputs joined by a cat: cat's backward hands the three
// gradients over as column slices of one tensor, so dx is one GEMM over the packed weight.
TEST(LoRAQkv, PackedGradientsTakeOneGemmAndMatch) {
    auto run = [](bool fused) {
        torch::manual_seed(5);
        AttentionOptions o;
        o.query_dim = 20;
        o.heads = 3;
        o.head_dim = 8;
        torch::nn::Module root;
        Attention attn = root.register_module("attn1", Attention(o));
        LoRAAdapters adapters = inject_lora(root, qkv_lora(0.0, 2));
        root.to(at::kDouble);
        pack_lora_projection_groups(root);
        randomise(adapters);
        const at::Tensor x = at::randn({3, 7, 20}, at::kDouble).requires_grad_(true);
        set_fused_qkv_lora(fused);
        const auto out = project_group(x, attn->projection_groups().at(0));
        set_fused_qkv_lora(true);
        const at::Tensor y = at::cat(out, -1);  // [3, 7, 72]
        y.backward(at::randn(y.sizes(), at::kDouble));
        QkvRun r{y.detach(), {x.grad()}};
        for (auto& t : adapters.parameters())
            if (t.grad().defined()) r.grads.push_back(t.grad());
        return r;
    };
    const QkvRun fused = run(true), plain = run(false);
    ASSERT_EQ(fused.grads.size(), 7u);  // x, then A and B of q, k, v (to_out.0 is unused here)
    EXPECT_LE(worst_relative(fused, plain), 1e-12);
}

// A base quantised before injection (base_model_precision, as the trainer orders it): the group is
// laid out with its scales and fused, through the packed-gradient GEMM (project_group + cat) and
// the per-layer input gradients (the attention's own backward), equal to the layer-by-layer run.
TEST(LoRAQkv, QuantisedBasesAreLaidOutAndMatchLayerByLayer) {
    for (const std::string preset : {"fp8-torchao", "int8-quanto"}) {
        for (const bool packed_grads : {true, false}) {
            auto run = [&](bool fused) {
                torch::manual_seed(9);
                torch::nn::Module root;
                Attention attn = root.register_module("attn1", Attention(attention_options(32, 2, 16, true)));
                const QuantizeReport report =
                    quantize_module(root, parse_quant_preset(preset, "base_model_precision"));
                EXPECT_EQ(report.layers, 4) << preset;
                LoRAAdapters adapters = inject_lora(root, qkv_lora(0.25));
                const ProjectionGroup group = attn->projection_groups().at(0);
                const at::Tensor w = packed_weight(group), s = packed_weight_scale(group);
                EXPECT_TRUE(w.defined()) << preset;
                EXPECT_TRUE(s.defined()) << preset;
                EXPECT_EQ(w.scalar_type(), group[0]->weight.scalar_type());
                EXPECT_NE(w.scalar_type(), at::kFloat) << preset;  // still quantised
                EXPECT_EQ(s.sizes(), at::IntArrayRef({96}));
                randomise(adapters);
                root.train();
                adapters.set_dropout_seed(5);
                const at::Tensor x = at::randn({2, 6, 32}).requires_grad_(true);
                set_fused_qkv_lora(fused);
                EXPECT_EQ(projection_group_fuses(x, group), fused) << preset;
                at::Tensor y;
                if (packed_grads) {
                    y = at::cat(project_group(x, group), -1);  // gradients arrive as slices of one buffer
                } else {
                    y = attn->forward(x, at::Tensor());
                }
                set_fused_qkv_lora(true);
                y.backward(at::randn(y.sizes()));
                QkvRun r{y.detach(), {x.grad()}};
                for (auto& t : adapters.parameters())
                    if (t.grad().defined()) r.grads.push_back(t.grad());
                return r;
            };
            const QkvRun fused = run(true), plain = run(false);
            EXPECT_GE(fused.grads.size(), 7u) << preset;
            EXPECT_LE(worst_relative(fused, plain), 1e-5)
                << preset << (packed_grads ? " packed" : " per layer");
        }
    }
}

TEST(LoRAQkv, InjectPacksTheWeightsKeepingNamesAndValues) {
    torch::manual_seed(1);
    auto root = std::make_shared<torch::nn::Module>();
    Attention attn = root->register_module("attn1", Attention(attention_options(16, 2, 8, true)));
    std::map<std::string, at::Tensor> before;
    for (const auto& [name, t] : state_dict(*root)) before[name] = t.clone();
    LoRAAdapters adapters = inject_lora(*root, qkv_lora());
    const ProjectionGroup group = attn->projection_groups().at(0);
    const at::Tensor w = packed_weight(group), b = packed_bias(group);
    ASSERT_TRUE(w.defined());
    ASSERT_TRUE(b.defined());
    EXPECT_EQ(w.sizes(), at::IntArrayRef({48, 16}));
    EXPECT_EQ(w.data_ptr(), group[0]->weight.data_ptr());
    std::set<std::string> names;
    for (const auto& [name, t] : state_dict(*root)) {
        names.insert(name);
        if (name.find(".lora_") != std::string::npos) continue;
        ASSERT_TRUE(before.count(name)) << name;
        EXPECT_TRUE(at::equal(t, before.at(name))) << name;
    }
    for (const auto& [name, _] : before) EXPECT_TRUE(names.count(name)) << name;
    // The parameters are still the layers' own registered tensors (their values move together).
    EXPECT_TRUE(root->named_parameters()["attn1.to_k.weight"].is_same(group[1]->weight));
    EXPECT_FALSE(group[1]->weight.requires_grad());
    // The adapters' own (exported) names do not change either.
    std::vector<std::string> lora_names;
    for (const auto& [name, _] : adapters.named_parameters()) lora_names.push_back(name);
    EXPECT_EQ(lora_names.front(), "attn1.to_q.lora_A.weight");
    EXPECT_EQ(lora_names.size(), 8u);
    // merge() adds into the packed slices in place; unmerge restores them.
    at::NoGradGuard no_grad;
    randomise(adapters);
    adapters.merge();
    EXPECT_TRUE(packed_weight(group).defined());
    adapters.unmerge();
    EXPECT_LE(test::max_abs_diff(group[2]->weight, before.at("attn1.to_v.weight")), 1e-6);
}

// Whatever breaks adjacency or the single-layer fused path's own conditions runs layer by layer.
TEST(LoRAQkv, FallsBackWhereTheFusedPathDoesNotApply) {
    AttentionOptions o;
    o.query_dim = 16;
    o.heads = 2;
    o.head_dim = 8;
    const at::Tensor x = at::randn({2, 3, 16});
    auto build = [&](LoRAConfig c) {
        auto root = std::make_shared<torch::nn::Module>();
        Attention attn = root->register_module("attn1", Attention(o));
        auto adapters = std::make_shared<LoRAAdapters>(inject_lora(*root, c));
        return std::make_tuple(root, attn, adapters);
    };
    {
        auto [root, attn, adapters] = build(qkv_lora());
        const ProjectionGroup group = attn->projection_groups().at(0);
        EXPECT_TRUE(projection_group_fuses(x, group));
        {
            at::NoGradGuard no_grad;  // a checkpointed block's first forward: the same path
            EXPECT_TRUE(projection_group_fuses(x, group));
            root->eval();  // inference
            EXPECT_FALSE(projection_group_fuses(x, group));
            root->train();
        }
        set_fused_qkv_lora(false);
        EXPECT_FALSE(projection_group_fuses(x, group));
        set_fused_qkv_lora(true);
        set_fused_lora(false);  // the single-layer switch turns this one off too
        EXPECT_FALSE(projection_group_fuses(x, group));
        set_fused_lora(true);
        root->train();
        adapters->set_enabled(false);
        EXPECT_FALSE(projection_group_fuses(x, group));
        adapters->set_enabled(true);
        group[1]->weight.set_data(group[1]->weight.clone());  // no longer adjacent (e.g. after .to())
        EXPECT_FALSE(projection_group_fuses(x, group));
        EXPECT_TRUE(pack_projection_group(group));  // packed again
        EXPECT_TRUE(projection_group_fuses(x, group));
        group[0]->weight.set_data(group[0]->weight.to(at::kDouble));  // dtypes differ
        EXPECT_FALSE(projection_group_fuses(x, group));
        EXPECT_FALSE(pack_projection_group(group));
    }
    {
        LoRAConfig c = qkv_lora();
        c.use_dora = true;
        auto [root, attn, adapters] = build(c);
        EXPECT_FALSE(packed_weight(attn->projection_groups().at(0)).defined());  // DoRA: not laid out
        EXPECT_EQ(pack_lora_projection_groups(*root), 0);
    }
    {
        LoRAConfig c = qkv_lora();
        c.target_modules = {"to_q", "to_k"};  // to_v carries no adapter
        auto [root, attn, adapters] = build(c);
        EXPECT_FALSE(packed_weight(attn->projection_groups().at(0)).defined());
        EXPECT_FALSE(projection_group_fuses(x, attn->projection_groups().at(0)));
    }
    {
        LoRAConfig c = qkv_lora(0.0, 2);
        c.target_modules = {"to_q"};
        auto [root, attn, adapters] = build(c);
        LoRAConfig c4 = qkv_lora(0.0, 4);
        c4.target_modules = {"to_k", "to_v"};
        c4.freeze_base = false;  // keeps to_q's adapter trainable (the base is frozen already)
        LoRAAdapters more = inject_lora(*root, c4);  // unequal ranks: laid out, but not fused
        const ProjectionGroup group = attn->projection_groups().at(0);
        EXPECT_EQ(pack_lora_projection_groups(*root), 0);
        EXPECT_TRUE(pack_projection_group(group));
        EXPECT_FALSE(projection_group_fuses(x, group));
    }
    {
        LoRAConfig c = qkv_lora(0.5);  // dropout without a seeded mask: at::dropout, not recomputable
        auto [root, attn, adapters] = build(c);
        root->train();
        EXPECT_FALSE(projection_group_fuses(x, attn->projection_groups().at(0)));
        adapters->set_dropout_seed(3);
        EXPECT_TRUE(projection_group_fuses(x, attn->projection_groups().at(0)));
    }
    {
        LoRAConfig c = qkv_lora();
        c.freeze_base = false;  // a trainable base is not laid out (and needs its own gradients)
        auto [root, attn, adapters] = build(c);
        EXPECT_FALSE(packed_weight(attn->projection_groups().at(0)).defined());
        EXPECT_FALSE(projection_group_fuses(x, attn->projection_groups().at(0)));
    }
}

// The tiny SDXL UNet with SimpleTuner's default targets and lora_dropout, gradient checkpointing on:
// every attn1 q/k/v and attn2 k/v group is laid out and fused; the output and every adapter's
// gradient equal the layer-by-layer run's to float64 rounding (in float32 the two GEMM orders
// differed by up to 1.4e-4 relative under a parallel ctest, against 5e-5 alone).
TEST(LoRAQkv, TinyUNetMatchesLayerByLayer) {
    const io::SafetensorsFile io(test::fixtures_dir() / "reference" / "unet_io.safetensors");
    const auto get = [&](const char* n) { return io.get(n).to(at::kDouble).clone(); };
    auto run = [&](bool fused) {
        UNet2DConditionModel unet = load_unet(test::fixtures_dir() / "tiny-sdxl" / "unet");
        unet->to(at::kDouble);
        LoRAConfig c = qkv_lora(0.25);
        LoRAAdapters adapters = inject_lora(*unet, c);
        int64_t groups = 0, blocks = 0;
        for (const auto& m : unet->modules(false)) {
            if (auto* host = dynamic_cast<ProjectionGroupHost*>(m.get())) {
                ++blocks;
                groups += packed_weight(host->projection_groups().at(0)).defined() ? 1 : 0;
            }
        }
        EXPECT_GT(blocks, 0);
        EXPECT_EQ(groups, blocks);
        // Factors of a trained adapter's size: at 0.5 the adapted UNet is chaotic (gradients ~1e19)
        // and rounding-level differences between the two GEMM orders grow to O(1) in its output.
        randomise(adapters, 9, 0.02);
        unet->train();
        unet->set_gradient_checkpointing(true);
        adapters.set_dropout_seed(4);
        set_fused_qkv_lora(fused);
        const at::Tensor out = unet->forward(get("sample"), get("timestep"), get("encoder_hidden_states"),
                                             {get("text_embeds"), get("time_ids")});
        out.pow(2).mean().backward();
        set_fused_qkv_lora(true);
        QkvRun r{out.detach(), {}};
        for (auto& t : adapters.parameters()) r.grads.push_back(t.grad());
        return r;
    };
    const QkvRun fused = run(true), plain = run(false);
    EXPECT_LE(worst_relative(fused, plain), 1e-9);
}

// The tiny Flux transformer with LoRA on both streams' q/k/v (and the outputs): each double block's
// two groups and each single block's one are laid out and fused; values equal the layer-by-layer
// run's to float32 rounding.
TEST(LoRAQkv, TinyFluxMatchesLayerByLayer) {
    const std::filesystem::path ref = std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref";
    const io::SafetensorsFile io(ref / "flux_transformer_io.safetensors");
    const auto get = [&](const char* n) { return test::fixture_tensor(io, n); };
    auto run = [&](bool fused, double dropout) {
        FluxTransformer2DModel model = load_flux_transformer(ref / "tiny-flux-dev");
        LoRAConfig c = qkv_lora(dropout);
        c.target_modules = {"to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0"};
        LoRAAdapters adapters = inject_lora(*model, c);
        EXPECT_EQ(pack_lora_projection_groups(*model),
                  2 * model->config().num_layers + model->config().num_single_layers);
        randomise(adapters, 13);
        model->train();
        adapters.set_dropout_seed(8);
        set_fused_qkv_lora(fused);
        const at::Tensor x = get("hidden").clone().requires_grad_(true);
        const at::Tensor out = model->forward(x, get("encoder"), get("pooled"), get("timestep"),
                                              get("guidance"), get("img_ids"), get("txt_ids"));
        out.pow(2).mean().backward();
        set_fused_qkv_lora(true);
        QkvRun r{out.detach(), {x.grad()}};
        for (auto& t : adapters.parameters()) r.grads.push_back(t.grad());
        return r;
    };
    for (const double dropout : {0.0, 0.25}) {
        SCOPED_TRACE(dropout);
        EXPECT_LE(worst_relative(run(true, dropout), run(false, dropout)), 1e-4);
    }
}

}  // namespace
}  // namespace test_lora_qkv_unit_local
}  // namespace dtune::models
