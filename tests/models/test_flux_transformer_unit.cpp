// FluxTransformer2DModel against diffusers: tools/ref/gen_flux_transformer_ref.py saved two tiny
// random transformers as diffusers folders ([dev]-like with the guidance embedding,
// [schnell]-like without; tests/data/ref/tiny-flux-*) and what diffusers computes for fixed inputs
// (flux_transformer_io.safetensors). Both must load strictly and match in float32; FluxPipeline's
// 2×2 packing and image ids must match too; bad inputs are refused with the fix.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <cstdlib>

#include "core/error.h"
#include "core/quant_preset.h"
#include "model_test_util.h"
#include "models/adapters/lora.h"
#include "models/common/config_json.h"
#include "models/common/gelu_mlp.h"
#include "models/common/quantize.h"
#include "models/flux/flux_transformer.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_flux_transformer_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

const std::filesystem::path kRef = std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref";

TEST(FluxTransformer, DevAndSchnellMatchDiffusers) {
    const io::SafetensorsFile io(kRef / "flux_transformer_io.safetensors");
    const auto get = [&](const char* n) { return test::fixture_tensor(io, n); };
    torch::NoGradGuard no_grad;
    for (const std::string name : {"dev", "schnell"}) {
        SCOPED_TRACE(name);
        FluxTransformer2DModel model = load_flux_transformer(kRef / ("tiny-flux-" + name));
        EXPECT_EQ(model->config().guidance_embeds, name == "dev");
        const at::Tensor out =
            model->forward(get("hidden"), get("encoder"), get("pooled"), get("timestep"),
                           name == "dev" ? get("guidance") : at::Tensor(), get("img_ids"), get("txt_ids"));
        const at::Tensor want = get((name + "_out").c_str());
        ASSERT_EQ(out.sizes(), want.sizes());
        EXPECT_LE(test::reported_diff(name, out, want), 1e-5 * want.abs().max().item<double>());
    }
}

// gradient_checkpointing recomputes blocks in backward (all but the last): the output and the input's
// gradient equal the plain run's bit for bit (the same ops on the same values), and every parameter's
// gradient equals it to float32 rounding (the time embedding feeds every block, and its gradient sums the
// blocks' contributions in another order), for every block and for every other block (interval 2,
// checkpointed and plain blocks mixed).
TEST(FluxTransformer, GradientCheckpointingKeepsGradientsExactly) {
    const io::SafetensorsFile io(kRef / "flux_transformer_io.safetensors");
    const auto get = [&](const char* n) { return test::fixture_tensor(io, n); };
    const auto run = [&](bool checkpointing, int64_t interval) {
        FluxTransformer2DModel model = load_flux_transformer(kRef / "tiny-flux-dev");
        model->set_gradient_checkpointing(checkpointing, interval);
        const at::Tensor x = get("hidden").clone().requires_grad_(true);
        const at::Tensor out = model->forward(x, get("encoder"), get("pooled"), get("timestep"),
                                              get("guidance"), get("img_ids"), get("txt_ids"));
        out.pow(2).mean().backward();
        std::vector<at::Tensor> grads{x.grad()};
        for (const auto& p : model->parameters())
            grads.push_back(p.grad().defined() ? p.grad() : at::zeros_like(p));
        return std::make_tuple(out.detach(), grads, model->checkpointed_blocks());
    };
    const auto [plain_out, plain_grads, none] = run(false, 1);
    EXPECT_EQ(none, (std::pair<int64_t, int64_t>{0, 4}));
    for (const int64_t interval : {1, 2}) {
        SCOPED_TRACE(interval);
        const auto [out, grads, taken] = run(true, interval);
        // every block but the last (whose backward follows the forward at once), or blocks 0 and 2
        EXPECT_EQ(taken, (std::pair<int64_t, int64_t>{interval == 1 ? 3 : 2, 4}));
        EXPECT_TRUE(at::equal(out, plain_out));
        ASSERT_EQ(grads.size(), plain_grads.size());
        EXPECT_TRUE(at::equal(grads[0], plain_grads[0]));
        for (size_t i = 1; i < grads.size(); ++i)
            EXPECT_LE((grads[i] - plain_grads[i]).abs().max().item<double>(),
                      1e-5 * plain_grads[i].abs().max().item<double>() + 1e-12)
                << "tensor " << i;
    }
}

