// LoRA / DoRA on small hand-built layers: targeting rules, init, freezing, a DoRA case computed by
// hand (forward and gradients, which show the norm is detached), LoCon convs against an
// independently built weight, merge/unmerge, dropout, and file round trips of DoRA adapters.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/autocast_mode.h>

#include <cmath>
#include <optional>

#include "core/error.h"
#include "model_test_util.h"
#include "models/adapters/lora_io.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_lora_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

// A miniature of the UNet's naming: attn.to_q / attn.to_out.0 (Linear), conv1 (3×3 conv), norm.
class TinyImpl : public torch::nn::Module {
  public:
    TinyImpl() {
        auto attn = register_module("attn", std::make_shared<torch::nn::Module>());
        to_q = attn->register_module("to_q", AdaptableLinear(3, 2));
        to_out = attn->register_module("to_out", torch::nn::ModuleList(AdaptableLinear(2, 3)));
        xto_q = register_module("xto_q", AdaptableLinear(3, 3));
        conv1 =
            register_module("conv1", AdaptableConv2d(torch::nn::Conv2dOptions(2, 4, 3).padding(1).stride(2)));
        norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({3})));
    }
    AdaptableLinear to_q{nullptr}, xto_q{nullptr};
    torch::nn::ModuleList to_out{nullptr};
    AdaptableConv2d conv1{nullptr};
    torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Tiny);

LoRAConfig config(std::vector<std::string> targets, int64_t rank = 2, double alpha = 4) {
    LoRAConfig c;
    c.rank = rank;
    c.alpha = alpha;
    c.target_modules = std::move(targets);
    return c;
}

TEST(LoRAUnit, TargetsMatchWholeNameSuffixes) {
    Tiny tiny;
    LoRAAdapters a = inject_lora(*tiny, config({"to_q", "to_out.0"}));
    ASSERT_EQ(a.size(), 2u);  // xto_q is not ".to_q"
    EXPECT_EQ(a.entries()[0].module, "attn.to_q");
    EXPECT_EQ(a.entries()[1].module, "attn.to_out.0");
    EXPECT_EQ(a.named_parameters()[0].first, "attn.to_q.lora_A.weight");
    EXPECT_NE(tiny->named_parameters().find("attn.to_out.0.lora_B.weight"), nullptr);
}

TEST(LoRAUnit, BadTargetsAreUsageErrors) {
    EXPECT_THROW(inject_lora(*Tiny(), config({"to_k"})), UsageError);    // matches nothing
    EXPECT_THROW(inject_lora(*Tiny(), config({"to_out"})), UsageError);  // a ModuleList
    EXPECT_THROW(inject_lora(*Tiny(), config({"norm"})), UsageError);    // not Linear/Conv2d
    EXPECT_THROW(inject_lora(*Tiny(), config({"to_q"}, 0)), UsageError);
    Tiny twice;
    inject_lora(*twice, config({"to_q"}));
    EXPECT_THROW(inject_lora(*twice, config({"attn.to_q"})), UsageError);
    EXPECT_THROW(parse_lora_init("pissa"), UsageError);
    EXPECT_THROW(parse_lora_format("kohya"), UsageError);
    EXPECT_EQ(parse_lora_init("gaussian"), LoRAInit::kGaussian);
    EXPECT_EQ(parse_lora_format("comfyui"), LoRAFormat::kComfyUI);
}

TEST(LoRAUnit, RegexTargetsMatchTheFullName) {
    Tiny tiny;
    LoRAConfig c = config({});
    c.target_regex = ".*q";
    LoRAAdapters a = inject_lora(*tiny, c);
    ASSERT_EQ(a.size(), 2u);
    EXPECT_EQ(a.entries()[1].module, "xto_q");
}

