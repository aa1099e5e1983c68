// A diffusers scheduler_config.json, read for one of the samplers dtune implements. As in diffusers'
// from_config, one JSON (say SDXL's EulerDiscreteScheduler config) can build any sampler: a key the
// JSON holds wins, a missing one takes the default of the *target* class. Keys we understand but whose
// value we do not implement (thresholding, exponential sigmas, third-order DPM, ...) are UsageErrors;
// keys we do not know are ignored, because every diffusers config carries other classes' keys.
#pragma once

#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "diffusion/noise_schedule.h"

namespace dtune::diffusion {

enum class SamplerKind { kEuler, kEulerAncestral, kDDIM, kDPMSolverMultistep, kUniPC };
enum class TimestepSpacing { kLinspace, kLeading, kTrailing };
enum class FinalSigmas { kZero, kSigmaMin };
enum class DPMSolverType { kMidpoint, kHeun };
enum class UniPCVariant { kBh1, kBh2 };  // B(h) = h or e^h - 1

// Accepts SimpleTuner's names (euler, euler-a, ddim, dpm++, unipc) and diffusers' class names
// (EulerDiscreteScheduler, ...). Throws UsageError listing the supported ones.
SamplerKind parse_sampler_kind(const std::string& name);
const char* to_string(SamplerKind kind);
TimestepSpacing parse_timestep_spacing(const std::string& name);
const char* to_string(TimestepSpacing spacing);

struct SchedulerConfig {
    SamplerKind kind = SamplerKind::kEuler;
    NoiseScheduleConfig schedule;  // betas, prediction type, zero-SNR rescale
    TimestepSpacing timestep_spacing = TimestepSpacing::kLinspace;
    int64_t steps_offset = 0;
    // Euler / DPM
    bool use_karras_sigmas = false;
    FinalSigmas final_sigmas_type = FinalSigmas::kZero;
    std::optional<double> sigma_min;  // Euler and UniPC: Karras range override
    std::optional<double> sigma_max;
    // DDIM
    bool clip_sample = true;
    double clip_sample_range = 1.0;
    bool set_alpha_to_one = true;
    // DPM-Solver++ and UniPC
    int64_t solver_order = 2;
    DPMSolverType solver_type = DPMSolverType::kMidpoint;
    bool lower_order_final = true;
    bool euler_at_final = false;
    double lambda_min_clipped = -std::numeric_limits<double>::infinity();
    UniPCVariant unipc_variant = UniPCVariant::kBh2;  // UniPC's solver_type

    // The defaults of `kind`'s diffusers class (0.42).
    static SchedulerConfig defaults(SamplerKind kind);
    // Builds the config of `kind` from a scheduler_config.json; with no kind, "_class_name" decides.
    // `source` names the file in error messages.
    static SchedulerConfig from_json(const nlohmann::json& config, std::optional<SamplerKind> kind,
                                     const std::string& source = "scheduler_config.json");
};

}  // namespace dtune::diffusion

namespace dtune::diffusion {

// Parses JSON text as Python's json module writes it: bare Infinity, -Infinity and NaN (which
// diffusers writes for lambda_min_clipped = -inf) become the strings "Infinity", ... that the config
// readers accept. Throws DataError naming `source` on malformed JSON.
nlohmann::json parse_python_json(const std::string& text, const std::string& source);
// Reads and parses a scheduler_config.json file.
nlohmann::json read_scheduler_config(const std::filesystem::path& path);

}  // namespace dtune::diffusion
