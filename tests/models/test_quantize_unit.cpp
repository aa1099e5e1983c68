// Quantised frozen weights (models/common/quantize.h).
// - Against optimum-quanto, the library behind SimpleTuner's int8-quanto / fp8-quanto:
//   tools/ref/gen_quant_ref.py quantised a Linear and a Conv2d with quanto and saved its stored
//   values and outputs (tests/data/ref/quant_io.safetensors). dtune's stored values must be equal,
//   its outputs equal within float rounding.
// - Gradients: the input gradient of a quantised layer equals that of the dense layer holding the
//   dequantised weight; nothing dense is saved for backward.
// - Presets: which layers each preset quantises, and the refusals.
// - A LoRA/DoRA on a quantised base computes what it computes on the dequantised dense base, in
//   the fused and the unfused paths, forward and backward.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/error.h"
#include "model_test_util.h"
#include "models/adapters/lora.h"
#include "models/common/adaptable.h"
#include "models/common/quantize.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_quantize_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

const std::filesystem::path kRef = std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref";

struct Tiny : torch::nn::Module {
    Tiny() {
        linear = register_module("linear", AdaptableLinear(40, 24));
        conv = register_module("conv", AdaptableConv2d(torch::nn::Conv2dOptions(8, 16, 3).padding(1)));
    }
    AdaptableLinear linear{nullptr};
    AdaptableConv2d conv{nullptr};
};

std::shared_ptr<Tiny> tiny_from_reference(const io::SafetensorsFile& io) {
    auto m = std::make_shared<Tiny>();
    torch::NoGradGuard no_grad;
    m->linear->weight.copy_(test::fixture_tensor(io, "linear.weight"));
    m->linear->bias.copy_(test::fixture_tensor(io, "linear.bias"));
    m->conv->weight.copy_(test::fixture_tensor(io, "conv.weight"));
    m->conv->bias.copy_(test::fixture_tensor(io, "conv.bias"));
    for (auto& p : m->parameters()) p.set_requires_grad(false);
    return m;
}

TEST(Quantize, StoredValuesMatchQuanto) {
    const io::SafetensorsFile io(kRef / "quant_io.safetensors");
    for (const auto& [name, format] :
         {std::pair{"int8", QuantFormat::kInt8}, {"fp8", QuantFormat::kFloat8}}) {
        for (const std::string layer : {"linear", "conv"}) {
            SCOPED_TRACE(str(name, " ", layer));
            const QuantizedWeight q = quantize_weight(test::fixture_tensor(io, layer + ".weight"), format);
            EXPECT_EQ(q.data.scalar_type(), format == QuantFormat::kInt8 ? at::kChar : at::kFloat8_e4m3fn);
            at::Tensor want = test::fixture_tensor(io, str(name, ".", layer, ".data"));
            at::Tensor want_scale = test::fixture_tensor(io, str(name, ".", layer, ".scale"));
            at::Tensor data = q.data.to(at::kFloat), scale = q.scale;
            if (layer == "linear") {
                // Row 5 is all zeros: quanto's scale is 0 there (its fp8 values are NaN); dtune keeps
                // scale 1 and values 0. Every other row must be equal.
                EXPECT_EQ(scale[5].item<float>(), 1.0f);
                EXPECT_EQ(data[5].abs().max().item<float>(), 0.0f);
                EXPECT_EQ(want_scale[5].item<float>(), 0.0f);
                const at::Tensor keep = at::arange(24) != 5;
                data = data.index({keep}), scale = scale.index({keep});
                want = want.index({keep}), want_scale = want_scale.index({keep});
            }
            EXPECT_TRUE(at::equal(scale, want_scale)) << test::max_abs_diff(scale, want_scale);
            EXPECT_TRUE(at::equal(data, want)) << test::max_abs_diff(data, want);
        }
    }
}

