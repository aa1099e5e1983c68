// The tiny-fixture trainer the report tests share: the fixture's UNet and scheduler, synthetic
// batches, and a deterministic config with validation every 2 of 4 steps at 64x64.
#pragma once

#include <memory>

#include "core/fs.h"
#include "diffusion/noise_schedule.h"
#include "family/sdxl/sdxl_family.h"
#include "models/unet/unet_2d_condition.h"
#include "support/test_support.h"
#include "train/trainer.h"

namespace dtune::report::testutil {

inline std::filesystem::path tiny_model() {
    return test::fixtures_dir() / "tiny-sdxl";
}

inline diffusion::NoiseSchedule tiny_schedule() {
    const auto j = nlohmann::json::parse(fs::read_file(tiny_model() / "scheduler" / "scheduler_config.json"));
    return diffusion::NoiseSchedule(diffusion::NoiseScheduleConfig::from_json(j, "tiny scheduler"));
}

inline train::TrainConfig config(const std::filesystem::path& out,
                                 const nlohmann::json& extra = nlohmann::json::object()) {
    train::TrainConfig c;
    c.merge_json(nlohmann::json{{"model_family", "sdxl"},
                                {"output_dir", out.string()},
                                {"pretrained_model_name_or_path", tiny_model().string()},
                                {"optimizer", "torch-adamw"},
                                {"learning_rate", 1e-3},
                                {"lr_scheduler", "constant"},
                                {"train_batch_size", 2},
                                {"max_train_steps", 4},
                                {"checkpoint_step_interval", 2},
                                {"mixed_precision", "no"},
                                {"gradient_checkpointing", false},
                                {"deterministic", true},
                                {"seed", 99},
                                {"validation_step_interval", 2},
                                {"validation_resolution", "64x64"},
                                {"validation_num_inference_steps", 2},
                                {"validation_seed", 7}},
                 "test");
    c.merge_json(extra, "test extra");
    c.validate();
    return c;
}

// The trainer's network as the UNet it is (an SDXL run).
inline models::UNet2DConditionModel unet_of(train::Trainer& trainer) {
    return models::UNet2DConditionModel(
        std::dynamic_pointer_cast<models::UNet2DConditionModelImpl>(trainer.model().module_ptr()));
}

inline std::unique_ptr<train::Trainer> make_trainer(const train::TrainConfig& c) {
    train::SyntheticBatchOptions o;
    o.batch_size = 2;
    o.dim = 64;
    o.pooled_dim = 32;
    return std::make_unique<train::Trainer>(
        c, family::sdxl_family().wrap_denoiser(models::load_unet(tiny_model() / "unet").ptr()),
        tiny_schedule(), std::make_unique<train::SyntheticBatchSource>(o));
}

}  // namespace dtune::report::testutil
