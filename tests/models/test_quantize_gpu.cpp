// Quantised weights on CUDA (label gpu; skipped without a CUDA device):
// - the dequantisation kernel gives the CPU's values bit for bit (int8 and fp8 into fp32/bf16,
//   contiguous and channels-last);
// - a quantised Linear under bf16 autocast (fp8 GEMMs forward and backward on cards that have
//   them) is close to the dense layer holding the dequantised weight, forward and input gradient,
//   with and without bias;
// - a LoRA on a quantised base trains inside a CUDA graph, replaying as the eager steps do;
// - a Linear over at most 8 rows (the quantised GEMV) equals the dequantised product, int8 and fp8,
//   float32 and bf16, with and without bias;
// - the byte transpose the fp8 input-gradient GEMM reads equals ATen's, and that GEMM at a Flux
//   shape (big enough to take fp8) is close to the dense one;
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "model_test_util.h"
#include "models/adapters/lora.h"
#include "models/common/adaptable.h"
#include "models/common/quantize.h"
#include "support/test_support.h"

#ifdef DTUNE_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace dtune::models {
namespace test_quantize_gpu_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

const c10::Device kCuda(c10::kCUDA, 0);

TEST(QuantizeGpu, DequantisationKernelEqualsTheCpu) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    torch::manual_seed(1);
    for (const auto format : {QuantFormat::kInt8, QuantFormat::kFloat8}) {
        for (const bool conv : {false, true}) {
            const at::Tensor w = conv ? at::randn({96, 40, 3, 3}) : at::randn({1000, 777});
            const QuantizedWeight cpu = quantize_weight(w, format);
            const QuantizedWeight gpu = quantize_weight(w.to(kCuda), format);
            // Quantisation on the GPU stores what the CPU stores.
            EXPECT_TRUE(at::equal(gpu.data.cpu().view(at::kByte), cpu.data.view(at::kByte)));
            EXPECT_TRUE(at::equal(gpu.scale.cpu(), cpu.scale));
            for (const auto dtype : {at::kFloat, at::kBFloat16}) {
                for (const bool channels_last : {false, conv}) {
                    const auto layout =
                        channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
                    const at::Tensor q = gpu.data.contiguous(layout);
                    const at::Tensor got = dequantize_weight(q, gpu.scale, dtype);
                    EXPECT_EQ(got.is_contiguous(layout), true);
                    EXPECT_TRUE(
                        at::equal(got.cpu().contiguous(), dequantize_weight(cpu.data, cpu.scale, dtype)))
                        << "format " << static_cast<int>(format) << " dtype " << dtype << " cl "
                        << channels_last;
                }
            }
        }
    }
}

TEST(QuantizeGpu, QuantisedLinearUnderAutocastIsCloseToTheDenseLayer) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    torch::manual_seed(2);
    for (const auto format : {QuantFormat::kInt8, QuantFormat::kFloat8}) {
        for (const bool bias : {false, true}) {
            SCOPED_TRACE(str(format == QuantFormat::kInt8 ? "int8" : "fp8", bias ? " bias" : ""));
            const at::Tensor w = (at::randn({640, 320}) * 0.05).to(kCuda, at::kBFloat16);
            const at::Tensor b = bias ? at::randn({640}).to(kCuda, at::kBFloat16) : at::Tensor();
            const QuantizedWeight q = quantize_weight(w, format);
            const at::Tensor dense = dequantize_weight(q.data, q.scale, at::kBFloat16);
            // M = 2·1024 tokens (fp8 GEMM shape) and M = 2·77 (the dequantised fallback).
            for (const int64_t tokens : {1024, 77}) {
                const at::Tensor x = at::randn({2, tokens, 320}, kCuda).requires_grad_();
                const at::Tensor xr = x.detach().clone().requires_grad_();
                at::Tensor y, yr;
                at::autocast::set_autocast_enabled(at::kCUDA, true);
                at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
                y = quantized_linear(x, q.data, q.scale, b);
                yr = at::linear(xr, dense, b);
                at::autocast::set_autocast_enabled(at::kCUDA, false);
                at::autocast::clear_cache();
                ASSERT_EQ(y.scalar_type(), at::kBFloat16);
                const at::Tensor g = at::randn(y.sizes(), y.options());
                y.backward(g);
                yr.backward(g);
                const double scale = yr.abs().max().item<double>();
                // fp8 activations (e4m3: 3 mantissa bits) on the fp8-GEMM path; bf16 rounding otherwise.
                const bool fp8_gemm =
                    format == QuantFormat::kFloat8 && tokens == 1024 && fp8_gemm_available(kCuda);
                EXPECT_LE(test::reported_diff("y", y.to(at::kFloat), yr.to(at::kFloat)),
                          (fp8_gemm ? 0.06 : 0.01) * scale);
                // The input gradient takes the fp8 GEMM too (the output gradient quantised per row).
                EXPECT_LE(test::reported_diff("dx", x.grad(), xr.grad()),
                          (fp8_gemm ? 0.06 : 0.01) * xr.grad().abs().max().item<double>());
            }
        }
    }
}