// LoRA training with gradient checkpointing (frozen base, SimpleTuner's "all" targets, lora_dropout
// 0.1): the recomputation leaves every MLP output projection out (both streams' ff in the two
// double blocks, the first single block's proj_out; the last single block is not checkpointed), and
// the output and every adapter gradient equal the plain run's, with a dense and an int8 base.
TEST(FluxTransformer, CheckpointedLoRALeavesTheMlpOutputsOutAndKeepsTheGradients) {
    const io::SafetensorsFile io(kRef / "flux_transformer_io.safetensors");
    const auto get = [&](const char* n) { return test::fixture_tensor(io, n); };
    struct Run {
        at::Tensor out;
        std::vector<at::Tensor> grads;
        int64_t unread = 0;
    };
    for (const std::string preset : {"no_change", "int8-quanto"}) {
        SCOPED_TRACE(preset);
        const auto run = [&](bool checkpointing) {
            FluxTransformer2DModel model = load_flux_transformer(kRef / "tiny-flux-dev");
            const QuantizeReport q =
                quantize_module(*model, parse_quant_preset(preset, "base_model_precision"));
            EXPECT_EQ(q.layers > 0, preset != "no_change");
            LoRAConfig c;
            c.rank = 4;
            c.alpha = 4;
            c.dropout = 0.1;
            c.target_modules = {"to_k",       "to_q",       "to_v",     "add_k_proj",
                                "add_q_proj", "add_v_proj", "to_out.0", "to_add_out"};
            LoRAAdapters adapters = inject_lora(*model, c);
            {
                torch::NoGradGuard no_grad;
                auto gen = at::detail::createCPUGenerator(17);
                for (auto& t : adapters.parameters()) t.copy_(at::randn(t.sizes(), gen) * 0.1);
            }
            model->train();
            adapters.set_dropout_seed(3);
            model->set_gradient_checkpointing(checkpointing);
            const int64_t before = gelu_mlp_unread_projections();
            Run r;
            r.out = model->forward(get("hidden"), get("encoder"), get("pooled"), get("timestep"),
                                   get("guidance"), get("img_ids"), get("txt_ids"));
            r.out.pow(2).mean().backward();
            r.unread = gelu_mlp_unread_projections() - before;
            for (const auto& t : adapters.parameters()) r.grads.push_back(t.grad());
            r.out = r.out.detach();
            return r;
        };
        const Run plain = run(false), checkpointed = run(true);
        EXPECT_EQ(plain.unread, 0);
        EXPECT_EQ(checkpointed.unread, 5);
        EXPECT_TRUE(at::equal(checkpointed.out, plain.out));
        ASSERT_EQ(checkpointed.grads.size(), plain.grads.size());
        for (size_t i = 0; i < plain.grads.size(); ++i) {
            ASSERT_TRUE(plain.grads[i].defined() && checkpointed.grads[i].defined())
                << "adapter tensor " << i;
            EXPECT_GT(plain.grads[i].abs().max().item<double>(), 0.0) << "adapter tensor " << i;
            EXPECT_LE((checkpointed.grads[i] - plain.grads[i]).abs().max().item<double>(),
                      1e-5 * plain.grads[i].abs().max().item<double>())
                << "adapter tensor " << i;
        }
    }
}

TEST(FluxTransformer, PackingAndImageIdsMatchFluxPipeline) {
    const io::SafetensorsFile io(kRef / "flux_transformer_io.safetensors");
    const at::Tensor latents = test::fixture_tensor(io, "latents");  // [2, 4, 6, 8]
    const at::Tensor packed = flux_pack_latents(latents);
    EXPECT_TRUE(at::equal(packed, test::fixture_tensor(io, "packed")));
    EXPECT_TRUE(at::equal(flux_unpack_latents(packed, 6, 8), latents));
    EXPECT_TRUE(at::equal(flux_image_ids(6, 8), test::fixture_tensor(io, "img_ids")));
    EXPECT_THROW(flux_pack_latents(at::zeros({1, 4, 5, 8})), UsageError);
}

TEST(FluxTransformer, RefusesMissingGuidanceAndBadShapesNamingTheFix) {
    const io::SafetensorsFile io(kRef / "flux_transformer_io.safetensors");
    const auto get = [&](const char* n) { return test::fixture_tensor(io, n); };
    FluxTransformer2DModel model = load_flux_transformer(kRef / "tiny-flux-dev");
    torch::NoGradGuard no_grad;
    try {
        model->forward(get("hidden"), get("encoder"), get("pooled"), get("timestep"), {}, get("img_ids"),
                       get("txt_ids"));
        FAIL() << "no error without guidance";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("pass guidance"), std::string::npos) << e.what();
    }
    EXPECT_THROW(model->forward(at::zeros({2, 12, 8}), get("encoder"), get("pooled"), get("timestep"),
                                get("guidance"), get("img_ids"), get("txt_ids")),
                 UsageError);
}

