// SimpleTuner's whole option table (every option its argument parser knows, with its type, default
// and other spellings), generated from SimpleTuner itself by tools/ref/simpletuner_options.py into
// simpletuner_options.inc. TrainConfig uses it to accept an option dtune does not implement when it
// holds SimpleTuner's default, and to tell "not implemented by dtune" apart from "unknown".
//
// Invariant: values are compared as SimpleTuner would see them after its argument parser converted
// them (config.json values become command-line words, then the option's type parses them; None means
// the default).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace dtune::train {

struct SimpleTunerOption {
    const char* name;          // the parser's destination (canonical name)
    char type;                 // 's' string, 'i' integer, 'f' number, 'b' boolean
    const char* default_json;  // the default argparse yields for an empty command line
    const char* spellings;     // other accepted spellings, comma-separated ("" if none)
};

const std::vector<SimpleTunerOption>& simpletuner_options();

// The option named `key` (canonical name or another spelling, without "--"), or nullptr.
const SimpleTunerOption* find_simpletuner_option(const std::string& key);

// True when `value` (from config.json, TOML or the command line) is what SimpleTuner would parse to
// the option's default; null always is (SimpleTuner drops None-valued keys).
bool is_simpletuner_default(const SimpleTunerOption& option, const nlohmann::json& value);

// Options that only name things dtune does not do (hub_model_id, tracker names): any value is
// accepted and ignored (defined with TrainConfig).
bool option_only_labels(const std::string& name);

// Markdown page listing every SimpleTuner option and what dtune does with it (implemented, or
// accepted at its default only), plus dtune's own options: docs/simpletuner-options.md is this text
// (`dtune train --list-options`), and a test keeps the two equal.
std::string options_markdown();

}  // namespace dtune::train
