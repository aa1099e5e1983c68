// The tiny SDXL UNet and VAE on CUDA in bf16 (label gpu; skipped without a CUDA device):
// outputs stay close to the float32 CPU reference, gradient checkpointing and channels-last run,
// and SDPA picks a fused kernel for the UNet's attention shapes.
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "model_test_util.h"
#include "models/adapters/lora.h"
#include "models/adapters/lora_qkv.h"
#include "models/common/attention.h"
#include "models/common/attention_stash.h"
#include "models/common/blocks.h"
#include "models/common/component.h"
#include "models/common/concat_gelu.h"
#include "models/common/epilogue_linear.h"
#include "models/common/gated_residual.h"
#include "models/common/geglu.h"
#include "models/common/gelu_mlp.h"
#include "models/common/group_norm_act.h"
#include "models/common/hash_dropout.h"
#include "models/common/layer_norm.h"
#include "models/common/lora_dropout.h"
#include "models/common/qk_norm_rope.h"
#include "models/common/rope.h"
#include "models/flux/flux_transformer.h"
#include "models/unet/unet_2d_condition.h"
#include "models/vae/autoencoder_kl.h"
#include "support/test_support.h"

#ifdef DTUNE_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace dtune::models {
namespace test_models_gpu_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

ComponentLoadOptions cuda_bf16() {
    ComponentLoadOptions o;
    o.dtype = at::kBFloat16;
    o.device = c10::Device(c10::kCUDA, 0);
    return o;
}

// LoRA r16 (alpha 16) on `targets` of root with the given dropout, the way dtune trains: factors
// drawn N(0, 0.05) in float32, the rest of root moved to the GPU in bf16, then the projection groups
// packed (.to() gave each weight its own storage); returns the adapters and the packed group count.
std::pair<LoRAAdapters, int64_t> lora_on_cuda_bf16(torch::nn::Module& root, std::vector<std::string> targets,
                                                   double dropout) {
    LoRAConfig c;
    c.rank = 16;
    c.alpha = 16;
    c.dropout = dropout;
    c.target_modules = std::move(targets);
    LoRAAdapters adapters = inject_lora(root, c);
    {
        torch::NoGradGuard no_grad;
        for (auto& t : adapters.parameters()) t.normal_(0.0, 0.05);
    }
    root.to(c10::Device(c10::kCUDA, 0));
    for (auto& item : root.named_parameters())
        if (item.key().find(".lora_") == std::string::npos)
            item.value().set_data(item.value().to(at::kBFloat16));
    const int64_t packed = pack_lora_projection_groups(root);
    return {std::move(adapters), packed};
}

TEST(ModelsGpu, TinyUNetBf16MatchesFp32Reference) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    io::SafetensorsFile ref(test::fixtures_dir() / "reference" / "unet_io.safetensors");
    auto get = [&](const char* n) { return ref.get(n).to(c10::Device(c10::kCUDA, 0)); };
    // Channels-last trains through dtune's NHWC GroupNorm + SiLU (forward and backward). Its
    // gradients are checked against a float32 run of the same UNet: their error must be of the bf16
    // NCHW run's size (ATen's GroupNorm), not larger.
    const std::vector<std::string> names{"conv_in.weight", "conv_norm_out.weight",
                                         "down_blocks.0.resnets.0.norm1.bias"};
    auto grads_of = [&](ComponentLoadOptions o) {
        UNet2DConditionModel unet = load_unet(test::fixtures_dir() / "tiny-sdxl" / "unet", o);
        unet->set_gradient_checkpointing(true);
        const at::Tensor out = unet->forward(get("sample"), get("timestep"), get("encoder_hidden_states"),
                                             {get("text_embeds"), get("time_ids")});
        out.to(at::kFloat).square().mean().backward();
        auto params = unet->named_parameters();
        std::map<std::string, at::Tensor> grads;
        for (const auto& name : names) {
            const at::Tensor g = params.contains(name) ? params[name].grad() : at::Tensor();
            grads[name] = g.defined() ? g.cpu().to(at::kDouble) : g;
        }
        return std::make_pair(out.cpu(), grads);
    };
    ComponentLoadOptions f32 = cuda_bf16();
    f32.dtype = at::kFloat;
    const auto reference = grads_of(f32).second;
    double nchw_error[3] = {0, 0, 0};
    for (bool channels_last : {false, true}) {
        ComponentLoadOptions o = cuda_bf16();
        o.channels_last = channels_last;
        const auto [out, grads] = grads_of(o);
        const at::Tensor expected = ref.get("out");
        // bf16 keeps ~3 significant digits through ~40 layers: a few percent of the output range.
        EXPECT_LE(test::max_abs_diff(out, expected), 0.05 * expected.abs().max().item<double>())
            << channels_last;
        for (size_t i = 0; i < names.size(); ++i) {
            const at::Tensor& want = reference.at(names[i]);
            const at::Tensor& got = grads.at(names[i]);
            ASSERT_TRUE(want.defined() && got.defined()) << names[i];
            const double error = test::max_abs_diff(got, want) / want.abs().max().item<double>();
            if (!channels_last) {
                nchw_error[i] = error;
                continue;
            }
            EXPECT_LE(error, 1.5 * nchw_error[i] + 0.01) << names[i] << ": NCHW's error " << nchw_error[i];
        }
    }
}

TEST(ModelsGpu, TinyVAEDecodesOnCuda) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    io::SafetensorsFile ref(test::fixtures_dir() / "reference" / "vae_io.safetensors");
    AutoencoderKL vae = load_autoencoder_kl(test::fixtures_dir() / "tiny-sdxl" / "vae", cuda_bf16());
    torch::NoGradGuard no_grad;
    const at::Tensor out = vae->decode(ref.get("latent").cuda()).cpu();
    const at::Tensor expected = ref.get("decoded");
    EXPECT_LE(test::max_abs_diff(out, expected), 0.05 * expected.abs().max().item<double>());
}

TEST(ModelsGpu, SdpaPicksAFusedKernel) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
    const at::Tensor q = at::randn({1, 10, 4096, 64}, opts);  // SDXL level 1 at 1024x1024
    const at::Tensor kv = at::randn({1, 10, 77, 64}, opts);
    const std::string self = sdpa_backend_name(q, q, q), cross = sdpa_backend_name(q, kv, kv);
    std::cout << "  SDPA self-attention: " << self << ", cross-attention: " << cross << std::endl;
    EXPECT_NE(self, "math");
    EXPECT_NE(cross, "math");
}

// The fused CUDA GEGLU (built where nvcc was found) against the composite path on the same GPU, in
// the dtypes training uses, at an SDXL width (vectorised kernels) and an odd one (scalar kernels).
TEST(ModelsGpu, FusedGegluMatchesComposite) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const at::Device cuda(at::kCUDA, 0);
    ASSERT_TRUE(fused_geglu_available(cuda)) << "built without the CUDA kernels (no nvcc at configure time)";
    torch::manual_seed(3);
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
        for (int64_t d : {int64_t{2560}, int64_t{13}}) {
            const at::Tensor proj = (at::randn({2, 33, 2 * d}) * 3).to(cuda, dtype);
            const at::Tensor up = at::randn({2, 33, d}).to(cuda, dtype);
            at::Tensor a = proj.clone().requires_grad_(true), b = proj.clone().requires_grad_(true);
            const at::Tensor ya = geglu(a), yb = geglu_composite(b);
            ya.backward(up);
            yb.backward(up);
            ASSERT_NE(ya.grad_fn(), nullptr);
            // One extra rounding in the composite: relative to the largest value, about one unit in
            // the last place of the dtype.
            const double rel = dtype == at::kFloat ? 1e-5 : (dtype == at::kHalf ? 2e-3 : 1e-2);
            auto close = [&](const at::Tensor& x, const at::Tensor& y) {
                return test::max_abs_diff(x.cpu(), y.cpu()) <= rel * y.abs().max().item<double>() + 1e-6;
            };
            EXPECT_TRUE(close(ya, yb)) << dtype << " d=" << d;
            EXPECT_TRUE(close(a.grad(), b.grad())) << dtype << " d=" << d;
            // Against float64 on the CPU: the fused path is within bf16/fp16 rounding of the exact value.
            const at::Tensor exact = geglu(proj.cpu().to(at::kDouble));
            EXPECT_LE(test::max_abs_diff(ya.cpu(), exact), rel * exact.abs().max().item<double>() + 1e-6)
                << dtype << " d=" << d;
        }
    }
}

// The fused rotary embedding against the composite in float64 on the CPU: forward and the input
// gradient, at Flux's head size (vectorised packs) and an odd-sized one (pairwise kernel), with tables
// that differ between the two halves of a pair (the kernel must not assume repeat_interleave'd tables).
TEST(ModelsGpu, FusedRotaryEmbeddingMatchesFloat64) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const at::Device cuda(at::kCUDA, 0);
    torch::manual_seed(5);
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
        for (int64_t dim : {int64_t{128}, int64_t{6}}) {
            const int64_t b = 2, s = 37, h = 3;
            const at::Tensor angles = at::randn({s, dim}) * 3;
            const at::Tensor cos = angles.cos(), sin = angles.sin();
            const at::Tensor x = at::randn({b, s, h, dim}), up = at::randn({b, s, h, dim});
            at::Tensor xg = x.to(cuda, dtype).requires_grad_(true);
            const at::Tensor y = rotary_embedding(xg, cos.to(cuda), sin.to(cuda));
            y.backward(up.to(cuda, dtype));
            ASSERT_NE(y.grad_fn(), nullptr);
            at::Tensor xd = x.to(dtype).to(at::kDouble).requires_grad_(true);
            const at::Tensor yd = rotary_embedding_composite(xd, cos.to(at::kDouble), sin.to(at::kDouble));
            yd.backward(up.to(dtype).to(at::kDouble));
            const double rel = dtype == at::kFloat ? 1e-6 : (dtype == at::kHalf ? 1e-3 : 8e-3);
            EXPECT_LE(test::max_abs_diff(y.cpu().to(at::kDouble), yd), rel * yd.abs().max().item<double>())
                << dtype << " dim " << dim;
            EXPECT_LE(test::max_abs_diff(xg.grad().cpu().to(at::kDouble), xd.grad()),
                      rel * xd.grad().abs().max().item<double>())
                << dtype << " dim " << dim;
        }
    }
}

