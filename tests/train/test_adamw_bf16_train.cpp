// adamw_bf16 through the trainer (tiny SDXL fixture, bf16 weights, CPU): a full fine-tune of 2 steps
// equals 1 step, a checkpoint (optimizer.safetensors + the optimizer generator's state) and a
// resume for 1 more, bit for bit (bf16 compute on the CPU is slow, so the run is kept short); and the
// checkpoint's optimizer file has adamw_bf16's per-parameter layout.
#include <gtest/gtest.h>

#include "io/safetensors.h"
#include "trainer_test_util.h"

namespace dtune::train {
namespace test_adamw_bf16_train_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

io::TensorList train_bf16(const std::filesystem::path& out, int64_t steps, TrainResult* result = nullptr) {
    const TrainConfig config = testutil::tiny_config(out, steps,
                                                     {{"optimizer", "adamw_bf16"},
                                                      {"model_type", "full"},
                                                      {"learning_rate", 1e-3},
                                                      {"checkpoint_step_interval", 1}});
    models::UNet2DConditionModel unet = testutil::tiny_unet();
    unet->to(at::kBFloat16);  // what Trainer's own loading does for adamw_bf16
    Trainer trainer(config, testutil::sdxl_model(unet), testutil::tiny_schedule(), testutil::synthetic());
    const TrainResult r = trainer.run();
    if (result) *result = r;
    return models::state_dict(*testutil::unet_of(trainer));
}

TEST(AdamWBF16Train, FullFineTuneResumesBitExactly) {
    test::TempDir straight, split;
    const io::TensorList a = train_bf16(straight.path(), 2);
    TrainResult second;
    train_bf16(split.path(), 1);
    const io::TensorList b = train_bf16(split.path(), 2, &second);
    ASSERT_TRUE(second.resumed_from.has_value());
    ASSERT_EQ(a.size(), b.size());
    int64_t differing = 0, changed = 0;
    const io::TensorList base = models::state_dict(*testutil::tiny_unet());
    for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i].second.scalar_type(), at::kBFloat16) << a[i].first;
        differing += at::equal(a[i].second, b[i].second) ? 0 : 1;
        changed += at::equal(a[i].second, base[i].second.to(at::kBFloat16)) ? 0 : 1;
    }
    EXPECT_EQ(differing, 0);
    EXPECT_GT(changed, static_cast<int64_t>(a.size()) / 2);  // the comparison is not vacuous

    const io::SafetensorsFile opt(*second.resumed_from / "optimizer.safetensors");
    const std::string name = "unet." + a.front().first;
    for (const char* key : {".exp_avg", ".exp_avg_sq", ".shift", ".step", ".accumulated_decay"})
        EXPECT_TRUE(opt.contains(name + key) || opt.contains(a.front().first + key)) << name << key;
}

}  // namespace
}  // namespace test_adamw_bf16_train_local
}  // namespace dtune::train