TEST(LoRAUnit, DefaultInitIsAnIdentityAndFreezesTheBase) {
    torch::manual_seed(0);
    Tiny tiny;
    const at::Tensor x = at::randn({5, 3});
    const at::Tensor before = tiny->to_q->forward(x);
    LoRAAdapters a = inject_lora(*tiny, config({"to_q", "conv1"}, 4, 4));
    EXPECT_TRUE(torch::equal(tiny->to_q->forward(x), before));  // B = 0
    LoRALayer& q = *a.find("attn.to_q");
    EXPECT_EQ(q.up().abs().sum().item<double>(), 0.0);
    // kaiming_uniform(a=√5) is uniform on ±1/√fan_in: fan_in 3 here, 2·3·3 = 18 for the conv.
    EXPECT_LE(q.down().abs().max().item<double>(), 1.0 / std::sqrt(3.0));
    EXPECT_GT(q.down().abs().max().item<double>(), 0.0);
    EXPECT_LE(a.find("conv1")->down().abs().max().item<double>(), 1.0 / std::sqrt(18.0));
    EXPECT_EQ(a.find("conv1")->down().sizes(), at::IntArrayRef({4, 2, 3, 3}));
    EXPECT_EQ(a.find("conv1")->up().sizes(), at::IntArrayRef({4, 4, 1, 1}));
    for (const auto& item : tiny->named_parameters()) {
        const bool adapter = item.key().find(".lora_") != std::string::npos;
        EXPECT_EQ(item.value().requires_grad(), adapter) << item.key();
    }
}

// Output and gradients (input, A, B) of an adapted linear after one backward, through the path the
// switch selects. A and B are made non-zero so every term counts.
struct LinearRun {
    at::Tensor y, dx, da, db;
};
LinearRun run_adapted_linear(bool fused, at::ScalarType dtype, bool autocast_bf16, bool bias = true) {
    torch::manual_seed(21);
    auto layer = AdaptableLinear(torch::nn::LinearOptions(24, 20).bias(bias));
    torch::nn::Module root;
    root.register_module("to_q", layer);
    LoRAAdapters a = inject_lora(root, config({"to_q"}, 4, 8));  // s = 2
    root.to(dtype);
    LoRALayer& lora = *a.find("to_q");
    {
        torch::NoGradGuard no_grad;
        lora.down().normal_();
        lora.up().normal_();
    }
    if (autocast_bf16) {  // the trainer's setting: bf16 base weights, float32 factors, autocast
        layer->weight.set_data(layer->weight.to(at::kBFloat16));
        if (bias) layer->bias.set_data(layer->bias.to(at::kBFloat16));
    }
    set_fused_lora(fused);
    const at::Tensor x = at::randn({3, 5, 24}, at::TensorOptions().dtype(dtype)).requires_grad_(true);
    const at::Tensor g = at::randn({3, 5, 20}, at::TensorOptions().dtype(dtype));
    at::Tensor y;
    {
        if (autocast_bf16) {
            at::autocast::set_autocast_enabled(at::kCPU, true);
            at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
        }
        y = layer->forward(x);
        if (autocast_bf16) at::autocast::set_autocast_enabled(at::kCPU, false);
    }
    y.backward(g.to(y.scalar_type()));
    set_fused_lora(true);
    return {y.detach(), x.grad(), lora.down().grad(), lora.up().grad()};
}

TEST(LoRAUnit, FusedTrainingLinearMatchesTheCompositePath) {
    for (bool bias : {true, false}) {  // SDXL's to_q/to_k/to_v have none, to_out.0 has one
        const LinearRun fused = run_adapted_linear(true, at::kDouble, false, bias);
        const LinearRun plain = run_adapted_linear(false, at::kDouble, false, bias);
        EXPECT_LE(test::max_abs_diff(fused.y, plain.y), 1e-12) << bias;
        EXPECT_LE(test::max_abs_diff(fused.dx, plain.dx), 1e-12) << bias;
        EXPECT_LE(test::max_abs_diff(fused.da, plain.da), 1e-12) << bias;
        EXPECT_LE(test::max_abs_diff(fused.db, plain.db), 1e-12) << bias;
        EXPECT_GT(fused.da.abs().max().item<double>(), 0.1);
        EXPECT_GT(fused.db.abs().max().item<double>(), 0.1);
    }
}