// The joint q/k norm + rotary kernels against the composite ops in float64 on the CPU: outputs, the
// projections' gradients and the norm weights' gradients, for two streams (text + image, a double
// block) and one (a single block), with q/k/v as column slices of one packed projection output (the
// fused q/k/v layout, read in place). The three input gradients must come back side by side in one
// buffer: the fused projection's backward takes them as one GEMM only then.
TEST(ModelsGpu, JointQKNormRopeMatchesFloat64AndPacksTheGradients) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const at::Device cuda(at::kCUDA, 0);
    torch::manual_seed(23);
    const int64_t b = 2, heads = 3;
    for (auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
        for (int64_t dim : {int64_t{128}, int64_t{64}}) {
            for (const std::vector<int64_t>& seqs :
                 {std::vector<int64_t>{13, 37}, std::vector<int64_t>{29}}) {
                const int64_t inner = heads * dim;
                int64_t seq = 0;
                for (int64_t s : seqs) seq += s;
                const at::Tensor angles = at::randn({seq, dim}) * 3;
                std::vector<at::Tensor> packed, weights;  // per stream [B, S_i, 3·inner]; q, k weights
                for (int64_t s : seqs) {
                    packed.push_back(at::randn({b, s, 3 * inner}) * 2 + 0.5);
                    weights.push_back(at::rand({dim}) + 0.5);
                    weights.push_back(at::rand({dim}) + 0.5);
                }
                const at::Tensor up_q = at::randn({b, seq, heads, dim}),
                                 up_k = at::randn({b, seq, heads, dim}),
                                 up_v = at::randn({b, seq, heads, dim});
                // One run: returns the outputs, the q/k/v input gradients per stream and the weights'.
                const auto run = [&](at::Device dev, at::ScalarType t, bool fused) {
                    std::vector<at::Tensor> leaves, wleaves;
                    std::vector<QKVStream> streams;
                    for (size_t i = 0; i < seqs.size(); ++i) {
                        leaves.push_back(packed[i].to(t).to(dev).requires_grad_(true));
                        wleaves.push_back(weights[2 * i].to(dev, at::kFloat).requires_grad_(true));
                        wleaves.push_back(weights[2 * i + 1].to(dev, at::kFloat).requires_grad_(true));
                    }
                    std::vector<at::Tensor> views;
                    for (size_t i = 0; i < seqs.size(); ++i) {
                        const at::Tensor y = leaves[i] * 1;  // a non-leaf, as a GEMM output is
                        views.push_back(y.narrow(2, 0, inner));
                        views.push_back(y.narrow(2, inner, inner));
                        views.push_back(y.narrow(2, 2 * inner, inner));
                        streams.push_back({views[3 * i], views[3 * i + 1], views[3 * i + 2], wleaves[2 * i],
                                           wleaves[2 * i + 1]});
                    }
                    const auto c = angles.cos().to(dev, at::kFloat), s = angles.sin().to(dev, at::kFloat);
                    const auto out =
                        fused ? joint_qk_norm_rope(streams, heads, 1e-6, c, s)
                              : joint_qk_norm_rope_composite(streams, heads, 1e-6, c.to(t), s.to(t));
                    const at::Tensor loss = (out[0].to(t) * up_q.to(dev, t)).sum() +
                                            (out[1].to(t) * up_k.to(dev, t)).sum() +
                                            (out[2].to(t) * up_v.to(dev, t)).sum();
                    std::vector<at::Tensor> wrt = views;
                    wrt.insert(wrt.end(), wleaves.begin(), wleaves.end());
                    auto grads = torch::autograd::grad({loss}, wrt);
                    return std::make_pair(std::vector<at::Tensor>(out.begin(), out.end()), grads);
                };
                set_fused_qk_norm_rope(true);
                const auto [out, grads] = run(cuda, dtype, true);
                const auto [ref, ref_grads] = run(at::kCPU, at::kDouble, false);
                const std::string what = std::string(c10::toString(dtype)) + " D=" + std::to_string(dim) +
                                         " streams=" + std::to_string(seqs.size());
                ASSERT_NE(out[0].grad_fn(), nullptr) << what;
                EXPECT_NE(out[0].grad_fn()->name().find("JointFunction"), std::string::npos)
                    << what << ": the kernels did not run (" << out[0].grad_fn()->name() << ")";
                // bf16: the norm's output and the rotation each round once (and the gradient's likewise)
                const double rel = dtype == at::kFloat ? 2e-5 : (dtype == at::kHalf ? 2e-3 : 1.6e-2);
                for (int i = 0; i < 3; ++i)
                    EXPECT_LE(test::max_abs_diff(out[i].cpu().to(at::kDouble), ref[i]),
                              rel * ref[i].abs().max().item<double>())
                        << what << " output " << i;
                for (size_t i = 0; i < grads.size(); ++i) {
                    // weights' gradients sum over every row: relative to the sum of magnitudes
                    const bool weight = i >= 3 * seqs.size();
                    EXPECT_LE(test::max_abs_diff(grads[i].cpu().to(at::kDouble), ref_grads[i]),
                              rel * ref_grads[i].abs().max().item<double>() * (weight ? 4 : 1))
                        << what << " gradient " << i;
                }
                for (size_t st = 0; st < seqs.size(); ++st) {  // q, k, v gradients side by side
                    const at::Tensor &gq = grads[3 * st], &gk = grads[3 * st + 1], &gv = grads[3 * st + 2];
                    EXPECT_TRUE(gk.storage().is_alias_of(gq.storage()) &&
                                gv.storage().is_alias_of(gq.storage()))
                        << what;
                    EXPECT_EQ(gk.storage_offset(), gq.storage_offset() + inner) << what;
                    EXPECT_EQ(gv.storage_offset(), gq.storage_offset() + 2 * inner) << what;
                    EXPECT_EQ(gq.stride(1), 3 * inner) << what;
                }
            }
        }
    }
    // Switched off: the composite ops on the GPU, same values within rounding.
    set_fused_qk_norm_rope(false);
    const at::Tensor y = at::randn({1, 8, 3 * 256}, at::TensorOptions(cuda).dtype(at::kBFloat16));
    const at::Tensor w = at::ones({128}, cuda);
    const at::Tensor angles = at::randn({8, 128}, cuda);
    const auto composite =
        joint_qk_norm_rope({{y.narrow(2, 0, 256), y.narrow(2, 256, 256), y.narrow(2, 512, 256), w, w}}, 2,
                           1e-6, angles.cos(), angles.sin());
    set_fused_qk_norm_rope(true);
    const auto fused =
        joint_qk_norm_rope({{y.narrow(2, 0, 256), y.narrow(2, 256, 256), y.narrow(2, 512, 256), w, w}}, 2,
                           1e-6, angles.cos(), angles.sin());
    for (int i = 0; i < 3; ++i)
        EXPECT_LE(test::max_abs_diff(fused[i].to(at::kFloat), composite[i].to(at::kFloat)), 3e-2) << i;
}

// cat([a, gelu_tanh(h)]) as one kernel against the composite ops in the same dtype (within a unit of
// rounding: the GELU formulas are PyTorch's) and in float64 on the CPU, forward and both input
// gradients; the attention part's gradient comes back dense. Widths as in a Flux single block (scaled
// down) and an odd one that takes the composite path.
TEST(ModelsGpu, ConcatGeluMatchesTheCompositeAndFloat64) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const at::Device cuda(at::kCUDA, 0);
    torch::manual_seed(29);
    for (auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
        for (const auto& [da, dh] : {std::pair<int64_t, int64_t>{96, 384}, std::pair<int64_t, int64_t>{8, 24},
                                     std::pair<int64_t, int64_t>{6, 10}}) {
            const at::Tensor a = at::randn({2, 33, da}), h = at::randn({2, 33, dh}) * 3,
                             up = at::randn({2, 33, da + dh});
            const auto run = [&](bool fused, at::Device dev, at::ScalarType t) {
                set_fused_concat_gelu(fused);
                const at::Tensor ag = a.to(t).to(dev).requires_grad_(true) *
                                      1,  // non-leaves: the raw gradients
                    hg = h.to(t).to(dev).requires_grad_(true) * 1;
                const at::Tensor out = concat_gelu_tanh(ag, hg);
                const auto grads = torch::autograd::grad({out}, {ag, hg}, {up.to(t).to(dev)});
                set_fused_concat_gelu(true);
                return std::vector<at::Tensor>{out.cpu().to(at::kDouble), grads[0],
                                               grads[1].cpu().to(at::kDouble), out};
            };
            const auto fused = run(true, cuda, dtype), composite = run(false, cuda, dtype);
            const auto exact = run(false, at::kCPU, at::kDouble);
            const std::string what =
                std::string(c10::toString(dtype)) + " " + std::to_string(da) + "+" + std::to_string(dh);
            const bool packs =
                da % (16 / c10::elementSize(dtype)) == 0 && dh % (16 / c10::elementSize(dtype)) == 0;
            EXPECT_EQ(fused[3].grad_fn()->name().find("ConcatGeluFunction") != std::string::npos, packs)
                << what;
            EXPECT_EQ(fused[1].is_contiguous(), packs) << what;  // the fused backward hands it dense
            const double ulp = dtype == at::kFloat ? 1e-6 : (dtype == at::kHalf ? 1e-3 : 8e-3);
            for (int i : {0, 2}) {
                const double scale = exact[i].abs().max().item<double>();
                EXPECT_LE(test::max_abs_diff(fused[i], composite[i]), ulp * scale) << what << " " << i;
                EXPECT_LE(test::max_abs_diff(fused[i], exact[i]), ulp * scale) << what << " " << i;
            }
            EXPECT_EQ(test::max_abs_diff(fused[1].cpu().to(at::kDouble), exact[1]),
                      test::max_abs_diff(composite[1].cpu().to(at::kDouble), exact[1]))
                << what << ": the attention part's gradient is a copy";
        }
    }
}

// The frozen GELU MLPs with the activation in cuBLASLt's epilogues (gelu_mlp.h) against the
// composite (at::linear, at::gelu / concat_gelu_tanh in bf16) and a float32 reference of the same
// bf16 inputs: outputs and both input gradients must be as close to the reference as the composite's
// are. Double-block shape (no concatenated input) and single-block shape (an attention output beside
// the MLP), with a row count that is no multiple of the tiles; then the single block at Flux's size
// with its forward + backward timed both ways (printed, not asserted).
TEST(ModelsGpu, GeluMlpEpilogueGemmsMatchTheComposite) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const at::Device cuda(at::kCUDA, 0);
    torch::manual_seed(31);
    struct Shape {
        int64_t rows, in, hidden, da, out;
    };
    for (const Shape& sh : {Shape{2 * 301, 256, 1024, 0, 256}, Shape{2 * 301, 256, 1024, 128, 256},
                            Shape{4608, 3072, 12288, 3072, 3072}}) {
        AdaptableLinear in(sh.in, sh.hidden), out(sh.da + sh.hidden, sh.out);
        for (auto* l : {in.get(), out.get()}) {
            const at::NoGradGuard no_grad;
            l->weight.set_data(
                (at::randn_like(l->weight) / std::sqrt(l->weight.size(1))).to(cuda, at::kBFloat16));
            l->bias.set_data((at::randn_like(l->bias) * 0.5).to(cuda, at::kBFloat16));
            l->weight.requires_grad_(false);
            l->bias.requires_grad_(false);
        }
        const at::Tensor x = at::randn({2, sh.rows / 2, sh.in}, at::kBFloat16).to(cuda) * 2;
        const at::Tensor a =
            sh.da ? at::randn({2, sh.rows / 2, sh.da}, at::kBFloat16).to(cuda) : at::Tensor();
        const at::Tensor up = at::randn({2, sh.rows / 2, sh.out}, at::kBFloat16).to(cuda);
        const std::string what = std::to_string(sh.rows) + "x" + std::to_string(sh.in) + "->" +
                                 std::to_string(sh.hidden) + " +" + std::to_string(sh.da);
        const auto run = [&](bool fused) {
            set_fused_gelu_gemm(fused);
            const at::Tensor xg = x.clone().requires_grad_(true);
            const at::Tensor ag = a.defined() ? a.clone().requires_grad_(true) : at::Tensor();
            EXPECT_EQ(gelu_mlp_fuses(sh.da, xg, *in, *out), fused) << what;
            const at::Tensor y = ag.defined() ? concat_gelu_mlp(ag, xg, *in, *out) : gelu_mlp(xg, *in, *out);
            EXPECT_EQ(y.grad_fn()->name().find("GeluMlpFunction") != std::string::npos, fused) << what;
            std::vector<at::Tensor> inputs{xg};
            if (ag.defined()) inputs.push_back(ag);
            auto grads = torch::autograd::grad({y}, inputs, {up});
            set_fused_gelu_gemm(true);
            grads.insert(grads.begin(), y.detach());
            return grads;
        };
        const auto fused = run(true), composite = run(false);
        // float32 reference from the same bf16 values
        const auto f = [](const at::Tensor& t) { return t.to(at::kFloat); };
        const at::Tensor xr = f(x).requires_grad_(true),
                         ar = a.defined() ? f(a).requires_grad_(true) : at::Tensor();
        const at::Tensor hr = at::gelu(at::linear(xr, f(in->weight), f(in->bias)), "tanh");
        const at::Tensor yr =
            at::linear(ar.defined() ? at::cat({ar, hr}, -1) : hr, f(out->weight), f(out->bias));
        std::vector<at::Tensor> ref_inputs{xr};
        if (ar.defined()) ref_inputs.push_back(ar);
        auto ref = torch::autograd::grad({yr}, ref_inputs, {f(up)});
        ref.insert(ref.begin(), yr.detach());
        ASSERT_EQ(fused.size(), ref.size());
        for (size_t i = 0; i < ref.size(); ++i) {
            const double scale = ref[i].abs().max().item<double>();
            const double e_fused = (f(fused[i]) - ref[i]).abs().max().item<double>();
            const double e_comp = (f(composite[i]) - ref[i]).abs().max().item<double>();
            EXPECT_LE(e_fused, 1.5 * e_comp + 2e-3 * scale) << what << " output/gradient " << i;
            EXPECT_LE(e_fused, 3e-2 * scale) << what << " output/gradient " << i;
        }
        if (sh.rows < 4096) continue;
        for (const bool on : {false, true, false, true}) {  // warmed up, then timed
            set_fused_gelu_gemm(on);
            const at::Tensor xg = x.clone().requires_grad_(true), ag = a.clone().requires_grad_(true);
            torch::cuda::synchronize();
            const auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < 10; ++i) {
                const at::Tensor y = concat_gelu_mlp(ag, xg, *in, *out);
                (void)torch::autograd::grad({y}, {xg, ag}, {up});
            }
            torch::cuda::synchronize();
            const double ms =
                std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 10;
            std::printf("gelu_mlp %s %s: %.3f ms forward+backward\n", what.c_str(),
                        on ? "epilogue" : "composite", ms);
        }
        set_fused_gelu_gemm(true);
    }
}

