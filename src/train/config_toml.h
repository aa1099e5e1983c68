// config.toml, SimpleTuner's other config format: read into the same JSON object a config.json with
// the same keys gives, so TrainConfig treats both alike (keys with or without "--").
#pragma once

#include <filesystem>

#include <nlohmann/json.hpp>

namespace dtune::train {

// Tables become objects, arrays arrays, dates and times their TOML text. UsageError naming the
// file, line and column when the file is not valid TOML.
nlohmann::json read_toml_config(const std::filesystem::path& file);

}  // namespace dtune::train