// Under bf16 autocast with float32 factors (how dtune trains LoRA): same dtypes as the composite
// path, values within bf16 rounding.
TEST(LoRAUnit, FusedTrainingLinearUnderAutocastKeepsTheDtypes) {
    const LinearRun fused = run_adapted_linear(true, at::kFloat, true);
    const LinearRun plain = run_adapted_linear(false, at::kFloat, true);
    EXPECT_EQ(fused.y.scalar_type(), plain.y.scalar_type());
    EXPECT_EQ(fused.dx.scalar_type(), at::kFloat);
    EXPECT_EQ(fused.da.scalar_type(), at::kFloat);
    EXPECT_EQ(fused.db.scalar_type(), at::kFloat);
    for (auto [f, p] :
         {std::pair{fused.y, plain.y}, {fused.dx, plain.dx}, {fused.da, plain.da}, {fused.db, plain.db}})
        EXPECT_LE(test::max_abs_diff(f.to(at::kFloat), p.to(at::kFloat)),
                  2e-2 * p.abs().max().item<double>());
}

// LoRAAdapters::refresh_cast_factors: one multi-tensor copy of the factors in the compute dtype that
// the fused function reads instead of casting A and B per layer. Same bits as the casts (bf16
// autocast on the CPU, float32 factors), the copies really are what the forward reads (a factor
// changed after the refresh is not seen until the next one), clear_cast_factors() returns the layers
// to casting, and the conv and DoRA layers, which the fused function does not take, are skipped. The
// copies lie back to back (A's, then B's, each in adapter order), also for factors already in bf16.
TEST(LoRAUnit, CastFactorCopiesGiveTheSameBitsAsPerLayerCasts) {
    torch::manual_seed(5);
    Tiny tiny;
    LoRAConfig c = config({"to_q", "xto_q", "conv1"}, 2, 4);
    LoRAAdapters a = inject_lora(*tiny, c);
    {
        torch::NoGradGuard no_grad;
        for (auto& e : a.entries()) {
            e.layer->down().normal_();
            e.layer->up().normal_();
        }
        tiny->to_q->weight.set_data(tiny->to_q->weight.to(at::kBFloat16));
    }
    LoRALayer& q = *a.find("attn.to_q");
    const at::Tensor x = at::randn({4, 3});
    const at::Tensor g = at::randn({4, 2});
    struct Grads {
        at::Tensor y, dx, da, db;
    };
    auto run = [&]() {
        const at::Tensor xi = x.clone().requires_grad_(true);
        for (auto& e : a.entries()) {
            e.layer->down().mutable_grad() = at::Tensor();
            e.layer->up().mutable_grad() = at::Tensor();
        }
        at::autocast::set_autocast_enabled(at::kCPU, true);
        at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
        EXPECT_TRUE(q.takes_whole_forward(xi));
        const at::Tensor y = tiny->to_q->forward(xi);
        at::autocast::set_autocast_enabled(at::kCPU, false);
        at::autocast::clear_cache();
        y.backward(g.to(y.scalar_type()));
        return Grads{y.detach(), xi.grad(), q.down().grad(), q.up().grad()};
    };
    const Grads cast = run();
    a.refresh_cast_factors(at::kBFloat16);
    EXPECT_TRUE(a.cast_factors_live());
    const Grads copied = run();
    for (auto [got, want] :
         {std::pair{copied.y, cast.y}, {copied.dx, cast.dx}, {copied.da, cast.da}, {copied.db, cast.db}})
        EXPECT_TRUE(at::equal(got, want));
    EXPECT_EQ(copied.da.scalar_type(), at::kFloat);  // the factors' own dtype
    // A factor changed after the refresh: the forward still reads the copy, until the next refresh.
    {
        torch::NoGradGuard no_grad;
        q.up().mul_(3.0);
    }
    EXPECT_TRUE(at::equal(run().y, cast.y));
    a.refresh_cast_factors(at::kBFloat16);
    const at::Tensor refreshed = run().y;
    EXPECT_FALSE(at::equal(refreshed, cast.y));
    a.clear_cast_factors();
    EXPECT_FALSE(a.cast_factors_live());
    EXPECT_TRUE(at::equal(run().y, refreshed));  // cast per layer again, from the current factors
    // The conv layer (not the fused function's) has no copy; its forward is untouched.
    a.refresh_cast_factors(at::kBFloat16);
    const at::Tensor img = at::randn({1, 2, 5, 5});
    EXPECT_EQ(tiny->conv1->forward(img).sizes(), (at::IntArrayRef{1, 4, 3, 3}));
    // The linear layers' copies lie back to back in adapter order, A's in one buffer and B's in
    // another (a fused q/k/v group reads them as one matrix each, with no concatenation).
    LoRALayer& xq = *a.find("xto_q");
    for (auto [first, second] : {std::pair{&q.cast_down(), &xq.cast_down()}, {&q.cast_up(), &xq.cast_up()}}) {
        ASSERT_TRUE(first->defined() && second->defined());
        EXPECT_TRUE(second->storage().is_alias_of(first->storage()));
        EXPECT_EQ(second->storage_offset(), first->storage_offset() + (first->numel() + 63) / 64 * 64);
    }
    a.clear_cast_factors();
    // Factors already in the compute dtype (adamw_bf16's bf16 factors) are copied too.
    {
        torch::NoGradGuard no_grad;
        for (auto& e : a.entries()) {
            e.layer->down().set_data(e.layer->down().to(at::kBFloat16));
            e.layer->up().set_data(e.layer->up().to(at::kBFloat16));
        }
    }
    a.refresh_cast_factors(at::kBFloat16);
    ASSERT_TRUE(q.cast_down().defined() && q.cast_up().defined());
    EXPECT_TRUE(at::equal(q.cast_down(), q.down()) && at::equal(q.cast_up(), q.up()));
    EXPECT_NE(q.cast_down().data_ptr(), q.down().data_ptr());
    a.clear_cast_factors();
}