// add_linear_ (y += x·Wᵀ + b in cuBLASLt's epilogue) against y + at::addmm in bf16 and a float32
// reference; and Flux's attention with LoRA on both streams' q/k/v (biased layers: the fused group
// writes the up-projections first and adds the base GEMM in its epilogue) against the layer-by-layer
// path, with and without lora_dropout, outputs and gradients.
TEST(ModelsGpu, LinearEpilogueAddsTheBaseOntoTheLoRATerms) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const auto on = at::TensorOptions().device(at::Device(at::kCUDA, 0)).dtype(at::kBFloat16);
    torch::manual_seed(37);
    for (const auto& [rows, in, out] :
         {std::array<int64_t, 3>{4608, 3072, 9216}, std::array<int64_t, 3>{300, 256, 96}}) {
        const at::Tensor x = at::randn({rows, in}, on), w = at::randn({out, in}, on) / std::sqrt(in),
                         b = at::randn({out}, on), y0 = at::randn({rows, out}, on);
        at::Tensor y = y0.clone();
        ASSERT_TRUE(add_linear_(y, x, w, b)) << rows << "x" << in << "->" << out;
        const at::Tensor composite = y0 + at::addmm(b, x, w.t());
        const auto f = [](const at::Tensor& t) { return t.to(at::kFloat); };
        const at::Tensor ref = f(y0) + at::addmm(f(b), f(x), f(w).t());
        const double scale = ref.abs().max().item<double>();
        const double e = (f(y) - ref).abs().max().item<double>(),
                     e_comp = (f(composite) - ref).abs().max().item<double>();
        EXPECT_LE(e, 1.5 * e_comp + 1e-3 * scale) << rows;
        set_fused_linear_epilogue(false);
        at::Tensor untouched = y0.clone();
        EXPECT_FALSE(add_linear_(untouched, x, w, b));
        EXPECT_TRUE(at::equal(untouched, y0));
        set_fused_linear_epilogue(true);
    }

    const at::Device cuda(at::kCUDA, 0);
    const auto run = [&](bool epilogue, double dropout) {
        torch::manual_seed(43);
        torch::nn::Module root;
        FluxAttention attn = root.register_module("attn", FluxAttention(256, 4, 64, /*added=*/true, false));
        auto [adapters, packed] = lora_on_cuda_bf16(
            root, {"to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"}, dropout);
        EXPECT_EQ(packed, 2);
        root.train();
        if (dropout > 0) adapters.set_dropout_seed(19);
        const int64_t text = 64, image = 1024;
        const at::Tensor ids = at::cat({at::zeros({text, 3}), flux_image_ids(64, 64)}, 0);
        const auto rope = flux_rope(ids.to(cuda), {16, 24, 24});
        const at::Tensor x = at::randn({1, image, 256}, on).requires_grad_(true);
        const at::Tensor ctx = at::randn({1, text, 256}, on).requires_grad_(true);
        EXPECT_TRUE(projection_group_fuses(x, attn->projection_groups().at(0)));
        set_fused_linear_epilogue(epilogue);
        const auto [img_out, txt_out] = attn->forward(x, ctx, rope);
        set_fused_linear_epilogue(true);
        const at::Tensor loss =
            (img_out.to(at::kFloat).square().sum() + txt_out.to(at::kFloat).square().sum()) / 1e3;
        loss.backward();
        std::vector<at::Tensor> values{img_out.detach().to(at::kFloat), txt_out.detach().to(at::kFloat),
                                       x.grad().to(at::kFloat), ctx.grad().to(at::kFloat)};
        for (auto& t : adapters.parameters()) values.push_back(t.grad().to(at::kFloat));
        return values;
    };
    for (const double dropout : {0.0, 0.1}) {
        const auto fused = run(true, dropout), plain = run(false, dropout);
        ASSERT_EQ(fused.size(), plain.size());
        for (size_t i = 0; i < fused.size(); ++i)
            EXPECT_LE((fused[i] - plain[i]).abs().max().item<double>(),
                      2e-2 * plain[i].abs().max().item<double>())
                << "dropout " << dropout << " tensor " << i;
    }
}

// A Flux LoRA (SimpleTuner's "all" targets, lora_dropout 0.1) trained with gradient checkpointing:
// the recomputation skips the MLP output projections (gelu_mlp.h's values_unused: the block output
// is only differentiated and the frozen modulation's gates need no gradient), and the output and
// every adapter gradient still equal the run without checkpointing.
// A small Flux transformer config (two double blocks, `singles` single ones, guidance embedded) and
// bf16 inputs on the GPU: 1024 image tokens (64 × 64 latents, 2×2-packed), 64 text tokens.
struct SmallFluxOnGpu {
    FluxTransformerConfig cfg;
    at::Tensor x, context, pooled, t, guidance, img_ids, txt_ids;
    at::TensorOptions on;
    SmallFluxOnGpu(int64_t singles, int64_t heads, int64_t head_dim, std::vector<int64_t> axes, uint64_t seed,
                   double sigma) {
        const at::Device cuda(at::kCUDA, 0);
        cfg.num_layers = 2;
        cfg.num_single_layers = singles;
        cfg.attention_head_dim = head_dim;
        cfg.num_attention_heads = heads;
        cfg.joint_attention_dim = 128;
        cfg.pooled_projection_dim = 64;
        cfg.guidance_embeds = true;
        cfg.axes_dims_rope = std::move(axes);
        on = at::TensorOptions().device(cuda).dtype(at::kBFloat16);
        torch::manual_seed(seed);
        x = at::randn({1, 1024, 64}, on), context = at::randn({1, 64, 128}, on),
        pooled = at::randn({1, 64}, on);
        t = at::full({1}, sigma, on), guidance = at::full({1}, 3.5, on);
        img_ids = flux_image_ids(64, 64).to(cuda), txt_ids = at::zeros({64, 3}).to(cuda);
    }
    at::Tensor forward(FluxTransformer2DModel& model) const {
        return model->forward(x, context, pooled, t, guidance, img_ids, txt_ids);
    }
};

TEST(ModelsGpu, CheckpointedFluxLoRAKeepsTheGradientsWithoutTheMlpOutputs) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const SmallFluxOnGpu in(2, 4, 64, {16, 24, 24}, 47, 0.6);
    const FluxTransformerConfig& cfg = in.cfg;
    const auto run = [&](bool checkpointing) {
        torch::manual_seed(53);
        FluxTransformer2DModel model(cfg);
        auto [adapters, packed] = lora_on_cuda_bf16(
            *model,
            {"to_k", "to_q", "to_v", "add_k_proj", "add_q_proj", "add_v_proj", "to_out.0", "to_add_out"},
            0.1);
        EXPECT_GT(packed, 0);
        model->train();
        adapters.set_dropout_seed(5);
        model->set_gradient_checkpointing(checkpointing);
        const int64_t unread_before = gelu_mlp_unread_projections();
        const at::Tensor out = in.forward(model);
        out.to(at::kFloat).square().mean().backward();
        // Recomputed: both streams' ff in the two double blocks and the first single block's proj_out
        // (the last single block is not checkpointed); none without checkpointing.
        EXPECT_EQ(gelu_mlp_unread_projections() - unread_before, checkpointing ? 5 : 0);
        std::vector<at::Tensor> values{out.detach().to(at::kFloat)};
        for (auto& p : adapters.parameters()) values.push_back(p.grad().to(at::kFloat));
        return values;
    };
    const auto plain = run(false), checkpointed = run(true);
    ASSERT_EQ(plain.size(), checkpointed.size());
    double worst = 0.0;
    for (size_t i = 0; i < plain.size(); ++i) {
        const double scale = plain[i].abs().max().item<double>();
        ASSERT_GT(scale, 0.0) << "tensor " << i;
        const double e = (checkpointed[i] - plain[i]).abs().max().item<double>() / scale;
        worst = std::max(worst, e);
        EXPECT_LE(e, 1e-2) << "tensor " << i << " (0: the output, then the adapters' gradients)";
    }
    std::printf("checkpointed Flux LoRA against the plain run: worst relative difference %.3g\n", worst);
}

