// models/common/layers.h: outside an UninitializedParameters scope our Linear/Conv2d/Embedding must
// equal torch::nn's bit for bit (same seeded init, same forward); inside one they allocate in the
// scope's dtype/device without init, and the scope nests and restores. Also the CPU side of the
// cuBLASLt epilogue paths (gelu_mlp.h, epilogue_linear.h): never taken there, the composite exactly.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/error.h"
#include "models/common/adaptable.h"
#include "models/common/epilogue_linear.h"
#include "models/common/gelu_mlp.h"
#include "models/common/layers.h"

namespace dtune::models {
namespace test_layers_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

TEST(Layers, LinearEqualsTorchLinearWithTheSameSeed) {
    torch::manual_seed(7);
    torch::nn::Linear ref(torch::nn::LinearOptions(5, 3));
    torch::manual_seed(7);
    Linear ours(5, 3);
    EXPECT_TRUE(torch::equal(ours->weight, ref->weight));
    EXPECT_TRUE(torch::equal(ours->bias, ref->bias));
    const at::Tensor x = torch::randn({2, 4, 5});
    EXPECT_TRUE(torch::equal(ours->forward(x), ref->forward(x)));
    EXPECT_EQ(ours->named_parameters().size(), 2u);

    Linear no_bias(torch::nn::LinearOptions(5, 3).bias(false));
    EXPECT_FALSE(no_bias->bias.defined());
    EXPECT_EQ(no_bias->named_parameters().size(), 1u);  // "weight" only, like torch's
}

// On the CPU the GELU MLP and add_linear_ never take cuBLASLt: gelu_mlp / concat_gelu_mlp are the
// layers' own forward with at::gelu(tanh) (the attention part first in the concatenation), bit for
// bit, with gradients; add_linear_ declines and leaves y as it was.
TEST(Layers, EpiloguePathsAreTheCompositeOnTheCpu) {
    torch::manual_seed(5);
    AdaptableLinear in(8, 32), out(32, 8), out_cat(4 + 32, 8);
    for (auto* l : {in.get(), out.get(), out_cat.get()}) {
        l->weight.requires_grad_(false);
        l->bias.requires_grad_(false);
    }
    const at::Tensor x = torch::randn({2, 5, 8}).requires_grad_(true), a = torch::randn({2, 5, 4});
    EXPECT_FALSE(gelu_mlp_fuses(0, x, *in, *out));
    EXPECT_FALSE(gelu_mlp_fuses(4, x, *in, *out_cat));
    const at::Tensor y = gelu_mlp(x, *in, *out);
    const at::Tensor ref = out->forward(at::gelu(in->forward(x), "tanh"));
    EXPECT_TRUE(torch::equal(y, ref));
    const at::Tensor gy = torch::autograd::grad({y.sum()}, {x})[0],
                     gref = torch::autograd::grad({ref.sum()}, {x})[0];
    EXPECT_TRUE(torch::equal(gy, gref));
    EXPECT_TRUE(torch::equal(concat_gelu_mlp(a, x, *in, *out_cat),
                             out_cat->forward(at::cat({a, at::gelu(in->forward(x), "tanh")}, -1))));

    const at::Tensor x2 = torch::randn({6, 8}), w = torch::randn({3, 8}), b = torch::randn({3});
    at::Tensor acc = torch::randn({6, 3});
    const at::Tensor before = acc.clone();
    EXPECT_FALSE(add_linear_applies(x2, w, b));
    EXPECT_FALSE(add_linear_(acc, x2, w, b));
    EXPECT_TRUE(torch::equal(acc, before));
}

TEST(Layers, Conv2dEqualsTorchConv2dWithTheSameSeed) {
    const auto options = torch::nn::Conv2dOptions(4, 6, 3).stride(2).padding(1);
    torch::manual_seed(3);
    torch::nn::Conv2d ref(options);
    torch::manual_seed(3);
    Conv2d ours(options);
    EXPECT_TRUE(torch::equal(ours->weight, ref->weight));
    EXPECT_TRUE(torch::equal(ours->bias, ref->bias));
    const at::Tensor x = torch::randn({2, 4, 9, 7});
    EXPECT_TRUE(torch::equal(ours->forward(x), ref->forward(x)));
}

TEST(Layers, EmbeddingEqualsTorchEmbeddingWithTheSameSeed) {
    torch::manual_seed(5);
    torch::nn::Embedding ref(10, 4);
    torch::manual_seed(5);
    Embedding ours(10, 4);
    EXPECT_TRUE(torch::equal(ours->weight, ref->weight));
    const at::Tensor ids = torch::tensor({{1, 9, 0}}, torch::kLong);
    EXPECT_TRUE(torch::equal(ours->forward(ids), ref->forward(ids)));
}

TEST(Layers, ScopeAllocatesInItsDtypeWithoutTouchingTheGenerator) {
    torch::manual_seed(11);
    const at::Tensor expected_next = torch::rand({4});
    torch::manual_seed(11);
    {
        UninitializedParameters scope(at::kBFloat16, c10::Device(c10::kCPU));
        Linear linear(8, 16);
        Conv2d conv(torch::nn::Conv2dOptions(2, 4, 3).padding(1));
        Embedding emb(7, 3);
        for (const at::Tensor& t : {linear->weight, linear->bias, conv->weight, conv->bias, emb->weight})
            EXPECT_EQ(t.scalar_type(), at::kBFloat16);
        EXPECT_EQ(conv->weight.sizes(), at::IntArrayRef({4, 2, 3, 3}));
        EXPECT_TRUE(linear->weight.requires_grad());
    }
    // No random init ran inside the scope: the generator is where the seed left it.
    EXPECT_TRUE(torch::equal(torch::rand({4}), expected_next));
    EXPECT_FALSE(UninitializedParameters::current().has_value());
}

TEST(Layers, ScopesNestAndRestore) {
    UninitializedParameters outer(at::kHalf, c10::Device(c10::kCPU));
    {
        UninitializedParameters inner(at::kDouble, c10::Device(c10::kCPU));
        EXPECT_EQ(Linear(2, 2)->weight.scalar_type(), at::kDouble);
    }
    EXPECT_EQ(Linear(2, 2)->weight.scalar_type(), at::kHalf);
    ASSERT_TRUE(UninitializedParameters::current().has_value());
    EXPECT_EQ(UninitializedParameters::current()->dtype(), caffe2::TypeMeta::Make<at::Half>());
}

TEST(Layers, UnsupportedConvPaddingIsAUsageError) {
    EXPECT_THROW(Conv2d(torch::nn::Conv2dOptions(2, 2, 3).padding(torch::kSame)), UsageError);
    EXPECT_THROW(Conv2d(torch::nn::Conv2dOptions(2, 2, 3).padding(1).padding_mode(torch::kReflect)),
                 UsageError);
}

}  // namespace
}  // namespace test_layers_unit_local
}  // namespace dtune::models
