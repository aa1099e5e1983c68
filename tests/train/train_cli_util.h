// The config.json that `dtune train` CLI tests share: the tiny SDXL fixture trained on the CPU,
// deterministic, a checkpoint every step.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>

#include "support/test_support.h"

namespace dtune::testutil {

inline nlohmann::json tiny_cli_config(const std::filesystem::path& backends) {
    return {{"--model_family", "sdxl"},
            {"--pretrained_model_name_or_path", (test::fixtures_dir() / "tiny-sdxl").string()},
            {"--data_backend_config", backends.string()},
            {"--train_batch_size", 2},
            {"--checkpointing_steps", 1},
            {"--learning_rate", 1e-4},
            {"--optimizer", "torch-adamw"},
            {"--mixed_precision", "no"},
            {"--gradient_checkpointing", false},
            {"--seed", 7},
            {"--deterministic", true},
            {"--device", "cpu"}};
}

}  // namespace dtune::testutil