// Checkpointed Flux blocks keep their attention outputs on the host (attention_stash.h): the
// recomputation reuses them instead of running the attention kernel, and the adapters' gradients are
// the recomputing run's bit for bit (the backward reads the same output and statistics); eagerly and
// replayed from a CUDA graph, where the copies are graph nodes on a side stream.
TEST(ModelsGpu, CheckpointedFluxAttentionStashGivesTheRecomputedGradients) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const SmallFluxOnGpu in(3, 2, 128, {16, 56, 56}, 61, 0.4);  // head_dim 128: cuDNN's kernel
    const auto& on = in.on;
    const at::Tensor probe = at::zeros({1, 2, 1024 + 64, 128}, on);
    if (sdpa_backend_name(probe, probe, probe) != "cudnn_attention")
        GTEST_SKIP() << "SDPA does not pick cuDNN's kernel here: the stash does not apply";
    struct Restore {
        ~Restore() { AttentionStash::set_default_budget(-1); }
    } restore;
    // A loss whose output gradient is fixed (w), so that the backward sees the same incoming
    // gradient whichever forward kernel produced the output (the first forward's attention runs with
    // its statistics when it keeps its output, without them otherwise: the outputs may differ in the
    // last bit, the recomputation's inputs and statistics do not).
    const at::Tensor w = at::randn({1, 1024, 64}, on.dtype(at::kFloat));
    // budget 0: no stash (every checkpointed block recomputes its attention).
    // kept: the outputs a pass keeps (4 checkpointed blocks: both double blocks and the first two
    // single ones; the last single block keeps its activations).
    const auto run = [&](int64_t budget, bool graphed, int64_t kept) {
        AttentionStash::set_default_budget(budget);
        torch::manual_seed(67);
        FluxTransformer2DModel model(in.cfg);
        auto [adapters, packed] =
            lora_on_cuda_bf16(*model, {"to_k", "to_q", "to_v", "to_out.0", "proj_out"}, 0.1);
        model->train();
        adapters.set_dropout_seed(9);
        model->set_gradient_checkpointing(true);
        std::vector<at::Tensor> params = adapters.parameters();
        at::Tensor out;
        const auto step = [&] {
            out = in.forward(model);
            (out.to(at::kFloat) * w).sum().backward();
        };
        if (!graphed) {
            step();
        } else {
#ifdef DTUNE_WITH_CUDA
            // As graph_step.cpp: warm-up and capture on one side stream (the gradients' accumulators
            // belong to it), thread-local capture, then two replays.
            const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
            at::cuda::CUDAEvent ready;
            ready.record(c10::cuda::getCurrentCUDAStream());
            ready.block(side);
            const c10::cuda::CUDAStreamGuard guard(side);
            step();
            for (auto& p : params) p.grad().zero_();
            at::cuda::CUDAGraph graph;
            graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
            try {
                step();
            } catch (...) {
                try {
                    graph.capture_end();
                } catch (...) {
                }
                throw;
            }
            graph.capture_end();
            for (int i = 0; i < 2; ++i) {
                for (auto& p : params) p.grad().zero_();
                graph.replay();
            }
            torch::cuda::synchronize();
#endif
        }
        const AttentionStash& stash = model->attention_stash();
        // One save and one reuse per kept output and pass (a capture counts once, replays not); the
        // host buffers are made once and reused.
        const int64_t passes = graphed ? 2 : 1, output_bytes = int64_t{2} * (1024 + 64) * 128 * 2;
        EXPECT_EQ(stash.saved(), kept * passes);
        EXPECT_EQ(stash.reused(), kept * passes);
        EXPECT_EQ(stash.host_bytes(), kept * output_bytes);
        std::vector<at::Tensor> values{out.detach().to(at::kFloat)};
        for (auto& p : params) values.push_back(p.grad().to(at::kFloat));
        return values;
    };
    // cuDNN's attention backward accumulates dq with atomics: two recomputing runs may differ in the
    // last bits. The stash must stay within that noise (or 0.5% of the largest entry): a wrong or stale
    // output would move the gradients by their own size.
    for (const bool graphed : {false, true}) {
        SCOPED_TRACE(graphed ? "graphed" : "eager");
        const auto recomputed = run(0, graphed, 0), again = run(0, graphed, 0),
                   stashed = run(int64_t{1} << 30, graphed, 4);
        // A budget for two and a half outputs: the double blocks' are kept, the single blocks'
        // attention is recomputed.
        const auto partly = run(int64_t{5} * (1024 + 64) * 128 * 2, graphed, 2);
        ASSERT_EQ(recomputed.size(), stashed.size());
        double worst = 0.0;
        for (size_t i = 1; i < recomputed.size(); ++i) {
            const double scale = recomputed[i].abs().max().item<double>();
            ASSERT_GT(scale, 0.0) << "gradient " << i;
            const double noise = (again[i] - recomputed[i]).abs().max().item<double>();
            for (const auto* got : {&stashed, &partly}) {
                const double diff = ((*got)[i] - recomputed[i]).abs().max().item<double>();
                worst = std::max(worst, diff / scale);
                EXPECT_LE(diff, std::max(3 * noise, 5e-3 * scale))
                    << (got == &stashed ? "all kept" : "two kept") << ", gradient " << i << ": " << diff
                    << " against run-to-run " << noise << " (largest " << scale << ")";
            }
        }
        const double scale = recomputed[0].abs().max().item<double>();
        EXPECT_LE((stashed[0] - recomputed[0]).abs().max().item<double>(), 1e-2 * scale) << "output";
        std::printf("attention stash (%s): worst relative gradient difference %.3g\n",
                    graphed ? "graphed" : "eager", worst);
    }
}

// x + gate · y by the vectorised kernels against at::addcmul in the same dtype and in float64: a gate
// that is one chunk of a wider modulation row (strided, as AdaLN's), with and without a gradient of
// its own, batch 1 and 2; and a width that is not whole packs (at::addcmul).
TEST(ModelsGpu, GatedResidualMatchesAddcmulAndFloat64) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const at::Device cuda(at::kCUDA, 0);
    torch::manual_seed(31);
    for (auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
        for (const auto& [b, d] : {std::pair<int64_t, int64_t>{1, 96}, std::pair<int64_t, int64_t>{2, 64},
                                   std::pair<int64_t, int64_t>{2, 12}}) {
            for (bool gate_grad : {false, true}) {
                const at::Tensor x = at::randn({b, 37, d}), y = at::randn({b, 37, d}),
                                 mod = at::randn({b, 3 * d}), up = at::randn({b, 37, d});
                const auto run = [&](bool fused, at::Device dev, at::ScalarType t) {
                    set_fused_gated_residual(fused);
                    const at::Tensor xg = x.to(t).to(dev).requires_grad_(true) * 1,
                                     yg = y.to(t).to(dev).requires_grad_(true) * 1,
                                     mg = mod.to(t).to(dev).requires_grad_(gate_grad);
                    const at::Tensor gate = mg.chunk(3, 1)[1].unsqueeze(1);  // [B, 1, D], rows 3·D apart
                    const at::Tensor out = gated_residual(xg, gate, yg);
                    std::vector<at::Tensor> wrt{xg, yg};
                    if (gate_grad) wrt.push_back(mg);
                    std::vector<at::Tensor> res = torch::autograd::grad({out}, wrt, {up.to(t).to(dev)});
                    set_fused_gated_residual(true);
                    res.insert(res.begin(), out);
                    return res;
                };
                const auto fused = run(true, cuda, dtype), composite = run(false, cuda, dtype);
                const auto exact = run(false, at::kCPU, at::kDouble);
                const std::string what = std::string(c10::toString(dtype)) + " b=" + std::to_string(b) +
                                         " d=" + std::to_string(d) + (gate_grad ? " gate grad" : "");
                const bool packs = d % (16 / c10::elementSize(dtype)) == 0;
                EXPECT_EQ(fused[0].grad_fn()->name().find("GatedResidualFunction") != std::string::npos,
                          packs)
                    << what;
                const double ulp = dtype == at::kFloat ? 1e-6 : (dtype == at::kHalf ? 1e-3 : 8e-3);
                for (size_t i = 0; i < fused.size(); ++i) {
                    const at::Tensor f = fused[i].cpu().to(at::kDouble),
                                     c = composite[i].cpu().to(at::kDouble);
                    const double scale =
                        exact[i].abs().max().item<double>() * (i == 3 ? 4 : 1);  // sums over S
                    EXPECT_LE(test::max_abs_diff(f, c), ulp * scale) << what << " " << i;
                    EXPECT_LE(test::max_abs_diff(f, exact[i]), ulp * scale) << what << " " << i;
                }
            }
        }
    }
}

// The fused channels-last GroupNorm kernels against float64 on the CPU: channel counts that take
// the vectorised kernels with lanes dividing the block (64, 512), not dividing it (320, 1280), the
// scalar kernels (12 channels in bf16), inputs with a large mean (E[x²] - mean² cancellation), an
// input bias per channel and per sample, and enough pixels for many statistics blocks per sample.
TEST(ModelsGpu, FusedGroupNormMatchesFloat64) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(fused_inference_kernels_built())
        << "built without the CUDA kernels (no nvcc at configure time)";
    const at::Device cuda(at::kCUDA, 0);
    torch::manual_seed(11);
    torch::NoGradGuard no_grad;
    struct Case {
        int64_t c, groups, h, w;
    };
    for (const Case& cs : {Case{64, 32, 96, 80}, Case{320, 32, 17, 9}, Case{512, 32, 64, 64},
                           Case{1280, 32, 8, 8}, Case{12, 4, 33, 31}}) {
        torch::nn::GroupNorm norm(torch::nn::GroupNormOptions(cs.groups, cs.c).eps(1e-6));
        torch::nn::init::normal_(norm->weight);
        torch::nn::init::normal_(norm->bias);
        const at::Tensor x64 = at::randn({2, cs.c, cs.h, cs.w}, at::kDouble) * 2 + 4;
        for (auto dtype : {at::kFloat, at::kBFloat16}) {
            norm->to(cuda, dtype);
            const at::Tensor x = x64.to(cuda, dtype).contiguous(at::MemoryFormat::ChannelsLast);
            ASSERT_TRUE(fused_inference_ready(x));
            for (const at::Tensor& in_bias : {at::Tensor(), at::randn({cs.c}), at::randn({2, cs.c})}) {
                for (bool silu : {false, true}) {
                    const at::Tensor y =
                        group_norm_act(*norm, x, in_bias.defined() ? in_bias.to(cuda) : in_bias, silu);
                    // The fused kernels keep NHWC; float32 past 2048 channels takes the composite path.
                    if (dtype != at::kFloat || cs.c <= 2048) {
                        ASSERT_TRUE(y.is_contiguous(at::MemoryFormat::ChannelsLast)) << cs.c << " " << dtype;
                    }
                    // Reference from the same rounded input, in float64.
                    at::Tensor in = x.cpu().to(at::kDouble);
                    if (in_bias.defined())
                        in = in +
                             (in_bias.dim() == 1 ? in_bias.view({1, -1, 1, 1}) : in_bias.view({2, -1, 1, 1}))
                                 .to(at::kDouble);
                    at::Tensor ref = at::group_norm(in, cs.groups, norm->weight.cpu().to(at::kDouble),
                                                    norm->bias.cpu().to(at::kDouble), 1e-6);
                    if (silu) ref = at::silu(ref);
                    const double tol = dtype == at::kFloat ? 1e-4 : 2e-2 * ref.abs().max().item<double>();
                    EXPECT_LE(test::max_abs_diff(y.cpu().to(at::kDouble), ref), tol)
                        << "c " << cs.c << " " << dtype << " in_bias dims " << in_bias.dim() << " silu "
                        << silu;
                }
            }
            norm->to(at::kCPU, at::kFloat);
        }
    }
}

