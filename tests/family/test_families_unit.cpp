// The model-family layer's own behaviour on the tiny fixtures (CPU): the registry, Flux's caption
// dropout, the flow-matching objective's refusal of DDPM-only features, and the Flux denoiser's
// forward (packing, ids, guidance default) at changing latent sizes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "core/error.h"
#include "family/flux/flux_family.h"
#include "family/model_family.h"
#include "family/sdxl/sdxl_family.h"
#include "models/flux/flux_transformer.h"
#include "support/test_support.h"

namespace dtune::family {
namespace test_families_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

const std::filesystem::path kRef = std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref";

TEST(Families, RegistryNamesAndFolders) {
    EXPECT_EQ(&family_named("sdxl"), &sdxl_family());
    EXPECT_EQ(&family_named("flux"), &flux_family());
    EXPECT_THROW(family_named("sd3"), UsageError);
    EXPECT_EQ(family_of_model_folder(kRef / "tiny-flux-pipeline"), &flux_family());
    EXPECT_EQ(family_of_model_folder(test::fixtures_dir() / "tiny-sdxl"), &sdxl_family());
    EXPECT_EQ(family_of_model_folder(kRef / "no-such-folder"), nullptr);
    EXPECT_EQ(&family_of_model(kRef / "tiny-flux-dev-bfl.safetensors"), &flux_family());
}

TEST(Families, FluxCaptionDropoutCopiesTheEmptyCaptionsEncodings) {
    Conditioning batch{{"prompt_embeds", at::ones({3, 5, 4})},
                       {"pooled_prompt_embeds", at::ones({3, 2})},
                       {"attention_mask", at::ones({3, 5}, at::kLong)}};
    const Conditioning empty{{"prompt_embeds", at::full({5, 4}, 7.0)},
                             {"pooled_prompt_embeds", at::full({2}, 3.0)},
                             {"attention_mask", at::zeros({5}, at::kLong)}};
    flux_family().drop_caption(batch, 1, empty);
    for (const auto& [name, t] : batch) {
        EXPECT_TRUE(at::equal(t[1], empty.at(name).to(t.scalar_type()))) << name;
        EXPECT_TRUE(at::equal(t[0], at::ones_like(t[0]))) << name << ": another row changed";
        EXPECT_TRUE(at::equal(t[2], at::ones_like(t[2]))) << name;
    }
}

TEST(Families, FlowMatchingObjectiveRefusesDdpmOnlyFeatures) {
    const TrainingObjective flow = flux_family().training_objective(kRef / "tiny-flux-pipeline");
    EXPECT_TRUE(flow.flow_matching());
    try {
        (void)flow.ddpm("eval loss (eval datasets)");
        FAIL() << "a flow-matching objective has no DDPM schedule";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("eval loss"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("flow matching"), std::string::npos) << e.what();
    }
}

// The denoiser caches the image ids per latent size: alternating sizes must give what a fresh
// denoiser gives, which is the transformer on packed latents with ids built for that size.
TEST(Families, FluxDenoiserForwardAtChangingSizes) {
    at::NoGradGuard no_grad;
    auto transformer = models::load_flux_transformer(kRef / "tiny-flux-dev");
    const auto net = flux_family().wrap_denoiser(transformer.ptr());
    const auto cfg = transformer->config();
    auto gen = at::detail::createCPUGenerator(5);
    const Conditioning cond{{"prompt_embeds", at::randn({1, 6, cfg.joint_attention_dim}, gen)},
                            {"pooled_prompt_embeds", at::randn({1, cfg.pooled_projection_dim}, gen)}};
    const int64_t c = cfg.in_channels / 4;
    const at::Tensor t = at::full({1}, 500.0);
    for (const auto& [h, w] : {std::pair<int64_t, int64_t>{4, 6}, {6, 4}, {4, 6}}) {
        const at::Tensor x = at::randn({1, c, h, w}, gen);
        const at::Tensor got = net->forward(x, t, cond);
        const at::Tensor want = models::flux_unpack_latents(
            transformer->forward(models::flux_pack_latents(x), cond.at("prompt_embeds"),
                                 cond.at("pooled_prompt_embeds"), t / 1000.0, at::ones({1}),
                                 models::flux_image_ids(h, w), at::zeros({6, 3})),
            h, w);
        ASSERT_EQ(got.sizes(), x.sizes());
        EXPECT_TRUE(at::equal(got, want)) << h << "x" << w;
    }
}

}  // namespace
}  // namespace test_families_unit_local
}  // namespace dtune::family
