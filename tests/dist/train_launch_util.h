// Helpers for the tests that run `dtune train` under the real `dtune launch` (label dist): the
// shell runner and free port of support/shell.h, and a workspace with the tiny SDXL fixture, 8
// generated images and a config (SGD, deterministic, CPU); final weights read back from the
// exported pipeline.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>

#include "core/fs.h"
#include "io/image.h"
#include "io/safetensors.h"
#include "support/shell.h"
#include "support/test_support.h"

namespace dtune {

using test::contains;
using test::free_port;
using test::line_with;
using test::run_shell;
using test::ShellRun;

// `dtune train --config config --output_dir out extra` in one process (ranks 0), or under `dtune
// launch` with `ranks` processes on a free port.
inline std::string train_command(const std::filesystem::path& config, const std::filesystem::path& out,
                                 int ranks, const std::string& extra) {
    const std::string train_args =
        "train --config '" + config.string() + "' --output_dir '" + out.string() + "' " + extra;
    if (ranks == 0) return std::string(DTUNE_BIN) + " " + train_args;
    return std::string(DTUNE_BIN) + " launch --grace_period 3 --nproc_per_node " + std::to_string(ranks) +
           " --master_port " + std::to_string(free_port()) + " -- " + train_args;
}

struct Workspace {
    test::TempDir dir;
    std::filesystem::path config;

    Workspace() {
        const auto images = dir / "images";
        std::filesystem::create_directories(images);
        for (int i = 0; i < 8; ++i) {
            io::RgbImage img(72, 64);
            for (size_t p = 0; p < img.pixels.size(); ++p)
                img.pixels[p] = static_cast<uint8_t>((p * 5 + i * 37) % 256);
            io::write_image(images / ("sample " + std::to_string(i) + ".png"), img);
        }
        const nlohmann::json backends = nlohmann::json::array({{{"id", "tiny"},
                                                                {"type", "local"},
                                                                {"instance_data_dir", images.string()},
                                                                {"resolution", 64},
                                                                {"resolution_type", "pixel"},
                                                                {"caption_strategy", "filename"}},
                                                               {{"id", "text"},
                                                                {"type", "local"},
                                                                {"dataset_type", "text_embeds"},
                                                                {"default", true},
                                                                {"cache_dir", (dir / "text").string()}}});
        fs::write_file_atomic(dir / "multidatabackend.json", backends.dump(2));
        // SGD: its update is linear in the gradient, so float summation order changes the weights
        // by ~1e-9 while a wrong gradient (one rank's only, or not averaged) changes them by ~1e-3.
        const nlohmann::json cfg = {
            {"model_family", "sdxl"},
            {"pretrained_model_name_or_path", (test::fixtures_dir() / "tiny-sdxl").string()},
            {"data_backend_config", (dir / "multidatabackend.json").string()},
            {"checkpointing_steps", 2},
            {"learning_rate", 0.05},
            {"lr_scheduler", "constant"},
            {"optimizer", "torch-sgd"},
            {"mixed_precision", "no"},
            {"gradient_checkpointing", false},
            {"caption_dropout_probability", 0.3},
            {"seed", 11},
            {"deterministic", true},
            {"device", "cpu"}};
        config = dir / "config.json";
        fs::write_file_atomic(config, cfg.dump(2));
    }

    std::filesystem::path out(const std::string& name) const { return dir.path() / name; }

    // `dtune train` in one process, or under `dtune launch` with `ranks` processes.
    std::string train(int ranks, const std::string& out_name, const std::string& extra) const {
        return train_command(config, out(out_name), ranks, extra);
    }
};

inline std::map<std::string, at::Tensor> final_weights(const std::filesystem::path& out) {
    std::map<std::string, at::Tensor> m;
    for (auto& [k, v] : io::load_safetensors(out / "pipeline/unet/diffusion_pytorch_model.safetensors"))
        m[k] = v.clone();
    return m;
}

// A full fine-tune's UNet weights in `out`/checkpoint-`step`.
inline std::map<std::string, at::Tensor> checkpoint_weights(const std::filesystem::path& out, int step) {
    std::map<std::string, at::Tensor> m;
    for (auto& [k, v] : io::load_safetensors(out / ("checkpoint-" + std::to_string(step)) /
                                             "unet/diffusion_pytorch_model.safetensors"))
        m[k] = v.clone();
    return m;
}

inline double max_difference(const std::map<std::string, at::Tensor>& a,
                             const std::map<std::string, at::Tensor>& b) {
    EXPECT_EQ(a.size(), b.size());
    double worst = 0;
    for (const auto& [k, v] : a) {
        auto it = b.find(k);
        if (it == b.end()) {
            ADD_FAILURE() << "missing " << k;
            continue;
        }
        worst = std::max(worst, (v.to(at::kDouble) - it->second.to(at::kDouble)).abs().max().item<double>());
    }
    return worst;
}

}  // namespace dtune