// The differentiable channels-last GroupNorm(+SiLU) (training a channels-last UNet) against float64
// autograd on the CPU, from the same rounded input and output gradient: the output, dx and the
// affine gradients. Channel counts: groups straddling the 8-wide packs (320: 10 per group), the
// 512-thread block (2560, SDXL's widest up-block input), many statistics blocks per sample (640 at
// 64x64) and the scalar kernels (12 channels); the input has a large mean.
TEST(ModelsGpu, FusedGroupNormTrainingMatchesFloat64Gradients) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(fused_inference_kernels_built())
        << "built without the CUDA kernels (no nvcc at configure time)";
    const at::Device cuda(at::kCUDA, 0);
    torch::manual_seed(21);
    struct Case {
        int64_t c, groups, h, w;
    };
    for (const Case& cs :
         {Case{320, 32, 17, 9}, Case{2560, 32, 8, 8}, Case{640, 32, 64, 64}, Case{12, 4, 33, 31}}) {
        const at::Tensor x64 = at::randn({2, cs.c, cs.h, cs.w}, at::kDouble) * 2 + 4;
        const at::Tensor dy64 = at::randn({2, cs.c, cs.h, cs.w}, at::kDouble);
        const at::Tensor w64 = at::randn({cs.c}, at::kDouble), b64 = at::randn({cs.c}, at::kDouble);
        for (auto dtype : {at::kFloat, at::kBFloat16}) {
            for (bool silu : {false, true}) {
                torch::nn::GroupNorm norm(torch::nn::GroupNormOptions(cs.groups, cs.c).eps(1e-6));
                {
                    torch::NoGradGuard no_grad;
                    norm->weight.copy_(w64);
                    norm->bias.copy_(b64);
                }
                norm->to(cuda);  // float32 weights, as a trained UNet's under autocast
                const at::Tensor x =
                    x64.to(cuda, dtype).contiguous(at::MemoryFormat::ChannelsLast).requires_grad_(true);
                if (dtype == at::kFloat && cs.c > 2048) {  // 4-wide float packs: at most 512 per pixel row
                    EXPECT_FALSE(fused_group_norm_training_ready(*norm, x)) << cs.c;
                    continue;
                }
                ASSERT_TRUE(fused_group_norm_training_ready(*norm, x)) << cs.c << " " << dtype;
                const at::Tensor y = group_norm_act(*norm, x, {}, silu);
                ASSERT_TRUE(y.is_contiguous(at::MemoryFormat::ChannelsLast));
                const at::Tensor dy = dy64.to(cuda, dtype).contiguous(at::MemoryFormat::ChannelsLast);
                y.backward(dy);

                const at::Tensor xr = x.detach().cpu().to(at::kDouble).requires_grad_(true);
                const at::Tensor wr = w64.clone().requires_grad_(true), br = b64.clone().requires_grad_(true);
                at::Tensor yr = at::group_norm(xr, cs.groups, wr, br, 1e-6);
                if (silu) yr = at::silu(yr);
                yr.backward(dy.cpu().to(at::kDouble));

                const std::string what = str("c ", cs.c, " ", dtype, " silu ", silu);
                auto rel = [](const at::Tensor& got, const at::Tensor& want) {
                    return test::max_abs_diff(got.cpu().to(at::kDouble), want) /
                           want.abs().max().item<double>();
                };
                // float32: float statistics and sums; bf16: the outputs' rounding (2^-8) dominates.
                const double tol = dtype == at::kFloat ? 1e-4 : 1.2e-2;
                EXPECT_LE(rel(y.detach(), yr.detach()), tol) << what << " y";
                EXPECT_LE(rel(x.grad(), xr.grad()), tol) << what << " dx";
                EXPECT_LE(rel(norm->weight.grad(), wr.grad()), 1e-4) << what << " dweight";
                EXPECT_LE(rel(norm->bias.grad(), br.grad()), 1e-4) << what << " dbias";
            }
        }
    }
}

// GroupNormActFunction with an input bias (the ResNet blocks' folded conv bias and time embedding,
// DTUNE_FUSED_RESNET_TRAINING): y, dx and the input bias's gradient against float64 autograd of
// GroupNorm(x + in_bias), for a [C] and an [N, C] bias; then a whole ResnetBlock2D (with its 1x1
// shortcut and a time embedding) trained with the folding against the same block without it:
// output and every gradient (input, time embedding, the three conv biases, norm2's weight).
TEST(ModelsGpu, ResnetBiasFoldingInTrainingMatchesTheUnfoldedBlock) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(fused_inference_kernels_built())
        << "built without the CUDA kernels (no nvcc at configure time)";
    struct Restore {
        bool before;
        ~Restore() { set_fused_resnet_training(before); }
    } restore{fused_resnet_training_enabled()};
    set_fused_resnet_training(true);
    const at::Device cuda(at::kCUDA, 0);
    torch::manual_seed(31);
    auto rel = [](const at::Tensor& got, const at::Tensor& want) {
        const at::Tensor w = want.detach().cpu().to(at::kDouble);
        return test::max_abs_diff(got.detach().cpu().to(at::kDouble), w) / w.abs().max().item<double>();
    };
    const int64_t c = 320, groups = 32;
    const at::Tensor x64 = at::randn({2, c, 12, 10}, at::kDouble) * 2 + 1;
    const at::Tensor dy64 = at::randn({2, c, 12, 10}, at::kDouble);
    for (int bias_dims : {1, 2}) {
        torch::nn::GroupNorm norm(torch::nn::GroupNormOptions(groups, c).eps(1e-6));
        norm->to(cuda);
        const at::Tensor x =
            x64.to(cuda, at::kFloat).contiguous(at::MemoryFormat::ChannelsLast).requires_grad_(true);
        const at::Tensor in64 = bias_dims == 1 ? at::randn({c}, at::kDouble) : at::randn({2, c}, at::kDouble);
        const at::Tensor in_bias = in64.to(cuda, at::kFloat).requires_grad_(true);
        const at::Tensor y = group_norm_act(*norm, x, in_bias, /*silu=*/true);
        y.backward(dy64.to(cuda, at::kFloat).contiguous(at::MemoryFormat::ChannelsLast));
        const at::Tensor xr = x64.clone().requires_grad_(true), ir = in64.clone().requires_grad_(true);
        const at::Tensor view = bias_dims == 1 ? ir.view({1, c, 1, 1}) : ir.view({2, c, 1, 1});
        const at::Tensor yr = at::silu(at::group_norm(xr + view, groups, {}, {}, 1e-6));
        yr.backward(dy64);
        EXPECT_LE(rel(y, yr), 1e-4) << bias_dims;
        EXPECT_LE(rel(x.grad(), xr.grad()), 1e-4) << bias_dims;
        EXPECT_LE(rel(in_bias.grad(), ir.grad()), 1e-4) << bias_dims;
    }

    ResnetBlock2DOptions o;
    o.in_channels = 320;
    o.out_channels = 640;
    o.temb_channels = 64;
    ResnetBlock2D block(o);
    block->to(cuda);
    convert_to_channels_last(*block);
    const at::Tensor bx = at::randn({2, 320, 16, 16}, at::TensorOptions().device(cuda))
                              .contiguous(at::MemoryFormat::ChannelsLast);
    const at::Tensor temb = at::randn({2, 64}, at::TensorOptions().device(cuda));
    const at::Tensor g = at::randn({2, 640, 16, 16}, at::TensorOptions().device(cuda))
                             .contiguous(at::MemoryFormat::ChannelsLast);
    auto run = [&](bool fold) {
        set_fused_resnet_training(fold);
        block->zero_grad();
        const at::Tensor xi = bx.clone().requires_grad_(true), ti = temb.clone().requires_grad_(true);
        const at::Tensor out = block->forward(xi, ti);
        out.backward(g);
        std::vector<at::Tensor> got{out.detach(), xi.grad(), ti.grad()};
        for (const auto& item : block->named_parameters()) {
            const std::string& name = item.key();
            if (name.find("bias") != std::string::npos || name == "norm2.weight")
                got.push_back(item.value().grad().clone());
        }
        return got;
    };
    const std::vector<at::Tensor> plain = run(false), folded = run(true);
    ASSERT_EQ(plain.size(), folded.size());
    for (size_t i = 0; i < plain.size(); ++i) {
        ASSERT_TRUE(folded[i].defined()) << i;
        EXPECT_LE(rel(folded[i], plain[i]), 1e-4) << "tensor " << i;
    }
}

// The fused LayerNorm and residual add + LayerNorm (layer_norm.h) against float64 autograd on the CPU,
// from the same rounded inputs and output gradients: widths of 1 to 8 packs per lane (24, 320, 640,
// 1280, 2048 channels in bf16), 1,001 rows (not a multiple of a block's 8 warps), the affine
// gradients wanted or not; float32 past 1,024 channels is refused.
TEST(ModelsGpu, FusedAddLayerNormMatchesFloat64Gradients) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    set_fused_layer_norm(true);  // every case below, the affine gradients' too (auto leaves those out)
    ASSERT_TRUE(fused_inference_kernels_built())
        << "built without the CUDA kernels (no nvcc at configure time)";
    const at::Device cuda(at::kCUDA, 0);
    torch::manual_seed(23);
    for (int64_t c : {int64_t{24}, int64_t{320}, int64_t{640}, int64_t{1280}, int64_t{2048}}) {
        const at::Tensor a64 = at::randn({7, 143, c}, at::kDouble) * 2 + 3,
                         b64 = at::randn({7, 143, c}, at::kDouble);
        const at::Tensor dy64 = at::randn({7, 143, c}, at::kDouble),
                         dh64 = at::randn({7, 143, c}, at::kDouble);
        const at::Tensor w64 = at::randn({c}, at::kDouble), bias64 = at::randn({c}, at::kDouble);
        for (auto [dtype, param_dtype] : {std::pair{at::kFloat, at::kFloat},
                                          {at::kBFloat16, at::kFloat},
                                          {at::kBFloat16, at::kBFloat16}}) {
            for (bool affine_grad : {false, true}) {
                torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({c}).eps(1e-5));
                {
                    torch::NoGradGuard no_grad;
                    norm->weight.copy_(w64);
                    norm->bias.copy_(bias64);
                }
                // A bf16 model's norms read their bf16 weights directly (no float copy per call).
                norm->to(cuda, param_dtype);
                const at::Tensor w_ref = norm->weight.detach().cpu().to(at::kDouble),
                                 b_ref = norm->bias.detach().cpu().to(at::kDouble);
                norm->weight.requires_grad_(affine_grad);
                norm->bias.requires_grad_(affine_grad);
                const at::Tensor a = a64.to(cuda, dtype).requires_grad_(true);
                const at::Tensor b = b64.to(cuda, dtype).requires_grad_(true);
                if (dtype == at::kFloat && c > 1024) {
                    EXPECT_FALSE(fused_layer_norm_ready(*norm, a)) << c;
                    continue;
                }
                ASSERT_TRUE(fused_layer_norm_ready(*norm, a)) << c << " " << dtype;
                // Auto: the kernels only where the affine weights take no gradient.
                reset_fused_layer_norm();
                const bool env_set = std::getenv("DTUNE_FUSED_LAYER_NORM") != nullptr;
                if (!env_set) {
                    EXPECT_EQ(fused_layer_norm_ready(*norm, a), !affine_grad) << c;
                    torch::NoGradGuard no_grad;
                    EXPECT_TRUE(fused_layer_norm_ready(*norm, a)) << c << ": inference takes them";
                }
                set_fused_layer_norm(true);
                const at::Tensor dy = dy64.to(cuda, dtype), dh = dh64.to(cuda, dtype);
                const std::string what =
                    str("c ", c, " ", dtype, " params ", param_dtype, " affine grad ", affine_grad);
                auto rel = [](const at::Tensor& got, const at::Tensor& want) {
                    return test::max_abs_diff(got.cpu().to(at::kDouble), want) /
                           want.abs().max().item<double>();
                };
                // bf16 affine gradients are rounded to bf16 (2^-9 relative) on their way out.
                const double tol = dtype == at::kFloat ? 1e-4 : 1.2e-2,
                             sums = dtype == at::kFloat ? 1e-4 : (param_dtype == at::kBFloat16 ? 8e-3 : 2e-3);

                // Residual add + LayerNorm.
                const auto [h, y] = add_layer_norm(*norm, a, b);
                torch::autograd::backward({y, h}, {dy, dh});
                const at::Tensor ar = a.detach().cpu().to(at::kDouble).requires_grad_(true);
                const at::Tensor br = b.detach().cpu().to(at::kDouble).requires_grad_(true);
                const at::Tensor wr = w_ref.clone().requires_grad_(true),
                                 bbr = b_ref.clone().requires_grad_(true);
                const at::Tensor hr = ar + br;
                // The norm reads h as stored (rounded to the dtype), as after an unfused add; the
                // rounding is passed straight through in backward.
                const at::Tensor stored = hr + (hr.detach().to(dtype).to(at::kDouble) - hr.detach());
                const at::Tensor yr = at::layer_norm(stored, {c}, wr, bbr, 1e-5);
                torch::autograd::backward({yr, hr}, {dy.cpu().to(at::kDouble), dh.cpu().to(at::kDouble)});
                EXPECT_LE(rel(h.detach(), hr.detach()), tol) << what << " h";
                EXPECT_LE(rel(y.detach(), yr.detach()), tol) << what << " y";
                EXPECT_LE(rel(a.grad(), ar.grad()), tol) << what << " da";
                EXPECT_TRUE(at::equal(a.grad(), b.grad())) << what << " db";
                if (affine_grad) {
                    EXPECT_LE(rel(norm->weight.grad(), wr.grad()), sums) << what << " dweight";
                    EXPECT_LE(rel(norm->bias.grad(), bbr.grad()), sums) << what << " dbias";
                }

                // Plain LayerNorm.
                const at::Tensor x = a.detach().clone().requires_grad_(true);
                const at::Tensor y2 = layer_norm(*norm, x);
                y2.backward(dy);
                const at::Tensor xr = x.detach().cpu().to(at::kDouble).requires_grad_(true);
                const at::Tensor y2r = at::layer_norm(xr, {c}, w_ref, b_ref, 1e-5);
                y2r.backward(dy.cpu().to(at::kDouble));
                EXPECT_LE(rel(y2.detach(), y2r.detach()), tol) << what << " plain y";
                EXPECT_LE(rel(x.grad(), xr.grad()), tol) << what << " plain dx";
            }
        }
    }
    reset_fused_layer_norm();
}

