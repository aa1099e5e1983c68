// SDXLPipeline behaviour with the tiny SDXL model on the CPU: seeded determinism down to the PNG
// bytes, guidance 1.0 equal to a hand-written unguided loop, batching / num_images_per_prompt row
// order, request validation, and a LoRA at strength 0 leaving the result unchanged.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/InferenceMode.h>

#include "core/error.h"
#include "diffusion/sampler.h"
#include "io/image.h"
#include "support/test_support.h"
#include "validate/sdxl_pipeline.h"

namespace dtune {
namespace test_pipeline_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
    return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

validate::SDXLPipeline& tiny_pipeline() {
    static auto pipe = validate::SDXLPipeline::load(test::fixtures_dir() / "tiny-sdxl");
    return pipe;
}

validate::GenerationRequest small_request() {
    validate::GenerationRequest r;
    r.prompt = {"a photo of a cat"};
    r.negative_prompt = std::vector<std::string>{"blurry"};
    r.width = 64;
    r.height = 64;
    r.steps = 3;
    r.guidance_scale = 4.0;
    r.seed = 1234;
    return r;
}

TEST(SDXLPipeline, SameSeedSamePngBytes) {
    auto& pipe = tiny_pipeline();
    auto r = small_request();
    r.sampler = "euler_a";  // ancestral: the generator also feeds every step
    const auto a = pipe.generate(r);
    const auto b = pipe.generate(r);
    const auto png_a = io::encode_png(validate::to_rgb_images(a.images).at(0));
    const auto png_b = io::encode_png(validate::to_rgb_images(b.images).at(0));
    EXPECT_EQ(png_a, png_b);
    r.seed = 1235;
    const auto c = pipe.generate(r);
    EXPECT_GT(max_abs_diff(a.latents, c.latents), 1e-3) << "a different seed must give different latents";
}

TEST(SDXLPipeline, SeedGivesTorchRandnInitialLatents) {
    // The seeded draw equals at::randn from a CPU generator seeded the same (torch.manual_seed),
    // so passing those latents explicitly must give identical results.
    auto& pipe = tiny_pipeline();
    auto r = small_request();
    r.decode = false;
    const auto seeded = pipe.generate(r);
    at::Generator g = at::detail::createCPUGenerator(r.seed);
    r.latents = at::randn({1, 4, 8, 8}, g, at::TensorOptions().dtype(at::kFloat));
    const auto given = pipe.generate(r);
    EXPECT_TRUE(at::equal(seeded.latents, given.latents));
    EXPECT_FALSE(seeded.images.defined());
}

TEST(SDXLPipeline, GuidanceOneEqualsUnguidedLoop) {
    auto& pipe = tiny_pipeline();
    auto r = small_request();
    r.guidance_scale = 1.0;
    r.negative_prompt.reset();
    r.decode = false;
    const auto out = pipe.generate(r);

    // Independent loop: conditional UNet pass only, Euler from the scheduler config.
    c10::InferenceMode guard;
    models::SDXLEncodeOptions enc;
    enc.do_classifier_free_guidance = false;
    const auto e = pipe.text_encoders().encode_prompt(r.prompt, enc);
    auto sampler = diffusion::make_sampler(pipe.scheduler_config(), "euler");
    sampler->set_timesteps(r.steps);
    at::Generator g = at::detail::createCPUGenerator(r.seed);
    at::Tensor x =
        at::randn({1, 4, 8, 8}, g, at::TensorOptions().dtype(at::kFloat)) * sampler->init_noise_sigma();
    const at::Tensor ids = at::tensor(std::vector<float>{64, 64, 0, 0, 64, 64}).reshape({1, 6});
    for (int64_t i = 0; i < sampler->num_steps(); ++i) {
        const at::Tensor eps = pipe.unet()->forward(sampler->scale_model_input(x, i), sampler->timesteps()[i],
                                                    e.prompt_embeds, {e.pooled_prompt_embeds, ids});
        x = sampler->step(eps, i, x);
    }
    EXPECT_LE(max_abs_diff(out.latents, x), 1e-6);

    // And guidance > 1 does change the result (the guided path is really taken).
    r.guidance_scale = 3.0;
    EXPECT_GT(max_abs_diff(pipe.generate(r).latents, x), 1e-3);
}

TEST(SDXLPipeline, BatchRowsArePromptMajor) {
    auto& pipe = tiny_pipeline();
    auto r = small_request();
    r.decode = false;
    r.prompt = {"a photo of a cat", "a red car"};
    r.num_images_per_prompt = 2;
    at::Generator g = at::detail::createCPUGenerator(7);
    const at::Tensor init = at::randn({4, 4, 8, 8}, g, at::TensorOptions().dtype(at::kFloat));
    r.latents = init;
    const auto batch = pipe.generate(r);
    ASSERT_EQ(batch.latents.size(0), 4);
    // Row 2 is the first image of prompt 2 ("a red car").
    auto single = r;
    single.prompt = {"a red car"};
    single.num_images_per_prompt = 1;
    single.latents = init.slice(0, 2, 3);
    EXPECT_LE(max_abs_diff(pipe.generate(single).latents, batch.latents.slice(0, 2, 3)), 1e-4);
}

TEST(SDXLPipeline, KarrasNameSwitchesTheSigmaSchedule) {
    // dpmpp_2m and dpmpp_2m_karras share the solver and differ only in their sigmas, so their
    // results must differ; both must run from the tiny model's Euler scheduler config.
    auto& pipe = tiny_pipeline();
    auto r = small_request();
    r.decode = false;
    r.sampler = "dpmpp_2m";
    const auto plain = pipe.generate(r);
    r.sampler = "dpmpp_2m_karras";
    const auto karras = pipe.generate(r);
    EXPECT_GT(max_abs_diff(plain.latents, karras.latents), 1e-3);
    r.sampler = "dpm++";  // the diffusion layer's own name is the non-Karras variant here too
    EXPECT_TRUE(at::equal(pipe.generate(r).latents, plain.latents));
}

TEST(SDXLPipeline, RejectsBadRequests) {
    auto& pipe = tiny_pipeline();
    auto r = small_request();
    r.width = 60;
    EXPECT_THROW(pipe.generate(r), UsageError);
    r = small_request();
    r.steps = 0;
    EXPECT_THROW(pipe.generate(r), UsageError);
    r = small_request();
    r.prompt = {"a", "b", "c"};
    r.negative_prompt = std::vector<std::string>{"x", "y"};
    EXPECT_THROW(pipe.generate(r), UsageError);
    r = small_request();
    r.latents = at::zeros({1, 4, 4, 4});
    EXPECT_THROW(pipe.generate(r), UsageError);
    r = small_request();
    r.sampler = "heun";
    EXPECT_THROW(pipe.generate(r), UsageError);
}

TEST(SDXLPipeline, LoRAAtStrengthZeroChangesNothingAndOneDoes) {
    const auto lora = test::fixtures_dir() / "reference" / "lora" / "pytorch_lora_weights.safetensors";
    auto r = small_request();
    const auto base = tiny_pipeline().generate(r);
    auto zero = validate::SDXLPipeline::load(test::fixtures_dir() / "tiny-sdxl");
    zero.load_lora(lora, 0.0);
    ASSERT_NE(zero.lora(), nullptr);
    EXPECT_TRUE(at::equal(zero.generate(r).images, base.images));
    EXPECT_THROW(zero.load_lora(lora, 1.0), UsageError);  // one LoRA per pipeline
    auto one = validate::SDXLPipeline::load(test::fixtures_dir() / "tiny-sdxl");
    one.load_lora(lora, 1.0);
    EXPECT_GT(max_abs_diff(one.generate(r).latents, base.latents), 1e-3);
}

}  // namespace
}  // namespace test_pipeline_unit_local
}  // namespace dtune