TEST(QuantizeGpu, FewRowLinearReadsTheQuantisedWeightDirectly) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    torch::manual_seed(8);
    for (const auto format : {QuantFormat::kInt8, QuantFormat::kFloat8}) {
        const QuantizedWeight q = quantize_weight(at::randn({1000, 3072}, kCuda) * 0.05, format);
        const at::Tensor dense = dequantize_weight(q.data, q.scale, at::kFloat);
        for (const auto dtype : {at::kFloat, at::kBFloat16}) {
            for (const int64_t rows : {1, 3, 8, 9}) {  // 9: past the GEMV, the dequantised GEMM
                for (const bool bias : {false, true}) {
                    SCOPED_TRACE(str(format == QuantFormat::kInt8 ? "int8 " : "fp8 ", dtype, " rows ", rows,
                                     bias ? " bias" : ""));
                    const at::Tensor x = at::randn({rows, 3072}, kCuda).to(dtype);
                    const at::Tensor b = bias ? at::randn({1000}, kCuda).to(dtype) : at::Tensor();
                    const at::Tensor y = quantized_linear_no_grad(x, q.data, q.scale, b, dtype);
                    at::Tensor ref = at::mm(x.to(at::kFloat), dense.t());
                    if (bias) ref = ref + b.to(at::kFloat);
                    ASSERT_EQ(y.scalar_type(), dtype);
                    ASSERT_EQ(y.sizes(), ref.sizes());
                    // float32 sums in another order; bf16 output rounding (8 bits)
                    const double tol = (dtype == at::kFloat ? 1e-5 : 8e-3) * ref.abs().max().item<double>();
                    EXPECT_LE(test::reported_diff("y", y.to(at::kFloat), ref), tol);
                }
            }
        }
    }
}

TEST(QuantizeGpu, ByteTransposeEqualsATen) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    torch::manual_seed(4);
    // whole tiles, partial tiles, a Flux weight, sizes off the kernel's 16-element grid (ATen's copy)
    const std::vector<std::pair<int64_t, int64_t>> shapes = {{64, 64}, {80, 48}, {16, 4112}, {3072, 9216},
                                                             {48, 20}, {33, 64}, {144, 80}};
    for (const auto& [rows, cols] : shapes) {
        SCOPED_TRACE(str(rows, " x ", cols));
        const at::Tensor bytes = at::randint(0, 256, {rows + 16, cols}, at::TensorOptions().dtype(at::kByte));
        // rows 16.. of a bigger buffer: a slice at an offset, as a packed group's layer is
        const at::Tensor data = bytes.to(kCuda).view(at::kFloat8_e4m3fn).narrow(0, 16, rows);
        const at::Tensor t = transposed_quantized_weight(data);
        ASSERT_EQ(t.sizes(), at::IntArrayRef({cols, rows}));
        ASSERT_TRUE(t.is_contiguous());
        EXPECT_TRUE(at::equal(t.view(at::kByte).cpu(), bytes.narrow(0, 16, rows).t().contiguous()));
    }
}

