// The flow-matching eval loss against SimpleTuner's evaluation pass rebuilt from diffusers
// (tools/ref/gen_flux_eval_loss_ref.py -> tests/data/ref/flux_eval_loss_ref.safetensors): the fixed
// timesteps of the tiny Flux pipeline's scheduler (dynamic shift from each image's size, and a
// static shift with SimpleTuner's pinned bounds), and the mean MSE of its transformer over two
// samples × three timesteps with the seed-0 noise.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "core/error.h"
#include "family/flux/flux_family.h"
#include "family/model_family.h"
#include "io/safetensors.h"
#include "models/flux/flux_transformer.h"
#include "report/eval_loss.h"

namespace dtune::report {
namespace test_eval_loss_flow_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

const std::filesystem::path kRef = std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref";

std::vector<EvalSample> ref_samples(const io::SafetensorsFile& ref) {
    std::vector<EvalSample> out;
    for (int i = 0; i < 2; ++i) {
        const std::string p = "s" + std::to_string(i) + ".";
        EvalSample s;
        s.latents = ref.get(p + "latents").clone();
        s.cond["prompt_embeds"] = ref.get(p + "prompt_embeds").clone();
        s.cond["pooled_prompt_embeds"] = ref.get(p + "pooled_prompt_embeds").clone();
        out.push_back(std::move(s));
    }
    return out;
}

TEST(EvalLossFlow, FixedTimestepsAndLossMatchSimpleTunersEvalPass) {
    const io::SafetensorsFile ref(kRef / "flux_eval_loss_ref.safetensors");
    // Through the family layer: Flux's objective carries the folder's scheduler config.
    const family::TrainingObjective objective =
        family::flux_family().training_objective(kRef / "tiny-flux-pipeline");
    ASSERT_TRUE(objective.flow_matching());
    const diffusion::FlowMatchConfig scheduler = flow_eval_scheduler(objective);
    ASSERT_TRUE(scheduler.use_dynamic_shifting);
    const auto samples = ref_samples(ref);
    for (int i = 0; i < 2; ++i) {
        const at::Tensor expected = ref.get("s" + std::to_string(i) + ".timesteps");
        const int64_t seq = (samples[i].latents.size(2) / 2) * (samples[i].latents.size(3) / 2);
        const auto ts = flow_eval_timesteps(scheduler, 3, seq);
        ASSERT_EQ(ts.size(), 3u);
        for (int k = 0; k < 3; ++k) EXPECT_FLOAT_EQ(ts[k], expected[k].item<float>()) << "sample " << i;
    }
    // schnell's case: a static shift (flow_schedule_shift 3), sigma_min pinned to 1/T.
    diffusion::FlowMatchConfig fixed = scheduler;
    fixed.use_dynamic_shifting = false;
    const at::Tensor expected_static = ref.get("static_timesteps");
    const auto ts_static = flow_eval_timesteps(fixed, 4, 16);
    for (int k = 0; k < 4; ++k) EXPECT_FLOAT_EQ(ts_static[k], expected_static[k].item<float>());

    auto transformer = models::load_flux_transformer(kRef / "tiny-flux-pipeline" / "transformer");
    transformer->train();
    auto denoiser = family::flux_family().wrap_denoiser(transformer.ptr());
    const double loss = flow_eval_loss(*denoiser, scheduler, samples, 3);
    const double expected = ref.get("loss").item<double>();
    EXPECT_NEAR(loss, expected, 1e-5 * expected);
    // One sample alone: the mean of its three reference losses.
    const double one = flow_eval_loss(*denoiser, scheduler, {samples[1]}, 3);
    EXPECT_NEAR(one, ref.get("s1.losses").mean().item<double>(), 1e-5 * expected);

    (void)at::randn({100});  // the global generator moves; the eval draws from its own
    EXPECT_EQ(flow_eval_loss(*denoiser, scheduler, samples, 3), loss) << "the eval loss must repeat exactly";
    EXPECT_TRUE(transformer->is_training()) << "the eval pass restores training mode";
    {
        at::NoGradGuard g;
        for (auto& p : transformer->parameters()) p.mul_(0.9);
    }
    EXPECT_NE(flow_eval_loss(*denoiser, scheduler, samples, 3), loss) << "other weights, another loss";
}

TEST(EvalLossFlow, ShiftComesFromTheRunAndAMissingSchedulerIsRefused) {
    family::TrainingObjective objective =
        family::flux_family().training_objective(kRef / "tiny-flux-pipeline");
    objective.flow.shift = 1.5;  // flow_schedule_shift replaces the folder's 3.0, as SimpleTuner loads it
    EXPECT_DOUBLE_EQ(flow_eval_scheduler(objective).shift, 1.5);
    // With flow_schedule_auto_shift SimpleTuner zeroes the static shift: the folder's (3.0) stays.
    objective.flow.auto_shift = true;
    EXPECT_DOUBLE_EQ(flow_eval_scheduler(objective).shift, objective.flow_scheduler->shift);
    EXPECT_NE(flow_eval_scheduler(objective).shift, 1.5);
    objective.flow.auto_shift = false;
    objective.flow_scheduler.reset();
    try {
        (void)flow_eval_scheduler(objective);
        ADD_FAILURE() << "a flow objective without a scheduler config must be refused";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("eval_loss_disable"), std::string::npos) << e.what();
    }
}

}  // namespace
}  // namespace test_eval_loss_flow_local
}  // namespace dtune::report