TEST(Quantize, OutputsMatchQuanto) {
    const io::SafetensorsFile io(kRef / "quant_io.safetensors");
    for (const std::string preset : {"int8-quanto", "fp8-quanto"}) {
        SCOPED_TRACE(preset);
        auto m = tiny_from_reference(io);
        const QuantizeReport report = quantize_module(*m, parse_quant_preset(preset, "base_model_precision"));
        EXPECT_EQ(report.layers, 2);
        EXPECT_EQ(report.bytes_before, (24 * 40 + 16 * 8 * 9) * 4);
        EXPECT_EQ(report.bytes_after, 24 * 40 + 16 * 8 * 9 + (24 + 16) * 4);
        torch::NoGradGuard no_grad;
        const std::string q = preset.substr(0, preset.find('-'));
        at::Tensor y = m->linear->forward(test::fixture_tensor(io, "x_linear"));
        at::Tensor want = test::fixture_tensor(io, q + ".linear.out");
        if (q == "fp8") {  // quanto's NaN column (the zero row): dtune gives the bias there
            EXPECT_TRUE(at::allclose(y.select(-1, 5), m->linear->bias[5].expand({3, 5})));
            const at::Tensor keep = at::arange(24) != 5;
            y = y.index({"...", keep}), want = want.index({"...", keep});
        }
        EXPECT_LE(test::reported_diff("linear", y, want), 1e-5 * want.abs().max().item<double>());
        const at::Tensor yc = m->conv->forward(test::fixture_tensor(io, "x_conv"));
        const at::Tensor want_c = test::fixture_tensor(io, q + ".conv.out");
        EXPECT_LE(test::reported_diff("conv", yc, want_c), 1e-5 * want_c.abs().max().item<double>());
    }
}

TEST(Quantize, InputGradientsEqualTheDequantisedDenseLayer) {
    torch::manual_seed(3);
    for (const std::string preset : {"int8-quanto", "fp8-quanto"}) {
        SCOPED_TRACE(preset);
        auto m = std::make_shared<Tiny>();
        for (auto& p : m->parameters()) p.set_requires_grad(false);
        quantize_module(*m, parse_quant_preset(preset, "base_model_precision"));
        ASSERT_TRUE(m->linear->weight_scale.defined());
        // The parameter keeps its name and now holds the quantised values; no float copy remains.
        const auto params = m->named_parameters();
        EXPECT_NE(params["linear.weight"].scalar_type(), at::kFloat);
        EXPECT_TRUE(m->named_buffers().contains("linear.weight_scale"));
        EXPECT_EQ(m->linear->dtype(), at::kFloat);
        const at::Tensor wl = dense_weight(m->linear->weight, m->linear->weight_scale, at::kFloat);
        const at::Tensor wc = dense_weight(m->conv->weight, m->conv->weight_scale, at::kFloat);

        const at::Tensor x = at::randn({2, 3, 40}, at::kDouble).to(at::kFloat).requires_grad_();
        const at::Tensor g = at::randn({2, 3, 24});
        m->linear->forward(x).backward(g);
        const at::Tensor xr = x.detach().clone().requires_grad_();
        at::linear(xr, wl, m->linear->bias).backward(g);
        EXPECT_LE(test::reported_diff("linear dx", x.grad(), xr.grad()), 1e-5);

        const at::Tensor xc = at::randn({2, 8, 7, 5}).requires_grad_();
        const at::Tensor yc = m->conv->forward(xc);
        const at::Tensor gc = at::randn(yc.sizes());
        yc.backward(gc);
        const at::Tensor xcr = xc.detach().clone().requires_grad_();
        at::conv2d(xcr, wc, m->conv->bias, 1, 1).backward(gc);
        EXPECT_LE(test::reported_diff("conv dx", xc.grad(), xcr.grad()), 1e-5);
    }
}

TEST(Quantize, StridedConvolutionGradientRestoresTheInputSize) {
    torch::manual_seed(4);
    const at::Tensor w = at::randn({6, 4, 3, 3});
    const QuantizedWeight q = quantize_weight(w, QuantFormat::kInt8);
    const at::Tensor dense = dequantize_weight(q.data, q.scale, at::kFloat);
    for (const auto& [h, wd] : {std::pair<int64_t, int64_t>{9, 8}, {8, 7}, {5, 5}}) {
        const at::Tensor x = at::randn({1, 4, h, wd}).requires_grad_();
        const at::Tensor y = quantized_conv2d(x, q.data, q.scale, {}, {2, 2}, {1, 1}, {1, 1}, 1);
        const at::Tensor g = at::randn(y.sizes());
        y.backward(g);
        const at::Tensor xr = x.detach().clone().requires_grad_();
        at::conv2d(xr, dense, {}, 2, 1).backward(g);
        ASSERT_EQ(x.grad().sizes(), x.sizes());
        EXPECT_LE(test::reported_diff("dx", x.grad(), xr.grad()), 1e-5);
    }
}

