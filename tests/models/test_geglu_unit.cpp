// Fused GEGLU on the CPU: values and gradients equal the composite chunk + gelu + mul (the autograd
// function, the CPU kernel and the shared formulas in geglu_math.h, which the CUDA kernels use too).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "model_test_util.h"
#include "models/common/geglu.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_geglu_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

// Forward and input gradient of `fn` at `proj` with upstream gradient `up`.
std::pair<at::Tensor, at::Tensor> value_and_grad(at::Tensor (*fn)(const at::Tensor&), const at::Tensor& proj,
                                                 const at::Tensor& up) {
    at::Tensor x = proj.detach().clone().requires_grad_(true);
    at::Tensor y = fn(x);
    y.backward(up);
    return {y.detach(), x.grad()};
}

TEST(Geglu, FusedMatchesCompositeInDouble) {
    ASSERT_TRUE(fused_geglu_available(at::kCPU));
    torch::manual_seed(0);
    // Gates over [-6, 6] cover both tails of the GELU; odd row count and a width that is no vector size.
    const at::Tensor proj = at::randn({3, 7, 2 * 11}, at::kDouble) * 3;
    const at::Tensor up = at::randn({3, 7, 11}, at::kDouble);
    auto [y_fused, g_fused] = value_and_grad(&geglu, proj, up);
    auto [y_ref, g_ref] = value_and_grad(&geglu_composite, proj, up);
    EXPECT_EQ(y_fused.sizes(), (std::vector<int64_t>{3, 7, 11}));
    EXPECT_LE(test::max_abs_diff(y_fused, y_ref), 1e-12);
    EXPECT_LE(test::max_abs_diff(g_fused, g_ref), 1e-12);
}

TEST(Geglu, GradientMatchesCentralDifferences) {
    torch::manual_seed(2);
    const at::Tensor proj = at::randn({2, 8}, at::kDouble) * 2;
    const at::Tensor up = at::randn({2, 4}, at::kDouble);
    auto [y, grad] = value_and_grad(&geglu, proj, up);
    const double h = 1e-6;
    at::Tensor numeric = at::zeros_like(proj);
    for (int64_t i = 0; i < proj.numel(); ++i) {
        at::Tensor plus = proj.clone(), minus = proj.clone();
        plus.view(-1)[i] += h;
        minus.view(-1)[i] -= h;
        numeric.view(-1)[i] = ((geglu(plus) - geglu(minus)) * up).sum() / (2 * h);
    }
    EXPECT_LE(test::max_abs_diff(grad, numeric), 1e-7);
}

TEST(Geglu, FusedMatchesCompositeInLowPrecision) {
    torch::manual_seed(1);
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
        const at::Tensor proj = (at::randn({4, 5, 64}) * 2).to(dtype);
        const at::Tensor up = at::randn({4, 5, 32}).to(dtype);
        auto [y_fused, g_fused] = value_and_grad(&geglu, proj, up);
        auto [y_ref, g_ref] = value_and_grad(&geglu_composite, proj, up);
        EXPECT_EQ(y_fused.scalar_type(), dtype);
        EXPECT_EQ(g_fused.scalar_type(), dtype);
        // The fused path rounds once, the composite twice: at most a couple of units in the last place.
        // Relative to the largest value: ~1 unit in the last place of the dtype (bf16: 2^-8).
        const double rel = dtype == at::kFloat ? 1e-6 : 1e-2;
        EXPECT_LE(test::max_abs_diff(y_fused, y_ref), rel * y_ref.abs().max().item<double>()) << dtype;
        EXPECT_LE(test::max_abs_diff(g_fused, g_ref), rel * g_ref.abs().max().item<double>()) << dtype;
    }
}

TEST(Geglu, SwitchSelectsTheCompositePath) {
    const at::Tensor proj = at::randn({2, 6}).requires_grad_(true);
    set_fused_geglu(false);
    const at::Tensor y = geglu(proj);
    set_fused_geglu(true);
    // The composite path's graph ends in a multiplication; the fused one in the custom function.
    ASSERT_TRUE(y.grad_fn());
    EXPECT_NE(y.grad_fn()->name().find("Mul"), std::string::npos) << y.grad_fn()->name();
    EXPECT_NE(geglu(proj).grad_fn()->name().find("Geglu"), std::string::npos)
        << geglu(proj).grad_fn()->name();
}

TEST(Geglu, NonContiguousInputIsHandled) {
    const at::Tensor base = at::randn({6, 4}, at::kDouble);
    const at::Tensor proj = base.t();  // [4, 6], not contiguous
    EXPECT_LE(test::max_abs_diff(geglu(proj), geglu_composite(proj)), 1e-12);
}

}  // namespace
}  // namespace test_geglu_unit_local
}  // namespace dtune::models