TEST(LoRAUnit, FusedPathOnlyWhereItApplies) {
    auto layer = AdaptableLinear(6, 5);
    torch::nn::Module root;
    root.register_module("to_q", layer);
    LoRAAdapters a = inject_lora(root, config({"to_q"}));
    const LoRALayer& lora = *a.find("to_q");
    const at::Tensor x = at::randn({2, 6});
    EXPECT_TRUE(lora.takes_whole_forward(x));
    {
        torch::NoGradGuard no_grad;  // training without grad (a checkpointed block's first forward)
        EXPECT_TRUE(lora.takes_whole_forward(x));
        root.eval();  // inference: the composite path
        EXPECT_FALSE(lora.takes_whole_forward(x));
        root.train();
    }
    set_fused_lora(false);
    EXPECT_FALSE(lora.takes_whole_forward(x));
    set_fused_lora(true);
    layer->weight.requires_grad_(true);  // a trainable base needs its own gradient
    EXPECT_FALSE(lora.takes_whole_forward(x));
}

TEST(LoRAUnit, GaussianInitHasStdOneOverRank) {
    torch::manual_seed(0);
    auto big = AdaptableLinear(4096, 8);
    torch::nn::Module root;
    root.register_module("to_q", big);
    LoRAConfig c = config({"to_q"}, 4, 4);
    c.init = LoRAInit::kGaussian;
    LoRAAdapters a = inject_lora(root, c);
    EXPECT_NEAR(a.find("to_q")->down().std().item<double>(), 0.25, 0.01);
}