TEST(ModelsGpu, FusedAddBiasResidualMatchesComposite) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const at::Device cuda(at::kCUDA, 0);
    torch::NoGradGuard no_grad;
    const auto cl = at::MemoryFormat::ChannelsLast;
    for (int64_t c : {int64_t{128}, int64_t{3}}) {
        const at::Tensor h = at::randn({2, c, 9, 11}), r = at::randn({2, c, 9, 11}), b = at::randn({c});
        const at::Tensor expected = (h.to(at::kDouble) + b.view({1, c, 1, 1}) + r) * 0.5;
        const at::Tensor out =
            add_bias_residual(h.to(cuda).contiguous(cl), b.to(cuda), r.to(cuda).contiguous(cl), 0.5);
        EXPECT_TRUE(out.is_contiguous(cl));
        EXPECT_LE(test::max_abs_diff(out.cpu().to(at::kDouble), expected), 1e-5) << c;
    }
}

// A whole ResNet block (time embedding, 1x1 shortcut) fused against the same block unfused, bf16.
TEST(ModelsGpu, FusedResnetBlockMatchesUnfused) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const at::Device cuda(at::kCUDA, 0);
    torch::manual_seed(12);
    ResnetBlock2DOptions o;
    o.in_channels = 64, o.out_channels = 128, o.temb_channels = 32, o.output_scale_factor = 2.0;
    ResnetBlock2D block(o);
    block->to(cuda, at::kBFloat16);
    convert_to_channels_last(*block);
    torch::NoGradGuard no_grad;
    const at::Tensor x =
        at::randn({2, 64, 24, 20}).to(cuda, at::kBFloat16).contiguous(at::MemoryFormat::ChannelsLast);
    const at::Tensor temb = at::randn({2, 32}).to(cuda, at::kBFloat16);
    const at::Tensor fused = block->forward(x, temb);
    set_fused_inference(false);
    const at::Tensor plain = block->forward(x, temb);
    set_fused_inference(true);
    EXPECT_LE(test::max_abs_diff(fused.cpu().to(at::kFloat), plain.cpu().to(at::kFloat)),
              2e-2 * plain.abs().max().item<double>());
    EXPECT_GT(test::max_abs_diff(fused.cpu().to(at::kFloat), plain.cpu().to(at::kFloat)), 0.0)
        << "identical to the last bit: the fused path did not run";
}

// The tiny VAE's encoder through the fused path (channels-last, bf16, no grad) against the float32
// CPU fixture, like the unfused bf16 path.
TEST(ModelsGpu, TinyVAEEncodesThroughTheFusedPath) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    io::SafetensorsFile ref(test::fixtures_dir() / "reference" / "vae_io.safetensors");
    ComponentLoadOptions o = cuda_bf16();
    o.channels_last = true;
    AutoencoderKL vae = load_autoencoder_kl(test::fixtures_dir() / "tiny-sdxl" / "vae", o);
    torch::NoGradGuard no_grad;
    const at::Tensor image = ref.get("image")
                                 .to(c10::Device(c10::kCUDA, 0), at::kBFloat16)
                                 .contiguous(at::MemoryFormat::ChannelsLast);
    const at::Tensor mean = vae->encode(image).mean.cpu().to(at::kFloat);
    const at::Tensor expected = ref.get("posterior_mean");
    EXPECT_LE(test::max_abs_diff(mean, expected), 0.05 * expected.abs().max().item<double>());
    const at::Tensor decoded = vae->decode(ref.get("latent")
                                               .to(c10::Device(c10::kCUDA, 0), at::kBFloat16)
                                               .contiguous(at::MemoryFormat::ChannelsLast))
                                   .cpu()
                                   .to(at::kFloat);
    EXPECT_LE(test::max_abs_diff(decoded, ref.get("decoded")),
              0.05 * ref.get("decoded").abs().max().item<double>());
}

// Float32-score attention at the SDXL VAE's mid-block shape (one 512-wide head, 128x128 tokens) in
// bf16 against SDPA in float32 on the same GPU.
TEST(ModelsGpu, WideHeadAttentionMatchesSdpa) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    torch::manual_seed(13);
    torch::NoGradGuard no_grad;
    auto opts = at::TensorOptions().device(at::kCUDA);
    const at::Tensor q = at::randn({2, 1, 4096, 512}, opts) * 2, k = at::randn({2, 1, 4096, 512}, opts) * 2;
    const at::Tensor v = at::randn({2, 1, 4096, 512}, opts);
    const at::Tensor expected = at::scaled_dot_product_attention(q, k, v);
    const at::Tensor out =
        attention_float_scores(q.to(at::kBFloat16), k.to(at::kBFloat16), v.to(at::kBFloat16));
    EXPECT_LE(test::max_abs_diff(out.to(at::kFloat).cpu(), expected.cpu()),
              2e-2 * expected.abs().max().item<double>());
    // Chunked into row blocks: the same result.
    const at::Tensor chunked = attention_float_scores(q.to(at::kBFloat16), k.to(at::kBFloat16),
                                                      v.to(at::kBFloat16), int64_t{1000} * 4096);
    EXPECT_LE(test::max_abs_diff(chunked.to(at::kFloat).cpu(), out.to(at::kFloat).cpu()), 1e-2);
}

// The fused training LoRA linear on CUDA (its factor gradients come out of the GEMMs in float32)
// against the composite path, the way dtune trains: bf16 base, float32 factors, bf16 autocast.
TEST(ModelsGpu, FusedLoRALinearMatchesCompositeUnderAutocast) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const at::Device cuda(at::kCUDA, 0);
    struct Run {
        at::Tensor y, dx, da, db;
    };
    auto run = [&](bool fused) {
        torch::manual_seed(31);
        auto layer = AdaptableLinear(torch::nn::LinearOptions(640, 320).bias(false));
        torch::nn::Module root;
        root.register_module("to_q", layer);
        LoRAConfig c;
        c.rank = 16;
        c.alpha = 16;
        c.target_modules = {"to_q"};
        LoRAAdapters adapters = inject_lora(root, c);
        LoRALayer& lora = *adapters.find("to_q");
        {
            torch::NoGradGuard no_grad;
            lora.up().normal_();
        }
        root.to(cuda);
        layer->weight.set_data(layer->weight.to(at::kBFloat16));
        const at::Tensor x = at::randn({4, 256, 640}).to(cuda).requires_grad_(true);
        const at::Tensor g = at::randn({4, 256, 320}).to(cuda, at::kBFloat16);
        set_fused_lora(fused);
        at::autocast::set_autocast_enabled(at::kCUDA, true);
        at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
        const at::Tensor y = layer->forward(x);
        at::autocast::set_autocast_enabled(at::kCUDA, false);
        y.backward(g);
        set_fused_lora(true);
        return Run{y.detach().cpu().to(at::kFloat), x.grad().cpu(), lora.down().grad().cpu(),
                   lora.up().grad().cpu()};
    };
    const Run fused = run(true), plain = run(false);
    EXPECT_EQ(fused.da.scalar_type(), at::kFloat);
    EXPECT_EQ(fused.db.scalar_type(), at::kFloat);
    for (auto [f, p] :
         {std::pair{fused.y, plain.y}, {fused.dx, plain.dx}, {fused.da, plain.da}, {fused.db, plain.db}})
        EXPECT_LE(test::max_abs_diff(f, p.to(at::kFloat)), 2e-2 * p.abs().max().item<double>());
}