TEST(Quantize, PresetsChooseLayersAsTheirLibraries) {
    struct Mixed : torch::nn::Module {
        Mixed() {
            a = register_module("a", Linear(32, 48));
            b = register_module("b", Linear(20, 32));  // 20 in-features: not a multiple of 16
            c = register_module("c", Conv2d(torch::nn::Conv2dOptions(4, 8, 3)));
        }
        Linear a{nullptr}, b{nullptr};
        Conv2d c{nullptr};
    };
    const auto count = [](const std::string& preset) {
        Mixed m;
        for (auto& p : m.parameters()) p.set_requires_grad(false);
        const QuantizeReport r = quantize_module(m, parse_quant_preset(preset, "base_model_precision"));
        return std::tuple{r.layers, r.skipped, m.a->weight_scale.defined(), m.b->weight_scale.defined(),
                          m.c->weight_scale.defined()};
    };
    EXPECT_EQ(count("int8-quanto"), std::tuple(3, 0, true, true, true));  // Linear + Conv2d
    EXPECT_EQ(count("fp8-quanto"), std::tuple(3, 0, true, true, true));
    EXPECT_EQ(count("int8-torchao"), std::tuple(2, 1, true, true, false));  // Linear only
    EXPECT_EQ(count("fp8-torchao"), std::tuple(1, 2, true, false, false));  // dims % 16 == 0
    EXPECT_EQ(count("no_change"), std::tuple(0, 0, false, false, false));
    const std::string d = describe({3, 1, 4 << 20, 1 << 20}, parse_quant_preset("int8-quanto", "k"));
    EXPECT_NE(d.find("int8-quanto: 3 layers"), std::string::npos) << d;
    EXPECT_NE(d.find("1 Linear/Conv2d layers left dense"), std::string::npos) << d;
}

TEST(Quantize, RefusesWhatDtuneDoesNotImplementNamingTheKeyAndTheFix) {
    const auto message = [](const std::string& value) {
        try {
            parse_quant_preset(value, "text_encoder_2_precision");
        } catch (const UsageError& e) {
            return std::string(e.what());
        }
        return std::string("accepted");
    };
    EXPECT_NE(message("nf4-bnb").find("text_encoder_2_precision = \"nf4-bnb\" is not available"),
              std::string::npos);
    EXPECT_NE(message("nf4-bnb").find("int8-quanto"), std::string::npos);
    EXPECT_NE(message("int4-quanto").find("no sub-byte weights"), std::string::npos);
    EXPECT_NE(message("int8").find("use one of no_change, int8-quanto"), std::string::npos);
    EXPECT_EQ(message("fp8-torchao"), "accepted");
    // A trainable bias cannot ride on a quantised layer.
    Linear l(16, 16);
    l->weight.set_requires_grad(false);
    const QuantizedWeight q = quantize_weight(l->weight, QuantFormat::kInt8);
    EXPECT_THROW(quantized_linear(at::randn({2, 16}), q.data, q.scale, l->bias), UsageError);
}

// LoRA (fused and unfused) and DoRA on a quantised base against the same adapters on a dense base
// that holds the dequantised weights: outputs and all gradients equal.
TEST(Quantize, LoRAOnAQuantisedBaseEqualsLoRAOnTheDequantisedBase) {
    for (const bool dora : {false, true}) {
        for (const bool fused : {true, false}) {
            SCOPED_TRACE(str(dora ? "DoRA" : "LoRA", fused ? " fused" : " unfused"));
            set_fused_lora(fused);
            torch::manual_seed(5);
            auto quant = std::make_shared<Tiny>();
            auto dense = std::make_shared<Tiny>();
            for (auto* m : {quant.get(), dense.get()})
                for (auto& p : m->parameters()) p.set_requires_grad(false);
            quantize_module(*quant, parse_quant_preset("int8-quanto", "base_model_precision"));
            {
                torch::NoGradGuard no_grad;
                dense->linear->weight.copy_(
                    dense_weight(quant->linear->weight, quant->linear->weight_scale, at::kFloat));
                dense->linear->bias.copy_(quant->linear->bias);
                dense->conv->weight.copy_(
                    dense_weight(quant->conv->weight, quant->conv->weight_scale, at::kFloat));
                dense->conv->bias.copy_(quant->conv->bias);
            }
            LoRAConfig c;
            c.rank = 4;
            c.alpha = 4;
            c.use_dora = dora;
            c.target_modules = {"linear", "conv"};
            LoRAAdapters la = inject_lora(*quant, c);
            LoRAAdapters lb = inject_lora(*dense, c);
            const io::TensorList pa = la.named_parameters(), pb = lb.named_parameters();
            ASSERT_EQ(pa.size(), pb.size());
            {
                torch::NoGradGuard no_grad;
                for (size_t i = 0; i < pa.size(); ++i) {
                    EXPECT_EQ(pa[i].second.scalar_type(), at::kFloat) << pa[i].first;
                    pa[i].second.normal_();  // non-zero B too
                    pb[i].second.copy_(pa[i].second);
                }
            }
            const at::Tensor x = at::randn({2, 6, 40}), xc = at::randn({2, 8, 5, 6});
            const auto run = [&](Tiny& m) {
                const at::Tensor xi = x.clone().requires_grad_(), xci = xc.clone().requires_grad_();
                const at::Tensor y = m.linear->forward(xi), yc = m.conv->forward(xci);
                (y.square().sum() + yc.square().sum()).backward();
                return std::vector<at::Tensor>{y.detach(), yc.detach(), xi.grad(), xci.grad()};
            };
            const auto a = run(*quant), b = run(*dense);
            for (size_t i = 0; i < a.size(); ++i)
                EXPECT_LE(test::reported_diff(str("output/grad ", i), a[i], b[i]),
                          1e-4 * (1 + b[i].abs().max().item<double>()));
            for (size_t i = 0; i < pa.size(); ++i) {
                const at::Tensor ga = pa[i].second.grad(), gb = pb[i].second.grad();
                ASSERT_TRUE(ga.defined()) << pa[i].first;
                EXPECT_LE(test::reported_diff(pa[i].first, ga, gb),
                          1e-4 * (1 + gb.abs().max().item<double>()));
            }
            EXPECT_THROW(la.merge(), UsageError);
        }
    }
    set_fused_lora(true);
}

