// The training configuration: SimpleTuner's config.json (keys with or without a leading "--"),
// command-line overrides (`--learning_rate 1e-4`, `--key=value`, `--set key=value`), resolved into
// typed values with SimpleTuner's names and defaults (SIMPLETUNER.md §6). Torch-free.
//
// Invariants after load: every key dtune implements has a value of its declared type (or null where
// SimpleTuner's default is None); aliases (checkpointing_steps, validation_steps) are folded into
// their canonical names; a known SimpleTuner option dtune does not implement is rejected unless it
// holds SimpleTuner's default value; an unknown key is rejected with the closest known key. As in
// SimpleTuner's loader, a null value means "not given" (the default) for every key, and legacy keys
// are translated (save_total_limit, vae_cache_preprocess) or dropped (a top-level repeats,
// aspect_ratio_bucketing); keys that only label hub uploads or tracker runs take any value.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dtune::train {

enum class OptionType { kString, kInt, kFloat, kBool, kAny };

struct OptionSpec {
    const char* name;
    OptionType type;
    const char* default_json;  // the default as JSON text ("null" for SimpleTuner's None)
    const char* help;          // one line for `dtune train --help`
    const char* choices;       // comma-separated allowed values for strings, or nullptr
};

// The options dtune implements, in help order.
const std::vector<OptionSpec>& option_specs();
// "--help" text listing every option with its default.
std::string options_help();

class TrainConfig {
  public:
    // Defaults only.
    TrainConfig();

    // Reads config.json (or reports that TOML is not supported yet), then applies `overrides` (the
    // command-line words after the config path). UsageError/DataError naming the file and key.
    static TrainConfig load(const std::filesystem::path& config_file,
                            const std::vector<std::string>& overrides);
    // Merges a JSON object (SimpleTuner config.json), `source` names it in errors.
    void merge_json(const nlohmann::json& object, const std::string& source);
    // Applies command-line words: "--key value", "--key=value", "--set key=value", "--flag".
    void apply_overrides(const std::vector<std::string>& words);
    // Sets one key from text (typed by the option's declared type).
    void set(const std::string& key, const std::string& value_text, const std::string& source);
    // Checks cross-key constraints (required keys, choices); called by load().
    void validate() const;
    // Fills flavour defaults, then validate(); the end of load().
    void finish();

    bool is_null(const std::string& key) const;
    std::string text(const std::string& key) const;  // "" when null
    int64_t integer(const std::string& key) const;
    double real(const std::string& key) const;
    bool flag(const std::string& key) const;
    std::optional<int64_t> opt_integer(const std::string& key) const;
    std::optional<double> opt_real(const std::string& key) const;
    const nlohmann::json& raw(const std::string& key) const;
    // report_to split at commas, lower-cased ("wandb,tensorboard" -> {"wandb", "tensorboard"}).
    std::vector<std::string> report_to_list() const;

    // The resolved configuration (every implemented key, canonical names, no "--").
    const nlohmann::json& resolved() const { return values_; }
    // Writes resolved() as pretty JSON to `path`, atomically.
    void write_resolved(const std::filesystem::path& path) const;
    // Restores a resolved configuration written by write_resolved (checkpoint comparison).
    static TrainConfig from_resolved(const nlohmann::json& resolved);

  private:
    void set_value(const std::string& key, nlohmann::json value, const std::string& source);
    void apply_override(const std::vector<std::string>& words, std::size_t& i, const std::string& source);
    // merge_json(file_options) unless source is empty, apply_overrides, finish: every problem of all
    // three in one UsageError.
    void load_stages(const nlohmann::json& file_options, const std::string& source,
                     const std::vector<std::string>& overrides);
    bool set_legacy(const std::string& key, const nlohmann::json& value, const std::string& source);
    // tokenizer_max_length as SimpleTuner's model classes resolve it (config.cpp).
    void resolve_tokenizer_max_length();

    nlohmann::json values_;
};

// Levenshtein distance (for "did you mean" suggestions; exposed for tests).
std::size_t edit_distance(const std::string& a, const std::string& b);

}  // namespace dtune::train
