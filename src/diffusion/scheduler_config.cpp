// Reading diffusers scheduler configs (see scheduler_config.h).
#include "diffusion/scheduler_config.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "diffusion/config_json.h"

namespace dtune::diffusion {

SamplerKind parse_sampler_kind(const std::string& name) {
    if (name == "euler" || name == "EulerDiscreteScheduler") return SamplerKind::kEuler;
    if (name == "euler-a" || name == "euler_a" || name == "EulerAncestralDiscreteScheduler")
        return SamplerKind::kEulerAncestral;
    if (name == "ddim" || name == "DDIMScheduler") return SamplerKind::kDDIM;
    // dpmpp_2m / dpmpp_2m_karras are dtune sample's names; the caller sets use_karras_sigmas.
    if (name == "dpm++" || name == "dpmsolver++" || name == "dpmpp_2m" || name == "dpmpp_2m_karras" ||
        name == "DPMSolverMultistepScheduler")
        return SamplerKind::kDPMSolverMultistep;
    if (name == "unipc" || name == "UniPCMultistepScheduler") return SamplerKind::kUniPC;
    throw UsageError(str("sampler \"", name,
                         "\" is not implemented; use euler, euler_a (euler-a), ddim, dpmpp_2m (dpm++), "
                         "dpmpp_2m_karras or unipc (diffusers' "
                         "EulerDiscreteScheduler, EulerAncestralDiscreteScheduler, DDIMScheduler, "
                         "DPMSolverMultistepScheduler, UniPCMultistepScheduler)"));
}

const char* to_string(SamplerKind kind) {
    switch (kind) {
        case SamplerKind::kEuler: return "euler";
        case SamplerKind::kEulerAncestral: return "euler-a";
        case SamplerKind::kDDIM: return "ddim";
        case SamplerKind::kDPMSolverMultistep: return "dpm++";
        case SamplerKind::kUniPC: return "unipc";
    }
    return "?";
}

TimestepSpacing parse_timestep_spacing(const std::string& name) {
    if (name == "linspace") return TimestepSpacing::kLinspace;
    if (name == "leading") return TimestepSpacing::kLeading;
    if (name == "trailing") return TimestepSpacing::kTrailing;
    throw UsageError(str("timestep_spacing \"", name,
                         "\" is not supported; use \"linspace\", \"leading\" or \"trailing\""));
}

const char* to_string(TimestepSpacing spacing) {
    switch (spacing) {
        case TimestepSpacing::kLinspace: return "linspace";
        case TimestepSpacing::kLeading: return "leading";
        case TimestepSpacing::kTrailing: return "trailing";
    }
    return "?";
}

SchedulerConfig SchedulerConfig::defaults(SamplerKind kind) {
    SchedulerConfig c;
    c.kind = kind;
    // Every one of these classes defaults to linear betas 1e-4..0.02 and epsilon (NoiseScheduleConfig's
    // defaults); they differ in spacing and in DDIM's clipping.
    c.timestep_spacing = kind == SamplerKind::kDDIM ? TimestepSpacing::kLeading : TimestepSpacing::kLinspace;
    return c;
}

namespace {

using detail::get_bool;
using detail::get_double;
using detail::get_int;
using detail::get_string;
using detail::has_value;

// A key whose non-default value we do not implement: reject it with the fix.
void reject_if(bool cond, const std::string& source, const std::string& key, const nlohmann::json& j,
               const char* fix) {
    DTUNE_CHECK_AS(UsageError, !cond, source, ": \"", key, "\" = ", j.at(key).dump(),
                   " is not implemented by dtune's samplers; ", fix);
}

void read_unsupported(const nlohmann::json& j, SamplerKind kind, const std::string& source) {
    for (const char* key : {"use_exponential_sigmas", "use_beta_sigmas", "use_lu_lambdas", "use_flow_sigmas",
                            "thresholding", "use_dynamic_shifting"}) {
        if (has_value(j, key)) reject_if(get_bool(j, key, false, source), source, key, j, "set it to false");
    }
    if (kind == SamplerKind::kEuler) {
        if (has_value(j, "interpolation_type"))
            reject_if(get_string(j, "interpolation_type", "linear", source) != "linear", source,
                      "interpolation_type", j, "use \"linear\"");
        if (has_value(j, "timestep_type"))
            reject_if(get_string(j, "timestep_type", "discrete", source) != "discrete", source,
                      "timestep_type", j, "use \"discrete\"");
    }
    if (kind == SamplerKind::kUniPC) {
        if (has_value(j, "predict_x0"))
            reject_if(!get_bool(j, "predict_x0", true, source), source, "predict_x0", j, "use true");
        if (has_value(j, "disable_corrector"))
            reject_if(!j.at("disable_corrector").empty(), source, "disable_corrector", j, "use []");
        if (has_value(j, "solver_p")) reject_if(true, source, "solver_p", j, "remove it");
    }
    if (kind == SamplerKind::kDPMSolverMultistep && has_value(j, "algorithm_type"))
        reject_if(get_string(j, "algorithm_type", "dpmsolver++", source) != "dpmsolver++", source,
                  "algorithm_type", j, "use \"dpmsolver++\" (DPM++ 2M)");
}

}  // namespace

SchedulerConfig SchedulerConfig::from_json(const nlohmann::json& j, std::optional<SamplerKind> kind_in,
                                           const std::string& source) {
    DTUNE_CHECK_AS(UsageError, j.is_object(), source,
                   " must hold a JSON object (a diffusers scheduler_config.json)");
    SamplerKind kind = SamplerKind::kEuler;
    if (kind_in) {
        kind = *kind_in;
    } else {
        DTUNE_CHECK_AS(UsageError, has_value(j, "_class_name"), source,
                       " has no \"_class_name\"; name the sampler explicitly (euler, euler-a, ddim, dpm++)");
        kind = parse_sampler_kind(get_string(j, "_class_name", "", source));
    }
    SchedulerConfig c = defaults(kind);
    c.schedule = NoiseScheduleConfig::from_json(j, source);
    DTUNE_CHECK_AS(
        UsageError, c.schedule.prediction_type != PredictionType::kFlowMatching, source,
        ": prediction_type flow_matching needs a flow-matching sampler, which is not implemented yet");
    if (has_value(j, "timestep_spacing"))
        c.timestep_spacing = parse_timestep_spacing(get_string(j, "timestep_spacing", "", source));
    c.steps_offset = get_int(j, "steps_offset", 0, source);
    read_unsupported(j, kind, source);
    const bool multistep = kind == SamplerKind::kDPMSolverMultistep || kind == SamplerKind::kUniPC;
    if (kind == SamplerKind::kEuler || multistep) {
        c.use_karras_sigmas = get_bool(j, "use_karras_sigmas", false, source);
        const auto final = get_string(j, "final_sigmas_type", "zero", source);
        DTUNE_CHECK_AS(UsageError, final == "zero" || final == "sigma_min", source, ": final_sigmas_type \"",
                       final, "\" is not supported; use \"zero\" or \"sigma_min\"");
        c.final_sigmas_type = final == "zero" ? FinalSigmas::kZero : FinalSigmas::kSigmaMin;
    }
    if (kind == SamplerKind::kEuler || kind == SamplerKind::kUniPC) {
        c.sigma_min = detail::get_optional_double(j, "sigma_min", source);
        c.sigma_max = detail::get_optional_double(j, "sigma_max", source);
    }
    if (kind == SamplerKind::kEulerAncestral) {
        DTUNE_CHECK_AS(
            UsageError, c.schedule.prediction_type != PredictionType::kSample, source,
            ": euler-a does not support prediction_type sample (diffusers neither); use euler or ddim");
    }
    if (kind == SamplerKind::kDDIM) {
        c.clip_sample = get_bool(j, "clip_sample", true, source);
        c.clip_sample_range = get_double(j, "clip_sample_range", 1.0, source);
        c.set_alpha_to_one = get_bool(j, "set_alpha_to_one", true, source);
    }
    if (multistep) {
        c.solver_order = get_int(j, "solver_order", 2, source);
        DTUNE_CHECK_AS(UsageError, c.solver_order == 1 || c.solver_order == 2, source, ": solver_order ",
                       c.solver_order, " is not implemented; use 2 or 1");
        c.lower_order_final = get_bool(j, "lower_order_final", true, source);
    }
    if (kind == SamplerKind::kUniPC) {
        const auto variant = get_string(j, "solver_type", "bh2", source);
        // diffusers maps a DPM config's solver types to bh2, as we do.
        const bool dpm_name = variant == "midpoint" || variant == "heun" || variant == "logrho";
        DTUNE_CHECK_AS(UsageError, variant == "bh1" || variant == "bh2" || dpm_name, source,
                       ": solver_type \"", variant, "\" is not a UniPC variant; use \"bh1\" or \"bh2\"");
        c.unipc_variant = variant == "bh1" ? UniPCVariant::kBh1 : UniPCVariant::kBh2;
    }
    if (kind == SamplerKind::kDPMSolverMultistep) {
        const auto solver = get_string(j, "solver_type", "midpoint", source);
        DTUNE_CHECK_AS(UsageError, solver == "midpoint" || solver == "heun", source, ": solver_type \"",
                       solver, "\" is not supported; use \"midpoint\" or \"heun\"");
        c.solver_type = solver == "midpoint" ? DPMSolverType::kMidpoint : DPMSolverType::kHeun;
        c.euler_at_final = get_bool(j, "euler_at_final", false, source);
        c.lambda_min_clipped = get_double(j, "lambda_min_clipped", c.lambda_min_clipped, source);
    }
    return c;
}

nlohmann::json parse_python_json(const std::string& text, const std::string& source) {
    // Quote the non-standard number tokens outside string literals; everything else is copied as is.
    std::string out;
    out.reserve(text.size() + 16);
    bool in_string = false;
    for (size_t i = 0; i < text.size(); ++i) {
        const char ch = text[i];
        if (in_string) {
            out += ch;
            if (ch == '\\' && i + 1 < text.size()) {
                out += text[++i];
            } else if (ch == '"') {
                in_string = false;
            }
            continue;
        }
        if (ch == '"') in_string = true;
        bool replaced = false;
        for (const char* token : {"-Infinity", "Infinity", "NaN"}) {
            const std::string_view t(token);
            if (text.compare(i, t.size(), t) == 0) {
                out += '"';
                out += t;
                out += '"';
                i += t.size() - 1;
                replaced = true;
                break;
            }
        }
        if (!replaced) out += ch;
    }
    try {
        return nlohmann::json::parse(out);
    } catch (const nlohmann::json::parse_error& e) {
        throw DataError(str(source, " is not valid JSON (", e.what(), "); fix or regenerate the file"));
    }
}

nlohmann::json read_scheduler_config(const std::filesystem::path& path) {
    return parse_python_json(fs::read_file(path), path.string());
}

}  // namespace dtune::diffusion
