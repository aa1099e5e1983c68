// SimpleTuner's Flux training keys at the family and model level, against
// tools/ref/gen_flux_training_keys_ref.py (tests/data/ref/flux_training_keys_ref.json and
// flux_masked_attention_io.safetensors):
//   flux_lora_target: the layers each value adapts equal the layers peft adapts in diffusers'
//     FluxTransformer2DModel given SimpleTuner's list for it;
//   flux_attention_masked_training: the transformer with a T5 mask equals diffusers' with the joint
//     boolean key mask, and the masked tokens' values cannot reach the image;
//   fuse_qkv_projections: the same outputs and gradients as separate projections;
//   apply_training_config: the keys reach the objective and the denoiser.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "family/flux/flux_family.h"
#include "io/safetensors.h"
#include "models/adapters/lora.h"
#include "models/flux/flux_transformer.h"
#include "train/config.h"

namespace dtune::family {
namespace test_flux_training_keys_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

const std::filesystem::path kRef = std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref";

nlohmann::json reference() {
    std::ifstream in(kRef / "flux_training_keys_ref.json");
    EXPECT_TRUE(in.good()) << "tests/data/ref/flux_training_keys_ref.json is missing";
    return nlohmann::json::parse(in);
}

at::Tensor fixture(const io::SafetensorsFile& f, const char* name) {
    return f.get(name).to(at::kFloat).contiguous();
}

TEST(FluxTrainingKeys, LoraTargetsAdaptWhatSimpleTunersListsAdapt) {
    const nlohmann::json ref = reference();
    const auto& m = ref.at("lora_model");
    models::FluxTransformerConfig c;
    c.in_channels = c.out_channels = m.at("in_channels");
    c.num_layers = m.at("num_layers");
    c.num_single_layers = m.at("num_single_layers");
    c.attention_head_dim = m.at("attention_head_dim");
    c.num_attention_heads = m.at("num_attention_heads");
    c.joint_attention_dim = m.at("joint_attention_dim");
    c.pooled_projection_dim = m.at("pooled_projection_dim");
    c.guidance_embeds = m.at("guidance_embeds");
    c.axes_dims_rope = m.at("axes_dims_rope").get<std::vector<int64_t>>();
    std::set<std::string> seen;
    for (const auto& [name, entry] : ref.at("lora_targets").items()) {
        SCOPED_TRACE(name);
        seen.insert(name);
        models::FluxTransformer2DModel model(c);
        models::LoRAConfig lc;
        lc.rank = 2;
        lc.target_modules = flux_lora_target_modules(name);
        const models::LoRAAdapters adapters = models::inject_lora(*model, lc);
        std::set<std::string> got;
        for (const auto& e : adapters.entries()) got.insert(e.module);
        const std::vector<std::string> want_list = entry.at("adapted");
        const std::set<std::string> want(want_list.begin(), want_list.end());
        EXPECT_EQ(got, want);
    }
    // Every value dtune accepts is covered, and config.cpp offers exactly these.
    std::set<std::string> accepted;
    std::string list = std::string(kFluxLoraTargets) + ",";
    for (size_t at = 0, next; (next = list.find(',', at)) != std::string::npos; at = next + 1)
        accepted.insert(list.substr(at, next - at));
    EXPECT_EQ(seen, accepted);
    for (const auto& spec : train::option_specs()) {
        if (std::string(spec.name) == "flux_lora_target") {
            EXPECT_STREQ(spec.choices, kFluxLoraTargets);
        }
    }
    EXPECT_EQ(flux_family().default_lora_targets(), flux_lora_target_modules("all"));
    try {
        (void)flux_lora_target_modules("controlnet");
        FAIL() << "controlnet needs ControlNet training";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("flux_lora_target"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("all+ffs+embedder"), std::string::npos) << e.what();
    }
}

TEST(FluxTrainingKeys, MaskedAttentionMatchesDiffusersJointKeyMask) {
    const io::SafetensorsFile io(kRef / "flux_transformer_io.safetensors");
    const io::SafetensorsFile masked(kRef / "flux_masked_attention_io.safetensors");
    at::NoGradGuard no_grad;
    auto model = models::load_flux_transformer(kRef / "tiny-flux-dev");
    const at::Tensor hidden = fixture(io, "hidden"), pooled = fixture(io, "pooled"),
                     t = fixture(io, "timestep"), guidance = fixture(io, "guidance"),
                     img_ids = fixture(io, "img_ids"), txt_ids = fixture(io, "txt_ids");
    at::Tensor encoder = fixture(io, "encoder");      // [2, 5, 24]
    const at::Tensor mask = masked.get("text_mask");  // [2, 5] int64
    const at::Tensor out = model->forward(hidden, encoder, pooled, t, guidance, img_ids, txt_ids, mask);
    const at::Tensor want = fixture(masked, "masked_out");
    EXPECT_LE((out - want).abs().max().item<double>(), 1e-5 * want.abs().max().item<double>());
    // Without the mask the output is diffusers' unmasked one, which differs.
    const at::Tensor plain = model->forward(hidden, encoder, pooled, t, guidance, img_ids, txt_ids);
    EXPECT_GT((plain - out).abs().max().item<double>(), 1e-3);
    // What sits at a masked position cannot reach the image tokens.
    at::Tensor changed = encoder.clone();
    changed.index_put_({mask == 0}, at::randn({(mask == 0).sum().item<int64_t>(), encoder.size(2)}) * 10);
    const at::Tensor again = model->forward(hidden, changed, pooled, t, guidance, img_ids, txt_ids, mask);
    EXPECT_LE((again - out).abs().max().item<double>(), 1e-6);
    // A one-row mask applies to every sample; a mask of the wrong length is refused.
    const at::Tensor row = mask.narrow(0, 0, 1);
    EXPECT_TRUE(at::allclose(
        model->forward(hidden, encoder, pooled, t, guidance, img_ids, txt_ids, row),
        model->forward(hidden, encoder, pooled, t, guidance, img_ids, txt_ids, row.expand({2, 5})), 1e-6,
        1e-7));
    EXPECT_THROW(model->forward(hidden, encoder, pooled, t, guidance, img_ids, txt_ids, at::ones({2, 4})),
                 UsageError);
}

// With a frozen base (LoRA elsewhere) the stacked weights are kept between calls: an in-place change
// of a frozen weight (a new version) must still be seen.
TEST(FluxTrainingKeys, FusedQkvGivesTheSameOutputsAndGradients) {
    const io::SafetensorsFile io(kRef / "flux_transformer_io.safetensors");
    const auto run = [&](bool fused, bool lora) {
        auto model = models::load_flux_transformer(kRef / "tiny-flux-dev");
        std::optional<models::LoRAAdapters> adapters;
        if (lora) {  // the text stream's projections: the image stream's q/k/v stay frozen and plain
            models::LoRAConfig lc;
            lc.rank = 2;
            lc.init_seed = 3;
            lc.target_modules = flux_lora_target_modules("context");
            adapters.emplace(models::inject_lora(*model, lc));
            at::NoGradGuard no_grad;
            at::Generator g = at::detail::createCPUGenerator(7);         // the same adapters in both runs
            for (auto p : adapters->parameters()) p.normal_(0, 0.1, g);  // non-zero up factors matter
        }
        model->set_fused_qkv(fused);
        const auto forward = [&] {
            return model->forward(fixture(io, "hidden"), fixture(io, "encoder"), fixture(io, "pooled"),
                                  fixture(io, "timestep"), fixture(io, "guidance"), fixture(io, "img_ids"),
                                  fixture(io, "txt_ids"), fixture(io, "encoder").select(2, 0).gt(0));
        };
        if (lora) {
            at::NoGradGuard no_grad;
            (void)forward();  // stacks the frozen weights
            model->named_parameters()["single_transformer_blocks.1.attn.to_k.weight"].mul_(1.5);
        }
        const at::Tensor out = forward();
        out.pow(2).mean().backward();
        std::vector<at::Tensor> grads;
        for (const auto& p : model->parameters())
            if (p.requires_grad()) grads.push_back(p.grad().defined() ? p.grad() : at::zeros_like(p));
        return std::make_pair(out.detach(), grads);
    };
    for (const bool lora : {false, true}) {
        SCOPED_TRACE(lora ? "LoRA (frozen q/k/v)" : "full (trained q/k/v)");
        const auto [plain, plain_grads] = run(false, lora);
        const auto [fused, fused_grads] = run(true, lora);
        EXPECT_LE((fused - plain).abs().max().item<double>(), 1e-5 * plain.abs().max().item<double>());
        ASSERT_EQ(fused_grads.size(), plain_grads.size());
        for (size_t i = 0; i < plain_grads.size(); ++i)
            EXPECT_LE((fused_grads[i] - plain_grads[i]).abs().max().item<double>(),
                      1e-5 * plain_grads[i].abs().max().item<double>() + 1e-10)
                << "gradient " << i;
    }
}

train::TrainConfig flux_config(const std::vector<std::string>& words) {
    std::vector<std::string> all = {"--model_family", "flux"};
    all.insert(all.end(), words.begin(), words.end());
    return train::TrainConfig::load({}, all);
}

TEST(FluxTrainingKeys, ApplyTrainingConfigSetsTheObjectiveAndTheDenoiser) {
    const auto dir = kRef / "tiny-flux-pipeline";
    {  // defaults: SimpleTuner's
        TrainingObjective o = flux_family().training_objective(dir);
        auto denoiser = flux_family().load_denoiser(dir / "transformer", {});
        flux_family().apply_training_config(flux_config({}), *denoiser, o);
        EXPECT_EQ(diffusion::flow_sigma_schedule(o.flow), diffusion::FlowSigmaSchedule::kLogitNormal);
        EXPECT_EQ(o.flow.shift, std::optional<double>(3.0));
        EXPECT_FALSE(o.flow.auto_shift);
        ASSERT_TRUE(o.flow.guidance.has_value());
        EXPECT_EQ(o.flow.guidance->mode, diffusion::EmbeddedGuidanceOptions::Mode::kConstant);
        EXPECT_EQ(o.flow.guidance->value, 1.0);
    }
    TrainingObjective o = flux_family().training_objective(dir);
    auto denoiser = flux_family().load_denoiser(dir / "transformer", {});
    flux_family().apply_training_config(
        flux_config({"--flow_schedule_auto_shift", "true", "--flow_use_beta_schedule", "true",
                     "--flow_beta_schedule_alpha", "1.5", "--flow_beta_schedule_beta", "2.5",
                     "--flow_sigmoid_scale", "0.8", "--flux_guidance_mode", "random-range",
                     "--flux_guidance_min", "2", "--flux_guidance_max", "5",
                     "--flux_attention_masked_training", "true"}),
        *denoiser, o);
    EXPECT_EQ(diffusion::flow_sigma_schedule(o.flow), diffusion::FlowSigmaSchedule::kBeta);
    EXPECT_TRUE(o.flow.auto_shift);
    EXPECT_EQ(o.flow.beta_alpha, 1.5);
    EXPECT_EQ(o.flow.beta_beta, 2.5);
    EXPECT_EQ(o.flow.sigmoid_scale, 0.8);
    EXPECT_EQ(o.flow.guidance->mode, diffusion::EmbeddedGuidanceOptions::Mode::kRandomRange);
    EXPECT_EQ(o.flow.guidance->min, 2.0);
    EXPECT_EQ(o.flow.guidance->max, 5.0);
    // The denoiser now applies the cached T5 mask: padded prompt positions stop mattering.
    at::NoGradGuard no_grad;
    const int64_t l = 6;
    const at::Tensor mask = at::tensor({1, 1, 0, 0, 0, 0}, at::kLong).expand({2, l}).contiguous();
    const at::Tensor embeds = at::randn({2, l, 24});
    at::Tensor changed = embeds.clone();
    changed.narrow(1, 2, l - 2).normal_(0, 5);  // only the padded positions
    Conditioning cond{{"prompt_embeds", embeds},
                      {"pooled_prompt_embeds", at::randn({2, 32})},
                      {"attention_mask", mask},
                      {"guidance", at::full({2}, 3.0)}};
    const at::Tensor noisy = at::randn({2, 16, 4, 4});
    const at::Tensor t = at::full({2}, 500.0);
    const auto twice = [&](Denoiser& d) {
        cond["prompt_embeds"] = embeds;
        const at::Tensor first = d.forward(noisy, t, cond);
        cond["prompt_embeds"] = changed;
        return (d.forward(noisy, t, cond) - first).abs().max().item<double>();
    };
    EXPECT_LE(twice(*denoiser), 1e-6);
    // An unmasked denoiser (the default) sees them.
    auto plain = flux_family().load_denoiser(dir / "transformer", {});
    TrainingObjective unused = flux_family().training_objective(dir);
    flux_family().apply_training_config(flux_config({}), *plain, unused);
    EXPECT_GT(twice(*plain), 1e-4);
}

}  // namespace
}  // namespace test_flux_training_keys_local
}  // namespace dtune::family