// DTUNE_ATTENTION_STASH_GIB: a size in GiB (0 turns the stash off), a bad value a UsageError that
// names the variable; unset, a sixteenth of the machine's memory divided among LOCAL_WORLD_SIZE
// ranks. A CPU model recomputes (the stash is for CUDA): nothing saved.
TEST(FluxTransformer, AttentionStashBudgetComesFromTheEnvironment) {
    struct Restore {
        ~Restore() {
            ::unsetenv("DTUNE_ATTENTION_STASH_GIB");
            ::unsetenv("LOCAL_WORLD_SIZE");
        }
    } restore;
    ::unsetenv("DTUNE_ATTENTION_STASH_GIB");
    ::unsetenv("LOCAL_WORLD_SIZE");
    const int64_t machine = AttentionStash::budget_from_environment();
    EXPECT_GT(machine, 0);
    ::setenv("LOCAL_WORLD_SIZE", "4", 1);  // four ranks on the node share the default
    EXPECT_EQ(AttentionStash::budget_from_environment(), machine / 4);
    ::unsetenv("LOCAL_WORLD_SIZE");
    ::setenv("DTUNE_ATTENTION_STASH_GIB", "1.5", 1);
    EXPECT_EQ(AttentionStash::budget_from_environment(), int64_t{3} << 29);
    ::setenv("DTUNE_ATTENTION_STASH_GIB", "0", 1);
    EXPECT_EQ(AttentionStash::budget_from_environment(), 0);
    for (const char* bad : {"lots", "-1", "2GB"}) {
        ::setenv("DTUNE_ATTENTION_STASH_GIB", bad, 1);
        try {
            (void)AttentionStash::budget_from_environment();
            FAIL() << bad << " was taken";
        } catch (const UsageError& e) {
            EXPECT_NE(std::string(e.what()).find("DTUNE_ATTENTION_STASH_GIB"), std::string::npos) << e.what();
        }
    }
    ::unsetenv("DTUNE_ATTENTION_STASH_GIB");
    FluxTransformer2DModel model = load_flux_transformer(kRef / "tiny-flux-dev");
    model->set_gradient_checkpointing(true);
    const io::SafetensorsFile io(kRef / "flux_transformer_io.safetensors");
    const auto get = [&](const char* n) { return test::fixture_tensor(io, n); };
    model
        ->forward(get("hidden"), get("encoder"), get("pooled"), get("timestep"), get("guidance"),
                  get("img_ids"), get("txt_ids"))
        .sum()
        .backward();
    EXPECT_EQ(model->attention_stash().saved(), 0);
    EXPECT_EQ(model->attention_stash().host_bytes(), 0);
}

// In bf16 the timestep itself rounds (0.3 -> 0.30078, so the sinusoids move), as in diffusers: the
// reference is diffusers' own bf16 forward.
TEST(FluxTransformer, Bf16MatchesDiffusersBf16) {
    const io::SafetensorsFile io(kRef / "flux_transformer_io.safetensors");
    const auto get = [&](const char* n) { return test::fixture_tensor(io, n); };
    ComponentLoadOptions bf16;
    bf16.dtype = at::kBFloat16;
    FluxTransformer2DModel model = load_flux_transformer(kRef / "tiny-flux-dev", bf16);
    torch::NoGradGuard no_grad;
    const at::Tensor out = model->forward(get("hidden"), get("encoder"), get("pooled"), get("timestep"),
                                          get("guidance"), get("img_ids"), get("txt_ids"));
    EXPECT_EQ(out.scalar_type(), at::kBFloat16);
    const at::Tensor want = get("dev_out_bf16");
    EXPECT_LE(test::reported_diff("bf16", out.to(at::kFloat), want), 0.02 * want.abs().max().item<double>());
}

// Black Forest Labs' single-file layout (flux1-dev.safetensors): the same tiny [dev] weights with
// fused q/k/v and linear1 and BFL's final-AdaLN order give diffusers' output; ComfyUI's prefixed fp8
// file loads to float32 and gives the output of the fp8-rounded weights. The tiny head size is not
// FLUX.1's, so the config comes from the diffusers folder; without it the file is refused saying so.
TEST(FluxTransformer, BlackForestLabsSingleFilesLoad) {
    const io::SafetensorsFile io(kRef / "flux_transformer_io.safetensors");
    const auto get = [&](const char* n) { return test::fixture_tensor(io, n); };
    torch::NoGradGuard no_grad;
    for (const auto& [file, want_name] :
         {std::pair<std::string, const char*>{"tiny-flux-dev-bfl.safetensors", "dev_out"},
          {"tiny-flux-dev-comfy-fp8.safetensors", "dev_out_fp8"}}) {
        SCOPED_TRACE(file);
        ComponentLoadOptions o;
        o.single_file = kRef / file;
        o.config = ConfigReader::from_file(kRef / "tiny-flux-dev" / "config.json");
        FluxTransformer2DModel model = load_flux_transformer({}, o);
        const at::Tensor out = model->forward(get("hidden"), get("encoder"), get("pooled"), get("timestep"),
                                              get("guidance"), get("img_ids"), get("txt_ids"));
        const at::Tensor want = get(want_name);
        EXPECT_LE(test::reported_diff(file, out, want), 1e-5 * want.abs().max().item<double>());
    }
    ComponentLoadOptions bare;
    bare.single_file = kRef / "tiny-flux-dev-bfl.safetensors";
    try {
        load_flux_transformer({}, bare);
        FAIL() << "a head size other than FLUX.1's was accepted without a config";
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("not FLUX.1's 128"), std::string::npos) << e.what();
    }
    ComponentLoadOptions wrong;
    wrong.single_file = kRef / "quant_io.safetensors";  // not a Flux file
    EXPECT_THROW(load_flux_transformer({}, wrong), DataError);
}

}  // namespace
}  // namespace test_flux_transformer_unit_local
}  // namespace dtune::models