// The fused q/k/v LoRA projections (adapters/lora_qkv.h) on CUDA against the layer-by-layer path at
// SDXL's first-level sizes (640 wide, 10 heads of 64, 1024 tokens; cross-attention to 77 tokens of
// 2048), the way dtune trains: bf16 base, float32 factors, bf16 autocast, LoRA r16 on q/k/v/out.0;
// with and without lora_dropout, with SDPA's own kernel and with the memory-efficient kernel alone
// (whose backward hands q/k/v's gradients back packed side by side: the one-GEMM dx).
TEST(ModelsGpu, FusedQkvLoRAMatchesLayerByLayerUnderAutocast) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const at::Device cuda(at::kCUDA, 0);
    struct Run {
        std::vector<at::Tensor> values;  // output, input and context gradients, factor gradients
    };
    auto run = [&](bool fused, bool cross, double dropout) {
        torch::manual_seed(41);
        AttentionOptions o;
        o.query_dim = 640;
        o.heads = 10;
        o.head_dim = 64;
        o.cross_attention_dim = cross ? 2048 : 0;
        torch::nn::Module root;
        Attention attn = root.register_module("attn", Attention(o));
        auto [adapters, packed] = lora_on_cuda_bf16(root, {"to_k", "to_q", "to_v", "to_out.0"}, dropout);
        EXPECT_EQ(packed, 1);
        root.train();
        if (dropout > 0) adapters.set_dropout_seed(17);
        const at::Tensor x = at::randn({2, 1024, 640}).to(cuda).requires_grad_(true);
        const at::Tensor ctx = cross ? at::randn({2, 77, 2048}).to(cuda).requires_grad_(true) : at::Tensor();
        const at::Tensor g = at::randn({2, 1024, 640}).to(cuda, at::kBFloat16);
        set_fused_qkv_lora(fused);
        EXPECT_EQ(projection_group_fuses(cross ? ctx : x, attn->projection_groups().at(0)), fused);
        at::autocast::set_autocast_enabled(at::kCUDA, true);
        at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
        const at::Tensor y = attn->forward(x, ctx);
        at::autocast::set_autocast_enabled(at::kCUDA, false);
        y.backward(g);
        set_fused_qkv_lora(true);
        Run r{{y.detach().cpu().to(at::kFloat), x.grad().cpu()}};
        if (cross) r.values.push_back(ctx.grad().cpu());
        for (auto& t : adapters.parameters()) {
            EXPECT_EQ(t.grad().scalar_type(), at::kFloat);
            r.values.push_back(t.grad().cpu());
        }
        return r;
    };
    auto& context = at::globalContext();
    const bool flash = context.userEnabledFlashSDP(), cudnn = context.userEnabledCuDNNSDP();
    for (const bool efficient_only : {false, true}) {
        context.setSDPUseFlash(flash && !efficient_only);
        context.setSDPUseCuDNN(cudnn && !efficient_only);
        for (const bool cross : {false, true}) {
            for (const double dropout : {0.0, 0.1}) {
                SCOPED_TRACE(testing::Message() << "efficient only " << efficient_only << " cross " << cross
                                                << " dropout " << dropout);
                const Run fused = run(true, cross, dropout), plain = run(false, cross, dropout);
                ASSERT_EQ(fused.values.size(), plain.values.size());
                for (std::size_t i = 0; i < fused.values.size(); ++i)
                    EXPECT_LE(test::max_abs_diff(fused.values[i], plain.values[i]),
                              2e-2 * plain.values[i].abs().max().item<double>())
                        << "tensor " << i;
            }
        }
    }
    context.setSDPUseFlash(flash);
    context.setSDPUseCuDNN(cudnn);

    // q, k and v are column slices of one [N, 3·640] buffer: SDPA must still pick the kernel it picks
    // for separate contiguous tensors (a slower fallback would eat the gain).
    torch::nn::Module root;
    AttentionOptions o;
    o.query_dim = 640;
    o.heads = 10;
    o.head_dim = 64;
    Attention attn = root.register_module("attn", Attention(o));
    LoRAConfig c;
    c.rank = 16;
    LoRAAdapters adapters = inject_lora(root, c);
    root.to(cuda, at::kBFloat16);
    ASSERT_EQ(pack_lora_projection_groups(root), 1);
    const at::Tensor x = at::randn({2, 1024, 640}, at::TensorOptions().device(cuda).dtype(at::kBFloat16));
    const ProjectionGroup group = attn->projection_groups().at(0);
    ASSERT_TRUE(projection_group_fuses(x, group));
    const auto out = project_group(x, group);
    auto heads = [](const at::Tensor& t) { return t.view({2, -1, 10, 64}).transpose(1, 2); };
    const at::Tensor q = heads(out[0]), k = heads(out[1]), v = heads(out[2]);
    EXPECT_EQ(sdpa_backend_name(q, k, v),
              sdpa_backend_name(heads(out[0].contiguous()), heads(out[1].contiguous()),
                                heads(out[2].contiguous())));
    std::cout << "  SDPA on the fused q/k/v slices: " << sdpa_backend_name(q, k, v) << std::endl;
}

// The CUDA kernel of hash_dropout keeps exactly the elements the CPU loop keeps (float, bf16; with a
// rank offset), and a CUDA graph that refreshes the seed tensor inside the capture gets new masks
// on every replay while its backward still applies each replay's own forward mask.
TEST(ModelsGpu, HashDropoutKernelMatchesTheCpuAndReplaysInAGraph) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const at::Device cuda(at::kCUDA, 0);
    const at::Tensor x = at::rand({3, 1000, 37}) + 0.5;
    // 111,000 elements take the 16-byte packs; 91, and a view one element in (unaligned), the
    // one-element kernel.
    for (const auto& [start, length] : {std::pair<int64_t, int64_t>{0, 111000}, {0, 91}, {1, 4000}})
        for (auto dtype : {at::kFloat, at::kBFloat16}) {
            const at::Tensor flat = x.to(dtype).reshape({-1});
            const at::Tensor cpu =
                hash_dropout(flat.narrow(0, start, length), at::full({1}, 77, at::kLong), 12, 0.1, 5000);
            const at::Tensor gpu = hash_dropout(flat.to(cuda).narrow(0, start, length),
                                                at::full({1}, 77, at::kLong).to(cuda), 12, 0.1, 5000)
                                       .cpu();
            EXPECT_TRUE(at::equal(gpu, cpu)) << c10::toString(dtype) << " " << start << "+" << length;
            // The fused add (the LoRA backward's input gradient), at an offset off the 4-element
            // hash groups too.
            for (int64_t offset : {int64_t{5000}, int64_t{5001}}) {
                const at::Tensor base = at::randn({length}).to(dtype);
                at::Tensor on_cpu = base.clone(), on_gpu = base.to(cuda);
                hash_dropout_add_(on_cpu, flat.narrow(0, start, length), at::full({1}, 77, at::kLong), 12,
                                  0.1, offset);
                hash_dropout_add_(on_gpu, flat.to(cuda).narrow(0, start, length),
                                  at::full({1}, 77, at::kLong).to(cuda), 12, 0.1, offset);
                EXPECT_TRUE(at::equal(on_gpu.cpu(), on_cpu))
                    << "add " << c10::toString(dtype) << " " << start << "+" << length << " @" << offset;
            }
        }
#ifdef DTUNE_WITH_CUDA
    const at::Tensor seed = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(cuda));
    const at::Tensor in = x.to(cuda).requires_grad_(true);
    at::Tensor out, grad;
    auto step = [&] {
        seed.random_();  // the device generator: advances on every replay
        if (in.grad().defined()) in.mutable_grad().zero_();
        out = hash_dropout(in, seed, 1, 0.5);
        out.backward(at::ones_like(out));
        grad = in.grad();
    };
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, 0);
    {
        const c10::cuda::CUDAStreamGuard guard(side);
        step();  // warm-up: the gradient buffer exists before the capture
        at::cuda::CUDAGraph graph;
        graph.capture_begin();
        step();
        graph.capture_end();
        std::vector<at::Tensor> masks;
        for (int i = 0; i < 3; ++i) {
            graph.replay();
            side.synchronize();
            masks.push_back((out != 0).cpu());
            EXPECT_TRUE(at::equal((grad != 0).cpu(), masks.back())) << "replay " << i;
            EXPECT_NEAR(masks.back().to(at::kDouble).mean().item<double>(), 0.5, 0.01);
        }
        EXPECT_FALSE(at::equal(masks[0], masks[1]));
        EXPECT_FALSE(at::equal(masks[1], masks[2]));
    }
#endif
}

// The LoRA dropout kernels (common/lora_dropout.h) against a float64 reference that applies
// hash_dropout's mask explicitly: float32 to float32's accuracy, bf16 and fp16 (tensor cores) to
// theirs; rows that fill no block (4097, 13001), index offsets on and off the 4-element hash groups,
// r 8 to 64 (each block shape); with an odd offset gh and h are column slices of wider matrices (the
// fused q/k/v path). The factor gradient's two-pass sum is the same run to run, and the decisions
// the forward kernel records give the backward products the same bits as hashing.
TEST(ModelsGpu, LoRADropoutKernelsMatchTheMaskedReference) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const at::Device cuda(at::kCUDA, 0);
    torch::manual_seed(12);
    // Every dtype for this test (float32's CUDA-core kernels too), whatever the environment.
    struct Restore {
        LoRADropoutKernels mode;
        ~Restore() { set_lora_dropout_kernels(mode); }
    } restore{lora_dropout_kernels_mode()};
    const auto on = at::TensorOptions().device(cuda);
    set_lora_dropout_kernels(LoRADropoutKernels::kAll);
    if (!lora_dropout_kernels_take(at::zeros({1024, 64}, on), at::zeros({4, 64}, on)))
        GTEST_SKIP() << "built without the CUDA kernels, or DTUNE_FUSED_KERNELS=0";
    // The default mode: bf16 and fp16 on tensor cores (sm_80+), float32 through the masked copy.
    set_lora_dropout_kernels(LoRADropoutKernels::kTensorCores);
    EXPECT_FALSE(lora_dropout_kernels_take(at::zeros({1024, 64}, on), at::zeros({4, 64}, on)));
#ifdef DTUNE_WITH_CUDA
    EXPECT_EQ(lora_dropout_kernels_take(at::zeros({1024, 64}, on.dtype(at::kBFloat16)),
                                        at::zeros({4, 64}, on.dtype(at::kBFloat16))),
              at::cuda::getCurrentDeviceProperties()->major >= 8);
