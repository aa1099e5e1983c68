// The composite side of the fused inference blocks (group_norm_act.h) and attention with float32
// scores, on the CPU against float64 references. The CUDA kernels are checked against the same
// references in test_models_gpu.cpp.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <torch/torch.h>

#include "model_test_util.h"
#include "models/adapters/lora.h"
#include "models/common/attention.h"
#include "models/common/blocks.h"
#include "models/common/geglu.h"
#include "models/common/group_norm_act.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_group_norm_act_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

at::Tensor reference_group_norm_act(const at::Tensor& x, const torch::nn::GroupNormImpl& norm,
                                    const at::Tensor& in_bias, bool silu) {
    at::Tensor in = x.to(at::kDouble);
    if (in_bias.defined())
        in = in + (in_bias.dim() == 1 ? in_bias.view({1, -1, 1, 1}) : in_bias.view({x.size(0), -1, 1, 1}))
                      .to(at::kDouble);
    at::Tensor y = at::group_norm(in, norm.options.num_groups(), norm.weight.to(at::kDouble),
                                  norm.bias.to(at::kDouble), norm.options.eps());
    return silu ? at::silu(y) : y;
}

TEST(GroupNormAct, CompositeMatchesFloat64WithInputBiasAndSilu) {
    torch::manual_seed(5);
    torch::nn::GroupNorm norm(torch::nn::GroupNormOptions(8, 32).eps(1e-6));
    torch::nn::init::normal_(norm->weight);
    torch::nn::init::normal_(norm->bias);
    torch::NoGradGuard no_grad;
    const at::Tensor x = (at::randn({2, 32, 5, 7}) + 3).contiguous(at::MemoryFormat::ChannelsLast);
    for (const at::Tensor& in_bias : {at::Tensor(), at::randn({32}), at::randn({2, 32})})
        for (bool silu : {false, true}) {
            const at::Tensor y = group_norm_act(*norm, x, in_bias, silu);
            EXPECT_LE(test::max_abs_diff(y, reference_group_norm_act(x, *norm, in_bias, silu)), 5e-5)
                << "in_bias dims " << in_bias.dim() << " silu " << silu;
        }
    EXPECT_FALSE(fused_inference_ready(x)) << "the CPU never takes the fused path";
}

TEST(GroupNormAct, AddBiasResidualComposite) {
    torch::manual_seed(6);
    const at::Tensor h = at::randn({2, 16, 3, 4}), r = at::randn({2, 16, 3, 4}), b = at::randn({16});
    const at::Tensor expected = (h + b.view({1, 16, 1, 1}) + r) * 0.5;
    EXPECT_LE(test::max_abs_diff(add_bias_residual(h.clone(), b, r, 0.5), expected), 1e-6);
    EXPECT_LE(test::max_abs_diff(add_bias_residual(h.clone(), {}, r, 1.0), h + r), 1e-6);
    EXPECT_LE(test::max_abs_diff(add_bias_residual(h.clone(), b, {}, 1.0), h + b.view({1, 16, 1, 1})), 1e-6);
}

// models::group_norm_nhwc (the channels-last GroupNorm behind set_group_norm_nhwc): values, NHWC
// output, and, with gradients on, the same input and weight gradients as at::group_norm.
TEST(GroupNormNhwc, MatchesAtenGroupNormWithAndWithoutGradients) {
    torch::manual_seed(8);
    const auto cl = at::MemoryFormat::ChannelsLast;
    const at::Tensor x0 = (at::randn({2, 16, 5, 3}) + 1).contiguous(cl);
    const at::Tensor w0 = at::randn({16}), b0 = at::randn({16});
    {
        torch::NoGradGuard no_grad;
        const at::Tensor y = group_norm_nhwc(x0, 4, w0, b0, 1e-6);
        EXPECT_TRUE(y.is_contiguous(cl));
        EXPECT_LE(test::max_abs_diff(y, at::group_norm(x0, 4, w0, b0, 1e-6)), 1e-5);
    }
    const at::Tensor up = at::randn({2, 16, 5, 3});
    auto grads = [&](bool nhwc) {
        at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
        const at::Tensor y = nhwc ? group_norm_nhwc(x, 4, w, b0, 1e-6) : at::group_norm(x, 4, w, b0, 1e-6);
        EXPECT_TRUE(!nhwc || y.is_contiguous(cl));
        y.backward(up);
        return std::pair{x.grad(), w.grad()};
    };
    const auto [dx, dw] = grads(true);
    const auto [dx_ref, dw_ref] = grads(false);
    EXPECT_LE(test::max_abs_diff(dx, dx_ref), 1e-4);
    EXPECT_LE(test::max_abs_diff(dw, dw_ref), 1e-4);
}

TEST(FusedSwitches, DtuneFusedKernelsTurnsEveryPathOff) {
    ::setenv("DTUNE_FUSED_KERNELS", "0", 1);
    EXPECT_FALSE(fused_inference_enabled());
    EXPECT_FALSE(fused_geglu_enabled());
    EXPECT_FALSE(fused_lora_enabled());
    ::unsetenv("DTUNE_FUSED_KERNELS");
    EXPECT_TRUE(fused_inference_enabled());
    EXPECT_TRUE(fused_geglu_enabled());
    EXPECT_TRUE(fused_lora_enabled());
}

// Chunked three ways (several pairs per chunk, one pair per chunk, row blocks of one pair): each
// must equal SDPA computed in float64.
TEST(AttentionFloatScores, MatchesSdpaInEveryChunking) {
    torch::manual_seed(7);
    const at::Tensor q = at::randn({2, 3, 37, 40}), k = at::randn({2, 3, 29, 40}),
                     v = at::randn({2, 3, 29, 40});
    const at::Tensor expected =
        at::scaled_dot_product_attention(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble));
    for (int64_t max_scores :
         {int64_t{1} << 20, int64_t{37 * 29 * 2}, int64_t{37 * 29}, int64_t{100}, int64_t{1}}) {
        const at::Tensor out = attention_float_scores(q, k, v, max_scores);
        ASSERT_EQ(out.sizes(), q.sizes());
        EXPECT_LE(test::max_abs_diff(out, expected), 1e-5) << "max_score_elements " << max_scores;
    }
}

}  // namespace
}  // namespace test_group_norm_act_unit_local
}  // namespace dtune::models