// DoRA, hand-computed: W = [[3,0,4],[0,5,0]] (row norms 5, 5), bias [1,-1], A = [[1,0,0]],
// B = [[1],[2]], r = 1, alpha = 2 (s = 2). W' = W + s·BA = [[5,0,4],[4,5,0]], both rows of norm √41.
// With m at its initial value [5, 5] and x = [1, 1, 1]:  W'x = [9, 9], y = 5/√41·9 + b.
TEST(LoRAUnit, DoraMatchesTheClosedForm) {
    torch::nn::Module root;
    auto layer = root.register_module("to_q", AdaptableLinear(3, 2));
    {
        torch::NoGradGuard g;
        layer->weight.copy_(torch::tensor({{3.f, 0.f, 4.f}, {0.f, 5.f, 0.f}}));
        layer->bias.copy_(torch::tensor({1.f, -1.f}));
    }
    LoRAConfig c = config({"to_q"}, 1, 2.0);
    c.use_dora = true;
    LoRAAdapters a = inject_lora(root, c);
    LoRALayer& l = *a.find("to_q");
    ASSERT_TRUE(l.use_dora());
    EXPECT_NEAR(l.magnitude()[0].item<double>(), 5.0, 1e-6);
    EXPECT_NEAR(l.magnitude()[1].item<double>(), 5.0, 1e-6);
    {
        torch::NoGradGuard g;
        l.down().copy_(torch::tensor({{1.f, 0.f, 0.f}}));
        l.up().copy_(torch::tensor({{1.f}, {2.f}}));
    }
    const at::Tensor x = torch::tensor({{1.f, 1.f, 1.f}});
    const at::Tensor y = layer->forward(x);
    const double k = 5.0 / std::sqrt(41.0);
    EXPECT_NEAR(y[0][0].item<double>(), k * 9.0 + 1.0, 1e-5);
    EXPECT_NEAR(y[0][1].item<double>(), k * 9.0 - 1.0, 1e-5);

    // d(sum y)/dm_i = (W'x)_i / ‖W'_i‖ = 9/√41. With the norm detached, d(sum y)/dB_i = m_i/‖W'_i‖ ·
    // s · (A x) = 5/√41 · 2 · 1 (a non-detached norm would add a second term).
    y.sum().backward();
    EXPECT_NEAR(l.magnitude().grad()[0].item<double>(), 9.0 / std::sqrt(41.0), 1e-5);
    EXPECT_NEAR(l.up().grad()[0][0].item<double>(), 2.0 * k, 1e-5);
    EXPECT_NEAR(l.up().grad()[1][0].item<double>(), 2.0 * k, 1e-5);
    EXPECT_FALSE(layer->weight.grad().defined());

    // Merged: W ← m/‖W'‖ · W' row-wise, the same output, and unmerge restores W.
    torch::NoGradGuard g;
    a.merge();
    EXPECT_NEAR(layer->weight[0][0].item<double>(), k * 5.0, 1e-5);
    EXPECT_NEAR(layer->weight[1][1].item<double>(), k * 5.0, 1e-5);
    EXPECT_LE(test::max_abs_diff(layer->forward(x), y), 1e-5);
    a.unmerge();
    EXPECT_LE(test::max_abs_diff(layer->weight, torch::tensor({{3.f, 0.f, 4.f}, {0.f, 5.f, 0.f}})), 1e-6);
}

// LoCon: a k×k down conv (with the base's stride/padding) then a 1×1 up conv equals one conv with
// W + s·Σ_r B[:, r] A[r] — built here with einsum, independently of the adapter's matmul.
TEST(LoRAUnit, ConvLoRAEqualsTheSummedKernel) {
    torch::manual_seed(1);
    Tiny tiny;
    LoRAAdapters a = inject_lora(*tiny, config({"conv1"}, 3, 6));  // s = 2
    LoRALayer& l = *a.find("conv1");
    {
        torch::NoGradGuard g;
        l.up().normal_();
    }
    const at::Tensor x = at::randn({2, 2, 7, 7});
    torch::NoGradGuard g;
    const at::Tensor kernel =
        tiny->conv1->weight + 2.0 * at::einsum("or,rikl->oikl", {l.up().flatten(1), l.down()});
    const at::Tensor expected = at::conv2d(x, kernel, tiny->conv1->bias, 2, 1);
    EXPECT_LE(test::max_abs_diff(tiny->conv1->forward(x), expected), 1e-5);
    a.merge();
    EXPECT_LE(test::max_abs_diff(tiny->conv1->weight, kernel), 1e-6);
    EXPECT_LE(test::max_abs_diff(tiny->conv1->forward(x), expected), 1e-5);
}

