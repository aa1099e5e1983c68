// Shared setup for the trainer tests on the tiny SDXL fixture (CPU): the UNet, its noise schedule,
// a deterministic config and a synthetic batch source.
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <memory>
#include <string>

#include "core/fs.h"
#include "family/sdxl/sdxl_family.h"
#include "models/common/weights.h"
#include "models/unet/unet_2d_condition.h"
#include "support/test_support.h"
#include "train/trainer.h"

namespace dtune::train::testutil {

inline std::filesystem::path tiny_model() {
    return test::fixtures_dir() / "tiny-sdxl";
}

inline models::UNet2DConditionModel tiny_unet() {
    return models::load_unet(tiny_model() / "unet");
}

// A UNet as the SDXL family's trained network (what Trainer and the step take).
inline std::unique_ptr<family::Denoiser> sdxl_model(const models::UNet2DConditionModel& unet) {
    return family::sdxl_family().wrap_denoiser(unet.ptr());
}

// The trainer's network as the UNet it is (an SDXL run).
inline models::UNet2DConditionModel unet_of(Trainer& trainer) {
    return models::UNet2DConditionModel(
        std::dynamic_pointer_cast<models::UNet2DConditionModelImpl>(trainer.model().module_ptr()));
}

inline diffusion::NoiseSchedule tiny_schedule() {
    const auto j = nlohmann::json::parse(fs::read_file(tiny_model() / "scheduler" / "scheduler_config.json"));
    return diffusion::NoiseSchedule(diffusion::NoiseScheduleConfig::from_json(j, "tiny scheduler"));
}

// Deterministic CPU config: AdamW, constant LR 1e-3, batch 2, a checkpoint every 2 steps.
inline TrainConfig tiny_config(const std::filesystem::path& out, int64_t steps,
                               const nlohmann::json& extra = {}) {
    TrainConfig c;
    c.merge_json(nlohmann::json{{"model_family", "sdxl"},
                                {"output_dir", out.string()},
                                {"optimizer", "torch-adamw"},
                                {"learning_rate", 1e-3},
                                {"lr_scheduler", "constant"},
                                {"train_batch_size", 2},
                                {"max_train_steps", steps},
                                {"checkpoint_step_interval", 2},
                                {"mixed_precision", "no"},
                                {"gradient_checkpointing", false},
                                {"deterministic", true},
                                {"seed", 1234},
                                {"caption_dropout_probability", 0.25},
                                {"metrics_interval", 1}},
                 "test");
    if (!extra.is_null()) c.merge_json(extra, "test extra");
    c.validate();
    return c;
}

// Synthetic batches of the tiny UNet's shapes: 8 x 8 latents, a 64-wide context (its
// cross_attention_dim) and a 32-wide pooled embedding.
inline SyntheticBatchOptions tiny_batch_options(int64_t batch_size) {
    SyntheticBatchOptions o;
    o.batch_size = batch_size;
    o.latent_size = 8;
    o.dim = 64;
    o.pooled_dim = 32;
    return o;
}

inline std::unique_ptr<BatchSource> synthetic() {
    return std::make_unique<SyntheticBatchSource>(tiny_batch_options(2));
}

// Rows [first, first + count) of a batch's latents and conditioning: what one data-parallel rank
// trains on.
inline TrainBatch batch_rows(const TrainBatch& batch, int64_t first, int64_t count) {
    TrainBatch out;
    out.latents = batch.latents.narrow(0, first, count);
    for (const auto& [name, c] : batch.cond) out.cond[name] = c.narrow(0, first, count);
    return out;
}

// One such batch, drawn with a CPU generator seeded 5.
inline TrainBatch tiny_batch(int64_t batch_size) {
    SyntheticBatchSource source(tiny_batch_options(batch_size));
    auto gen = at::detail::createCPUGenerator(5);
    return source.next(gen);
}

inline std::unique_ptr<Trainer> make_trainer(const TrainConfig& config) {
    return std::make_unique<Trainer>(config, sdxl_model(tiny_unet()), tiny_schedule(), synthetic());
}

}  // namespace dtune::train::testutil