#endif
    set_lora_dropout_kernels(LoRADropoutKernels::kAll);
    // A text encoder's keys and values (308 rows) are too few rows for the kernels: the masked copy.
    EXPECT_FALSE(lora_dropout_kernels_take(at::zeros({308, 2048}, at::TensorOptions().device(cuda)),
                                           at::zeros({16, 2048}, at::TensorOptions().device(cuda))));
    // 4097 rows: too few for 32-row blocks at rank 16 (eight-warp blocks of 16 rows instead);
    // 13001: enough on a 132-SM card.
    for (const int64_t n : {4097, 13001})
        for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf})
            for (const int64_t k : {640, 1280})
                for (const int64_t r : {8, 16, 32, 64})
                    for (const int64_t offset : {0, 7 * 4097 * 1280 + 3}) {
                        if (n > 4097 && (dtype != at::kBFloat16 || r != 16)) continue;
                        SCOPED_TRACE(testing::Message() << "n " << n << " " << c10::toString(dtype) << " k "
                                                        << k << " r " << r << " offset " << offset);
                        const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
                        const LoRADropoutMask m{at::full({1}, 99, on.dtype(at::kLong)), 21, 0.1, offset};
                        const at::Tensor x = at::randn({n, k}, on).to(dtype);
                        const at::Tensor a = (at::randn({r, k}, on) * 0.05).to(dtype);
                        const bool sliced = offset % 2 == 1;
                        const at::Tensor gh_wide = at::randn({n, 3 * r}, on).to(dtype);
                        const at::Tensor gh =
                            sliced ? gh_wide.narrow(1, r, r) : gh_wide.narrow(1, 0, r).contiguous();
                        ASSERT_TRUE(lora_dropout_kernels_take(x, a));
                        // The mask from hash_dropout (same elements in every dtype), as 0 or 1 / (1 - p).
                        const at::Tensor mask =
                            hash_dropout_no_grad(at::ones({n, k}, on), m.seed, m.salt, m.p, m.index_offset)
                                .to(at::kDouble);
                        const at::Tensor xm = x.to(at::kDouble) * mask, ad = a.to(at::kDouble);
                        const at::Tensor ghd = gh.to(at::kDouble);
                        auto close = [&](const at::Tensor& got, const at::Tensor& ref, const char* what) {
                            EXPECT_LE(test::max_abs_diff(got.to(at::kDouble).cpu(), ref.cpu()),
                                      tol * ref.abs().max().item<double>())
                                << what;
                        };

                        const at::Tensor h_ref = at::mm(xm, ad.t());
                        at::Tensor h, keep;
                        if (sliced) {
                            at::Tensor h_wide = at::zeros({n, 3 * r}, on.dtype(dtype));
                            h = h_wide.narrow(1, r, r);
                            lora_masked_down_out(h, x, a, m, &keep);
                            EXPECT_EQ(h_wide.narrow(1, 0, r).abs().max().item<float>(), 0.0f);
                            EXPECT_EQ(h_wide.narrow(1, 2 * r, r).abs().max().item<float>(), 0.0f);
                        } else {
                            h = lora_masked_down(x, a, m, &keep);
                        }
                        EXPECT_EQ(h.scalar_type(), dtype);
                        close(h, h_ref, "masked_down");
                        // The recorded decisions (16-bit types, tensor cores): one bit per element, the
                        // same as the mask; the backward products read them and give the same bits.
                        LoRADropoutMask kept = m;
                        if (dtype == at::kFloat) {
                            EXPECT_FALSE(keep.defined())
                                << "float32 takes the CUDA-core kernels, which record nothing";
                        } else {
                            ASSERT_TRUE(keep.defined());
                            ASSERT_EQ(keep.sizes(), (at::IntArrayRef{n, k / 8}));
                            const at::Tensor bits =
                                keep.to(at::kInt)
                                    .unsqueeze(-1)
                                    .bitwise_right_shift(at::arange(8, on.dtype(at::kInt)))
                                    .bitwise_and(1)
                                    .reshape({n, k});
                            EXPECT_TRUE(at::equal(bits.cpu().to(at::kBool), (mask != 0).cpu()));
                            kept.keep = keep;
                        }

                        const at::Tensor da = lora_masked_down_grad(gh, x, m, at::kFloat);
                        EXPECT_EQ(da.scalar_type(), at::kFloat);
                        close(da, at::mm(ghd.t(), xm), "masked_down_grad");
                        EXPECT_TRUE(at::equal(da, lora_masked_down_grad(gh, x, m, at::kFloat)))
                            << "deterministic";
                        EXPECT_TRUE(at::equal(da, lora_masked_down_grad(gh, x, kept, at::kFloat))) << "kept";

                        const at::Tensor dx0 = at::randn({n, k}, on).to(dtype);
                        at::Tensor dx = dx0.clone();
                        lora_masked_up_add_(dx, gh, a, m);
                        close(dx, dx0.to(at::kDouble) + mask * at::mm(ghd, ad), "masked_up_add_");
                        at::Tensor dx_kept = dx0.clone();
                        lora_masked_up_add_(dx_kept, gh, a, kept);
                        EXPECT_TRUE(at::equal(dx_kept, dx)) << "kept";
                    }
}

// The group forms of fused q/k/v's backward for two or three adapters with their own masks:
// lora_masked_up_add_group_ (one pass over dx) against float64 and the
// per-adapter kernel, the recorded decisions giving the same bits as hashing; lora_masked_down_grad_group
// (one pass over x) bit for bit the per-adapter kernel's factor gradients, and close to float64.
TEST(ModelsGpu, LoRAMaskedGroupsMatchFloat64AndThePerAdapterKernels) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const at::Device cuda(at::kCUDA, 0);
    const auto on = at::TensorOptions().device(cuda);
    if (!lora_dropout_kernels_take(at::zeros({1024, 64}, on.dtype(at::kBFloat16)),
                                   at::zeros({4, 64}, on.dtype(at::kBFloat16))))
        GTEST_SKIP() << "no tensor-core LoRA dropout kernels here";
    for (auto dtype : {at::kBFloat16, at::kHalf})
        for (const int64_t groups : {2, 3})
            for (const int64_t r : {12, 16, 24, 64}) {
                const int64_t n = 4100, k = 1280;
                SCOPED_TRACE(testing::Message()
                             << c10::toString(dtype) << " groups " << groups << " r " << r);
                const at::Tensor x = at::randn({n, k}, on).to(dtype);
                const at::Tensor a = (at::randn({groups * r, k}, on) * 0.05).to(dtype);
                const at::Tensor gh = at::randn({n, groups * r}, on).to(dtype);
                std::vector<LoRADropoutMask> masks, kept;
                at::Tensor ref = at::zeros({n, k}, on.dtype(at::kDouble));
                for (int64_t i = 0; i < groups; ++i) {
                    const LoRADropoutMask m{at::full({1}, 99, on.dtype(at::kLong)),
                                            static_cast<uint64_t>(30 + i), 0.1, 5 * i};
                    masks.push_back(m);
                    at::Tensor keep;  // the forward kernel's recorded decisions for this adapter
                    (void)lora_masked_down(x, a.narrow(0, i * r, r), m, &keep);
                    ASSERT_TRUE(keep.defined());
                    kept.push_back(m);
                    kept.back().keep = keep;
                    const at::Tensor mask =
                        hash_dropout_no_grad(at::ones({n, k}, on), m.seed, m.salt, m.p, m.index_offset)
                            .to(at::kDouble);
                    ref += mask * at::mm(gh.narrow(1, i * r, r).to(at::kDouble),
                                         a.narrow(0, i * r, r).to(at::kDouble));
                }
                const at::Tensor dx0 = at::randn({n, k}, on).to(dtype);
                ref += dx0.to(at::kDouble);
                at::Tensor dx = dx0.clone(), dx_kept = dx0.clone(), dx_each = dx0.clone();
                lora_masked_up_add_group_(dx, gh, a, masks);
                lora_masked_up_add_group_(dx_kept, gh, a, kept);
                for (int64_t i = 0; i < groups; ++i)
                    lora_masked_up_add_(dx_each, gh.narrow(1, i * r, r), a.narrow(0, i * r, r), masks[i]);
                // One pass where the group's tiles fit (groups · ⌈r / 16⌉ <= 6): one rounding, within
                // half an ulp of the float64 sum (plus float32's summation). Else adapter by adapter.
                const bool one_pass = groups * ((r + 15) / 16) <= 6;
                const at::Tensor err = (dx.to(at::kDouble) - ref).abs();
                const double ulp = dtype == at::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
                if (one_pass)
                    EXPECT_TRUE((err <= ref.abs() * (ulp / 2 + 1e-5) + 1e-6).all().item<bool>())
                        << "largest error " << err.max().item<double>();
                else
                    EXPECT_TRUE(at::equal(dx, dx_each)) << "adapter by adapter";
                EXPECT_TRUE(at::equal(dx_kept, dx)) << "kept decisions";
                // Adapter by adapter rounds after each: close, and never closer to float64.
                const at::Tensor err_each = (dx_each.to(at::kDouble) - ref).abs();
                EXPECT_LE(err.sum().item<double>(), err_each.sum().item<double>());
                EXPECT_LE(test::max_abs_diff(dx_each.to(at::kDouble).cpu(), dx.to(at::kDouble).cpu()),
                          4 * ulp * ref.abs().max().item<double>());

                const std::vector<at::ScalarType> f32(groups, at::kFloat);
                const std::vector<at::Tensor> das = lora_masked_down_grad_group(gh, x, kept, f32);
                const std::vector<at::Tensor> das_hashed = lora_masked_down_grad_group(gh, x, masks, f32);
                ASSERT_EQ(das.size(), static_cast<size_t>(groups));
                for (int64_t i = 0; i < groups; ++i) {
                    const at::Tensor gi = gh.narrow(1, i * r, r);
                    EXPECT_EQ(das[i].sizes(), (at::IntArrayRef{r, k}));
                    EXPECT_TRUE(at::equal(das[i], lora_masked_down_grad(gi, x, masks[i], at::kFloat)))
                        << "adapter " << i << ": the per-adapter kernel's bits";
                    EXPECT_TRUE(at::equal(das_hashed[i], das[i])) << "adapter " << i << ": hashed";
                    const at::Tensor mask =
                        hash_dropout_no_grad(at::ones({n, k}, on), masks[i].seed, masks[i].salt, masks[i].p,
                                             masks[i].index_offset)
                            .to(at::kDouble);
                    const at::Tensor da_ref = at::mm(gi.to(at::kDouble).t(), x.to(at::kDouble) * mask);
                    EXPECT_LE(test::max_abs_diff(das[i].to(at::kDouble).cpu(), da_ref.cpu()),
                              1e-2 * da_ref.abs().max().item<double>());
                }
            }
}

// LoRALinearFunction with lora_dropout 0.1 under bf16 autocast (bf16 base, float32 factors, the way
// dtune trains): the kernels and the composite path (DTUNE_LORA_DROPOUT_KERNELS=0) give the same
// output and gradients to bf16's accuracy.
TEST(ModelsGpu, LoRADropoutKernelsMatchTheCompositeInTraining) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const at::Device cuda(at::kCUDA, 0);
    const LoRADropoutKernels mode = lora_dropout_kernels_mode();
    auto run = [&](bool kernels, double dropout) {
        torch::manual_seed(43);
        torch::nn::Module root;
        AdaptableLinear proj = root.register_module("to_q", AdaptableLinear(640, 1280));
        LoRAConfig c;
        c.rank = 16;
        c.alpha = 16;
        c.dropout = dropout;
        c.target_modules = {"to_q"};
        LoRAAdapters adapters = inject_lora(root, c);
        {
            torch::NoGradGuard no_grad;
            for (auto& t : adapters.parameters()) t.normal_(0.0, 0.05);
        }
        root.to(cuda);
        proj->weight.set_data(proj->weight.to(at::kBFloat16));
        proj->bias.set_data(proj->bias.to(at::kBFloat16));
        root.train();
        adapters.set_dropout_seed(17, /*rank=*/1, /*world_size=*/2);  // a rank offset into the mask
        const at::Tensor x = at::randn({2, 2049, 640}).to(cuda).requires_grad_(true);  // N = 4098
        const at::Tensor g = at::randn({2, 2049, 1280}).to(cuda, at::kBFloat16);
        EXPECT_TRUE(adapters.find("to_q")->takes_whole_forward(x));  // LoRALinearFunction
        set_lora_dropout_kernels(kernels ? LoRADropoutKernels::kTensorCores : LoRADropoutKernels::kOff);
        at::autocast::set_autocast_enabled(at::kCUDA, true);
        at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
        const at::Tensor y = proj->forward(x);
        at::autocast::set_autocast_enabled(at::kCUDA, false);
        y.backward(g);
        set_lora_dropout_kernels(mode);
        std::vector<at::Tensor> values{y.detach().cpu().to(at::kFloat), x.grad().cpu()};
        for (auto& t : adapters.parameters()) {
            EXPECT_EQ(t.grad().scalar_type(), at::kFloat);
            values.push_back(t.grad().cpu());
        }
        return values;
    };
    const auto with = run(true, 0.1), without = run(false, 0.1);
    ASSERT_EQ(with.size(), without.size());
    for (std::size_t i = 0; i < with.size(); ++i)
        EXPECT_LE(test::max_abs_diff(with[i], without[i]), 2e-2 * without[i].abs().max().item<double>())
            << "tensor " << i;
    // The dropout is on: without it, A's gradient differs.
    const auto plain = run(true, 0.0);
    EXPECT_GT(test::max_abs_diff(with[2], plain[2]), 1e-2 * plain[2].abs().max().item<double>());
}

}  // namespace
}  // namespace test_models_gpu_local
}  // namespace dtune::models
