// SimpleTuner's weight-precision presets (`base_model_precision`, `text_encoder_N_precision`) as
// dtune implements them, shared by the config checks and the model code (models/common/quantize.h)
// so both accept and refuse the same values with the same words. Header-only.
#pragma once

#include <string>

#include "core/error.h"

namespace dtune {

enum class QuantFormat { kNone, kInt8, kFloat8 };

struct QuantPreset {
    std::string name = "no_change";
    QuantFormat format = QuantFormat::kNone;
    bool convolutions = false;         // quanto quantises Conv2d too; torchao only nn.Linear
    bool dims_multiple_of_16 = false;  // torchao's fp8 filter: in and out features divisible by 16
    bool quanto = false;               // a quanto preset (SimpleTuner refuses DoRA with these)
    bool active() const { return format != QuantFormat::kNone; }
};

inline constexpr const char* kQuantPresetChoices =
    "no_change, int8-quanto, int8-torchao, fp8-quanto, fp8-torchao";

// Parses a preset; `key` names the option in errors. The other SimpleTuner presets (int4/int2-quanto,
// nf4-bnb, int8dq/fp8wo/...-torchao, sdnq, fp8-native, ...) are UsageErrors that say what to use.
inline QuantPreset parse_quant_preset(const std::string& value, const std::string& key) {
    QuantPreset p;
    p.name = value.empty() ? "no_change" : value;
    if (p.name == "no_change") return p;
    if (p.name == "int8-quanto" || p.name == "fp8-quanto") {
        p.format = p.name == "int8-quanto" ? QuantFormat::kInt8 : QuantFormat::kFloat8;
        p.convolutions = true;
        p.quanto = true;
        return p;
    }
    if (p.name == "int8-torchao" || p.name == "fp8-torchao") {
        p.format = p.name == "int8-torchao" ? QuantFormat::kInt8 : QuantFormat::kFloat8;
        p.dims_multiple_of_16 = p.format == QuantFormat::kFloat8;
        return p;
    }
    if (p.name == "nf4-bnb")
        throw UsageError(
            str(key, " = \"nf4-bnb\" is not available in dtune (bitsandbytes' 4-bit format needs ",
                "its own CUDA library); use int8-quanto (half the memory of bf16) or fp8-torchao ",
                "(half the memory, fp8 matmuls on Hopper)"));
    if (p.name == "int4-quanto" || p.name == "int2-quanto" || p.name == "int4-torchao")
        throw UsageError(str(key, " = \"", p.name,
                             "\" is not implemented in dtune (no sub-byte weights yet); ",
                             "use int8-quanto or fp8-torchao, which halve the base model's memory"));
    throw UsageError(str(key, " = \"", p.name, "\" is not a precision dtune implements; use one of ",
                         kQuantPresetChoices));
}

}  // namespace dtune
