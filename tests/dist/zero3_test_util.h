// Shared by the ZeRO-3 tests under `dtune launch` (zero3_multi_test.cpp, zero3_lora_multi_test.cpp):
// the six-image workspace, copying a checkpoint to resume from, and the validation-image check.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "core/fs.h"
#include "dist/train_launch_util.h"
#include "support/tiny_flux_data.h"

namespace dtune {

// 6 of the workspace's 8 images: one batch of 6 per epoch, which 1, 2 and 3 ranks split evenly, so
// the runs stay one step per epoch (DistTrain.ThreeRanksEqualOneProcess... covers 8 on 3).
inline void keep_six_images(const Workspace& w) {
    for (const char* f : {"sample 6.png", "sample 7.png"}) std::filesystem::remove(w.dir / "images" / f);
}

// Puts `from`'s checkpoint-2 into `to`, for a run there to resume from it.
inline void resume_into(const std::filesystem::path& from, const std::filesystem::path& to) {
    std::filesystem::create_directories(to);
    std::filesystem::copy(from / "checkpoint-2", to / "checkpoint-2",
                          std::filesystem::copy_options::recursive);
}

// Trains `args` (2 steps, validation every step) on 2 ranks of plain data parallelism and with
// zero_stage 3: the validation images of steps 0-2 must be byte-identical (the sharded run
// validates with the whole weights gathered).
inline void expect_zero3_validation_equals_plain(const Workspace& w, const std::string& args) {
    const auto plain = run_shell(w.train(2, "plain", args));
    ASSERT_EQ(plain.exit_code, 0) << plain.output;
    const auto zero = run_shell(w.train(2, "zero3", args + " --zero_stage 3"));
    ASSERT_EQ(zero.exit_code, 0) << zero.output;
    for (const char* f : {"step_0_validation_0_64x64.png", "step_1_validation_0_64x64.png",
                          "step_2_validation_0_64x64.png"}) {
        const auto a = w.out("plain") / "validation_images" / f, b = w.out("zero3") / "validation_images" / f;
        ASSERT_TRUE(std::filesystem::exists(b)) << f << "\n" << zero.output;
        EXPECT_EQ(fs::read_file(a), fs::read_file(b)) << f;
    }
}

// The tiny Flux pipeline (transformer + tiny Flux VAE + the tiny SDXL CLIP, support/tiny_flux_data.h)
// in a workspace of 4 images with a `dtune train` config: SGD, deterministic, CPU, a checkpoint
// every 2 steps; `keys` adds to it or overrides it (model_type, lora_rank).
struct FluxWorkspace {
    test::TempDir dir;
    std::filesystem::path model;
    std::filesystem::path config = dir / "config.json";

    explicit FluxWorkspace(const nlohmann::json& keys) {
        const test::TinyFluxData data =
            test::write_tiny_flux_data(dir.path(), std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref");
        model = data.model;
        nlohmann::json cfg = {{"model_family", "flux"},
                              {"pretrained_model_name_or_path", data.model.string()},
                              {"data_backend_config", data.backends.string()},
                              {"checkpointing_steps", 2},
                              {"learning_rate", 0.05},
                              {"lr_scheduler", "constant"},
                              {"optimizer", "torch-sgd"},
                              {"mixed_precision", "no"},
                              {"gradient_checkpointing", false},
                              {"seed", 11},
                              {"deterministic", true},
                              {"device", "cpu"}};
        cfg.update(keys);
        fs::write_file_atomic(config, cfg.dump(2));
    }

    std::filesystem::path out(const std::string& name) const { return dir.path() / name; }

    std::string train(int ranks, const std::string& out_name, const std::string& extra) const {
        return train_command(config, out(out_name), ranks, extra);
    }
};

}  // namespace dtune
