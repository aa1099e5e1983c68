// UNet2DConditionModel against diffusers (fixtures/reference/unet_io.safetensors, produced by
// fixtures/gen/gen_fixtures.py on the tiny SDXL UNet): square and non-square outputs, and the
// gradients of out.square().mean() for four parameters, with and without gradient checkpointing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "model_test_util.h"
#include "models/unet/unet_2d_condition.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_unet_parity_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

constexpr double kTol = 1e-4;  // fixtures README: float32 CPU outputs of order 1

struct UNetFixture {
    io::SafetensorsFile ref{test::fixtures_dir() / "reference" / "unet_io.safetensors"};
    UNet2DConditionModel unet = load_unet(test::fixtures_dir() / "tiny-sdxl" / "unet");
    at::Tensor get(const std::string& name) const { return test::fixture_tensor(ref, name); }

    at::Tensor forward_square() {
        return unet->forward(get("sample"), get("timestep"), get("encoder_hidden_states"),
                             {get("text_embeds"), get("time_ids")});
    }
};

const char* const kGradNames[] = {
    "conv_in.weight",
    "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight",
    "mid_block.attentions.0.transformer_blocks.1.ff.net.0.proj.weight",
    "add_embedding.linear_1.weight",
};

void check_gradients(UNetFixture& f) {
    f.unet->zero_grad();
    f.forward_square().square().mean().backward();
    auto params = f.unet->named_parameters(true);
    for (const char* name : kGradNames) {
        const at::Tensor expected = f.get(std::string("grad.") + name);
        const at::Tensor* p = params.find(name);
        ASSERT_NE(p, nullptr) << name;
        ASSERT_TRUE(p->grad().defined()) << name;
        // Gradients are O(1e-3..1e-2), so the 1e-4 tolerance is taken relative to each one's
        // largest entry (observed errors are ~5e-6 of it).
        const double scale = expected.abs().max().item<double>();
        EXPECT_LE(test::reported_diff(name, p->grad(), expected), kTol * scale) << name;
    }
}

TEST(UNetParity, ParameterCountMatchesDiffusers) {
    UNetFixture f;
    int64_t n = 0;
    for (const auto& p : f.unet->parameters()) n += p.numel();
    // The tiny UNet's safetensors file holds 3,470,276 parameters (VERSIONS.json's count includes
    // the LoRA adapter added later in gen_fixtures.py).
    EXPECT_EQ(n, 3470276);
}

TEST(UNetParity, SquareOutputMatchesDiffusers) {
    UNetFixture f;
    torch::NoGradGuard no_grad;
    const at::Tensor out = f.forward_square();
    const at::Tensor expected = f.get("out");
    ASSERT_EQ(out.sizes(), expected.sizes());
    EXPECT_LE(test::reported_diff("output", out, expected), kTol);
}

TEST(UNetParity, NonSquareOutputMatchesDiffusers) {
    UNetFixture f;
    torch::NoGradGuard no_grad;
    const at::Tensor ehs = f.get("encoder_hidden_states").narrow(0, 0, 1);
    const at::Tensor out =
        f.unet->forward(f.get("sample_nonsquare"), at::full({1}, 999, at::kLong), ehs,
                        {f.get("text_embeds").narrow(0, 0, 1), f.get("time_ids").narrow(0, 0, 1)});
    const at::Tensor expected = f.get("out_nonsquare");
    ASSERT_EQ(out.sizes(), expected.sizes());
    EXPECT_LE(test::reported_diff("output", out, expected), kTol);
}

TEST(UNetParity, GradientsMatchDiffusers) {
    UNetFixture f;
    check_gradients(f);
}

TEST(UNetParity, CheckpointedGradientsMatchDiffusers) {
    UNetFixture f;
    f.unet->set_gradient_checkpointing(true);
    check_gradients(f);
}

}  // namespace
}  // namespace test_unet_parity_local
}  // namespace dtune::models