TEST(QuantizeGpu, Fp8InputGradientAtAFluxShapeIsCloseToTheDenseOne) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    torch::manual_seed(6);
    // A double block's q/k/v: g [4096, 9216] · W [9216, 3072], past the fp8 GEMM's size threshold.
    const at::Tensor w = (at::randn({9216, 3072}, kCuda) * 0.02).to(at::kBFloat16);
    const QuantizedWeight q = quantize_weight(w, QuantFormat::kFloat8);
    const at::Tensor g = at::randn({4096, 9216}, kCuda).to(at::kBFloat16);
    const at::Tensor dx = quantized_linear_input_grad(g, q.data, q.scale, at::kBFloat16);
    const at::Tensor ref = at::mm(g.to(at::kFloat), dequantize_weight(q.data, q.scale, at::kFloat));
    ASSERT_EQ(dx.sizes(), ref.sizes());
    // e4m3 rounds each operand to ~3.6% RMS, so the products carry ~5% relative error; a transposed
    // or shuffled operand gives ~140%.
    EXPECT_LE(test::reported_diff("dx", dx.to(at::kFloat), ref), 0.15 * ref.abs().max().item<double>());
    const double rel = (dx.to(at::kFloat) - ref).norm().item<double>() / ref.norm().item<double>();
    EXPECT_LE(rel, 0.08) << (fp8_gemm_available(kCuda) ? "fp8 GEMM" : "dequantised");
}

#ifdef DTUNE_WITH_CUDA
// LoRA r4 on an int8/fp8 base, trained with SGD under bf16 autocast: eager steps and the same steps
// replayed from a CUDA graph give the same adapters.
TEST(QuantizeGpu, LoRAOnAQuantisedBaseReplaysInACudaGraph) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    for (const std::string preset : {"int8-quanto", "fp8-torchao"}) {
        SCOPED_TRACE(preset);
        torch::manual_seed(3);
        struct Net : torch::nn::Module {
            Net() {
                a = register_module("a", AdaptableLinear(64, 128));
                b = register_module("b", AdaptableLinear(128, 64));
            }
            AdaptableLinear a{nullptr}, b{nullptr};
        };
        std::array<std::shared_ptr<Net>, 2> nets{std::make_shared<Net>(), std::make_shared<Net>()};
        nets[1]->a->weight.data().copy_(nets[0]->a->weight.data());
        nets[1]->b->weight.data().copy_(nets[0]->b->weight.data());
        nets[1]->a->bias.data().copy_(nets[0]->a->bias.data());
        nets[1]->b->bias.data().copy_(nets[0]->b->bias.data());
        std::vector<LoRAAdapters> adapters;
        for (auto& n : nets) {
            n->to(kCuda, at::kBFloat16);
            for (auto& p : n->parameters()) p.set_requires_grad(false);
            quantize_module(*n, parse_quant_preset(preset, "base_model_precision"));
            LoRAConfig c;
            c.rank = 4;
            c.target_modules = {"a", "b"};
            c.init_seed = 9;
            adapters.push_back(inject_lora(*n, c));
            for (auto& p : adapters.back().parameters()) p.set_data(p.to(at::kFloat));
        }
        const at::Tensor x = at::randn({4, 32, 64}, kCuda);
        const auto step = [&](Net& n, LoRAAdapters& l) {
            at::autocast::set_autocast_enabled(at::kCUDA, true);
            at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
            const at::Tensor loss = n.b->forward(at::gelu(n.a->forward(x))).to(at::kFloat).square().mean();
            at::autocast::set_autocast_enabled(at::kCUDA, false);
            at::autocast::clear_cache();
            loss.backward();
            at::NoGradGuard no_grad;
            for (auto& p : l.parameters()) {
                p.sub_(p.grad(), 0.1);
                p.mutable_grad().zero_();
            }
        };
        for (auto& p : adapters[1].parameters()) p.mutable_grad() = at::zeros_like(p);
        for (int i = 0; i < 3; ++i) step(*nets[0], adapters[0]);
        // Warm up on a side stream, capture one step, replay it twice (3 steps in all).
        const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
        at::cuda::CUDAGraph graph;
        {
            const c10::cuda::CUDAStreamGuard guard(side);
            step(*nets[1], adapters[1]);
            graph.capture_begin();
            step(*nets[1], adapters[1]);
            graph.capture_end();
        }
        graph.replay();
        graph.replay();
        torch::cuda::synchronize();
        const auto pa = adapters[0].named_parameters(), pb = adapters[1].named_parameters();
        for (size_t i = 0; i < pa.size(); ++i)
            EXPECT_LE(test::reported_diff(pa[i].first, pa[i].second, pb[i].second),
                      1e-3 * (1 + pa[i].second.abs().max().item<double>()));
    }
}
#endif

}  // namespace
}  // namespace test_quantize_gpu_local
}  // namespace dtune::models
