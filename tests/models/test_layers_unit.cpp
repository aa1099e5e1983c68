// models/common/layers.h: outside an UninitializedParameters scope our Linear/Conv2d/Embedding must
// equal torch::nn's bit for bit (same seeded init, same forward); inside one they allocate in the
// scope's dtype/device without init, and the scope nests and restores.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/error.h"
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