TEST(Quantize, DequantisesToTheComputeDtype) {
    torch::manual_seed(6);
    const at::Tensor w = at::randn({5, 7}) * 0.1;
    for (const auto format : {QuantFormat::kInt8, QuantFormat::kFloat8}) {
        const QuantizedWeight q = quantize_weight(w, format);
        const at::Tensor f = dequantize_weight(q.data, q.scale, at::kFloat);
        // Rounded once from the float32 product.
        EXPECT_TRUE(at::equal(dequantize_weight(q.data, q.scale, at::kBFloat16), f.to(at::kBFloat16)));
        // Close to the original: half a step of the row's scale (int8), e4m3's 2^-4 relative (fp8).
        const double tol = format == QuantFormat::kInt8 ? 0.5 * q.scale.max().item<double>() * 1.0001
                                                        : 0.0625 * w.abs().max().item<double>();
        EXPECT_LE(test::max_abs_diff(f, w), tol);
    }
}

// save_quantized / load_quantized: a fresh module loads the quantised layers as stored and the
// rest dense, and computes what the quantised original computes; a file of another preset or
// source does not match.
TEST(Quantize, SavedQuantisedModulesLoadIntoAFreshModule) {
    torch::manual_seed(7);
    test::TempDir dir;
    auto a = std::make_shared<Tiny>();
    for (auto& p : a->parameters()) p.set_requires_grad(false);
    const QuantPreset preset = parse_quant_preset("int8-torchao", "k");  // the conv stays dense
    quantize_module(*a, preset);
    save_quantized(*a, dir / "q.safetensors", preset, "source A");
    EXPECT_TRUE(quantized_file_matches(dir / "q.safetensors", preset, "source A"));
    EXPECT_FALSE(quantized_file_matches(dir / "q.safetensors", preset, "source B"));
    EXPECT_FALSE(
        quantized_file_matches(dir / "q.safetensors", parse_quant_preset("int8-quanto", "k"), "source A"));
    EXPECT_FALSE(quantized_file_matches(dir / "missing.safetensors", preset, "source A"));

    auto b = std::make_shared<Tiny>();
    const QuantizeReport r = load_quantized(*b, dir / "q.safetensors", c10::Device(c10::kCPU), at::kFloat);
    EXPECT_EQ(r.layers, 1);
    EXPECT_EQ(b->linear->weight.scalar_type(), at::kChar);
    EXPECT_FALSE(b->linear->weight.requires_grad());
    EXPECT_TRUE(at::equal(b->linear->weight, a->linear->weight));
    EXPECT_TRUE(at::equal(b->linear->weight_scale, a->linear->weight_scale));
    EXPECT_FALSE(b->conv->weight_scale.defined());
    EXPECT_TRUE(at::equal(b->conv->weight, a->conv->weight));
    torch::NoGradGuard no_grad;
    const at::Tensor x = at::randn({2, 40});
    EXPECT_TRUE(at::equal(b->linear->forward(x), a->linear->forward(x)));

    // A truncated file is not trusted.
    std::filesystem::resize_file(dir / "q.safetensors",
                                 std::filesystem::file_size(dir / "q.safetensors") / 2);
    EXPECT_FALSE(quantized_file_matches(dir / "q.safetensors", preset, "source A"));
}

}  // namespace
}  // namespace test_quantize_unit_local
}  // namespace dtune::models