TEST(LoRAUnit, DoraConvMergeKeepsTheOutput) {
    torch::manual_seed(2);
    Tiny tiny;
    LoRAConfig c = config({"conv1"}, 2, 2);
    c.use_dora = true;
    LoRAAdapters a = inject_lora(*tiny, c);
    LoRALayer& l = *a.find("conv1");
    EXPECT_EQ(l.magnitude().sizes(), at::IntArrayRef({1, 4, 1, 1}));  // PEFT's conv magnitude shape
    torch::NoGradGuard g;
    l.up().normal_();
    l.magnitude().mul_(1.5);
    const at::Tensor x = at::randn({1, 2, 6, 6});
    const at::Tensor y = tiny->conv1->forward(x);
    a.merge();
    EXPECT_LE(test::max_abs_diff(tiny->conv1->forward(x), y), 1e-5);
    // The merged kernel's per-output norms are the magnitudes.
    const at::Tensor norms = tiny->conv1->weight.flatten(1).norm(2, {1});
    EXPECT_LE(test::max_abs_diff(norms, l.magnitude().reshape({-1})), 1e-5);
}

TEST(LoRAUnit, DropoutOnlyActsInTraining) {
    torch::manual_seed(3);
    Tiny tiny;
    LoRAConfig c = config({"to_q"}, 2, 2);
    c.dropout = 0.5;
    LoRAAdapters a = inject_lora(*tiny, c);
    {
        torch::NoGradGuard g;
        a.find("attn.to_q")->up().fill_(1.0);
    }
    const at::Tensor x = at::ones({64, 3});
    tiny->eval();
    const at::Tensor y1 = tiny->to_q->forward(x), y2 = tiny->to_q->forward(x);
    EXPECT_TRUE(torch::equal(y1, y2));
    tiny->train();
    EXPECT_GT(test::max_abs_diff(tiny->to_q->forward(x), y1), 1e-3);
}

// DoRA adapters (linear and conv, non-default alpha) survive both file formats.
void dora_round_trip(LoRAFormat format) {
    torch::manual_seed(4);
    Tiny tiny;
    LoRAConfig c = config({"to_q", "conv1"}, 2, 3);
    c.use_dora = true;
    LoRAAdapters a = inject_lora(*tiny, c);
    {
        torch::NoGradGuard g;
        for (auto& t : a.parameters()) t.add_(at::randn_like(t) * 0.3);
    }
    test::TempDir tmp;
    save_lora(a, tmp / "l.safetensors", format);
    Tiny fresh;
    {
        torch::NoGradGuard g;
        for (auto& item : fresh->named_parameters())
            item.value().copy_(*tiny->named_parameters().find(item.key()));
    }
    c.alpha = 1;  // overridden by the file
    LoRAAdapters b = inject_lora(*fresh, c);
    load_lora(b, tmp / "l.safetensors");
    torch::NoGradGuard g;
    const at::Tensor x = at::randn({4, 3}), img = at::randn({1, 2, 5, 5});
    EXPECT_TRUE(torch::equal(fresh->to_q->forward(x), tiny->to_q->forward(x)));
    EXPECT_TRUE(torch::equal(fresh->conv1->forward(img), tiny->conv1->forward(img)));
}

TEST(LoRAUnit, DoraRoundTripsAsDiffusers) {
    dora_round_trip(LoRAFormat::kDiffusers);
}
TEST(LoRAUnit, DoraRoundTripsAsComfyUI) {
    dora_round_trip(LoRAFormat::kComfyUI);
}

TEST(LoRAUnit, KohyaNamesAndAlphaAreRead) {
    EXPECT_EQ(kohya_lora_name("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_out.0"),
              "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_out_0");
    Tiny tiny;
    LoRAAdapters a = inject_lora(*tiny, config({"to_q"}, 2, 2));
    test::TempDir tmp;
    // A hand-written kohya file: alpha 1 with rank 2 gives scale 0.5; plus a text-encoder key.
    io::save_safetensors(tmp / "k.safetensors", {{"lora_unet_attn_to_q.lora_down.weight", at::ones({2, 3})},
                                                 {"lora_unet_attn_to_q.lora_up.weight", at::ones({2, 2})},
                                                 {"lora_unet_attn_to_q.alpha", at::scalar_tensor(1.0)},
                                                 {"lora_te1_x.lora_down.weight", at::ones({1})}});
    const LoRALoadReport r = load_lora(a, tmp / "k.safetensors");
    EXPECT_EQ(r.format, "kohya");
    EXPECT_EQ(r.text_encoder_keys_skipped, 1u);
    EXPECT_DOUBLE_EQ(a.find("attn.to_q")->scale(), 0.5);
    torch::NoGradGuard g;
    const at::Tensor x = at::ones({1, 3});
    // B·A·x = [2·3, 2·3] = [6, 6]; × 0.5 = 3 added to the base output.
    const at::Tensor base = at::linear(x, tiny->to_q->weight, tiny->to_q->bias);
    EXPECT_LE(test::max_abs_diff(tiny->to_q->forward(x), base + 3.0), 1e-5);
}

// A kohya `.alpha` (or a metadata alpha) that is NaN, infinite, zero or negative is refused by key:
// a NaN alpha used to be replaced silently (by the rank on resume, or NaN images when sampling).
TEST(LoRAUnit, BadAlphasAreRefusedByKey) {
    test::TempDir tmp;
    for (const double alpha : {std::nan(""), HUGE_VAL, 0.0, -2.0}) {
        Tiny tiny;
        LoRAAdapters a = inject_lora(*tiny, config({"to_q"}, 2, 2));
        io::save_safetensors(tmp / "k.safetensors",
                             {{"lora_unet_attn_to_q.lora_down.weight", at::ones({2, 3})},
                              {"lora_unet_attn_to_q.lora_up.weight", at::ones({2, 2})},
                              {"lora_unet_attn_to_q.alpha", at::scalar_tensor(alpha)}});
        try {
            load_lora(a, tmp / "k.safetensors");
            ADD_FAILURE() << "alpha " << alpha << " was accepted (scale " << a.find("attn.to_q")->scale()
                          << ")";
        } catch (const DataError& e) {
            const std::string msg = e.what();
            EXPECT_NE(msg.find((tmp / "k.safetensors").string()), std::string::npos) << msg;
            EXPECT_NE(msg.find("lora_unet_attn_to_q.alpha"), std::string::npos) << msg;
            // NaN and infinity are caught with the file's other non-finite tensors.
            EXPECT_NE(msg.find(std::isfinite(alpha) ? "positive finite" : "NaN or infinite"),
                      std::string::npos)
                << msg;
        }
    }
    Tiny tiny;
    LoRAAdapters a = inject_lora(*tiny, config({"to_q"}, 2, 2));
    io::save_safetensors(tmp / "m.safetensors",
                         {{"unet.attn.to_q.lora.down.weight", at::ones({2, 3})},
                          {"unet.attn.to_q.lora.up.weight", at::ones({2, 2})}},
                         {{"lora_adapter_metadata", R"({"r": 2, "lora_alpha": -4})"}});
    EXPECT_THROW(load_lora(a, tmp / "m.safetensors"), DataError);
}

// A NaN or infinite factor is refused naming the file and the key (a damaged LoRA gave a black image).
TEST(LoRAUnit, NonFiniteFactorsAreRefusedByKey) {
    test::TempDir tmp;
    Tiny tiny;
    LoRAAdapters a = inject_lora(*tiny, config({"to_q"}, 2, 2));
    at::Tensor up = at::ones({2, 2});
    up[1][0] = std::nan("");
    io::save_safetensors(tmp / "n.safetensors", {{"unet.attn.to_q.lora.down.weight", at::ones({2, 3})},
                                                 {"unet.attn.to_q.lora.up.weight", up}});
    try {
        load_lora(a, tmp / "n.safetensors");
        ADD_FAILURE() << "a NaN factor was loaded";
    } catch (const DataError& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find((tmp / "n.safetensors").string() + ": tensor 'unet.attn.to_q.lora.up.weight'"),
                  std::string::npos)
            << msg;
    }
}

}  // namespace
}  // namespace test_lora_unit_local
}  // namespace dtune::models
