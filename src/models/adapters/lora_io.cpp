// LoRA files: key-dialect parsing (diffusers / PEFT / kohya), loading into adapters, saving.
#include "models/adapters/lora_io.h"

#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>

#include "core/error.h"
#include "core/log.h"
#include "models/common/weights.h"

namespace dtune::models {
namespace {

enum class Part { kDown, kUp, kAlpha, kMagnitude, kDoraScale };

struct ParsedKey {
    std::string module;  // dotted (diffusers/PEFT) or underscored (kohya, without "lora_unet_")
    Part part;
    bool kohya = false;
};

struct ModuleTensors {
    at::Tensor down, up, alpha, magnitude;
    std::vector<std::string> keys;
};

bool starts_with(const std::string& s, const std::string& p) {
    return s.rfind(p, 0) == 0;
}

bool ends_with(const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string joined(const std::vector<std::string>& items, std::size_t limit = 20) {
    std::string out;
    for (std::size_t i = 0; i < items.size() && i < limit; ++i) out += "\n    " + items[i];
    if (items.size() > limit) out += str("\n    ... and ", items.size() - limit, " more");
    return out;
}

bool is_text_encoder_key(const std::string& key) {
    return starts_with(key, "text_encoder.") || starts_with(key, "text_encoder_2.") ||
           starts_with(key, "lora_te");
}

// Diffusers' attention-processor era: "attn1.processor.to_q_lora" -> "attn1.to_q",
// "to_out_lora" -> "to_out.0"; also drops a plain ".processor" segment.
std::string normalise_module(std::string m) {
    for (std::size_t at; (at = m.find(".processor.")) != std::string::npos;) m.erase(at, 10);
    if (ends_with(m, "_lora")) {
        m.resize(m.size() - 5);
        if (ends_with(m, ".to_out")) m += ".0";
    }
    return m;
}

std::optional<ParsedKey> parse_key(const std::string& key) {
    static const std::pair<const char*, Part> kKohya[] = {{".lora_down.weight", Part::kDown},
                                                          {".lora_up.weight", Part::kUp},
                                                          {".alpha", Part::kAlpha},
                                                          {".dora_scale", Part::kDoraScale}};
    static const std::pair<const char*, Part> kDotted[] = {
        {".lora.down.weight", Part::kDown},
        {".lora.up.weight", Part::kUp},
        {".lora_A.weight", Part::kDown},
        {".lora_B.weight", Part::kUp},
        {".lora_A.default.weight", Part::kDown},
        {".lora_B.default.weight", Part::kUp},
        {".lora_down.weight", Part::kDown},
        {".lora_up.weight", Part::kUp},
        {".lora_magnitude_vector", Part::kMagnitude},
        {".lora_magnitude_vector.weight", Part::kMagnitude},
        {".lora_magnitude_vector.default.weight", Part::kMagnitude},
        {".alpha", Part::kAlpha},
        {".dora_scale", Part::kDoraScale}};
    if (starts_with(key, "lora_unet_")) {
        const std::string rest = key.substr(10);
        for (const auto& [suffix, part] : kKohya)
            if (ends_with(rest, suffix))
                return ParsedKey{rest.substr(0, rest.size() - std::strlen(suffix)), part, true};
        return std::nullopt;
    }
    std::string rest = key;
    // "unet." (SDXL) or "transformer." (Flux, SD3) in diffusers' files; PEFT's own prefix.
    for (const char* prefix : {"unet.", "transformer.", "base_model.model."})
        if (starts_with(rest, prefix)) rest = rest.substr(std::strlen(prefix));
    for (const auto& [suffix, part] : kDotted)
        if (ends_with(rest, suffix))
            return ParsedKey{normalise_module(rest.substr(0, rest.size() - std::strlen(suffix))), part,
                             false};
    return std::nullopt;
}

// diffusers' lora_adapter_metadata: {"unet.r": 4, "unet.lora_alpha": 8, ...} (or "transformer."; the
// prefix is optional).
nlohmann::json adapter_metadata(const io::Metadata& metadata, const std::filesystem::path& file) {
    auto it = metadata.find("lora_adapter_metadata");
    if (it == metadata.end()) return nlohmann::json::object();
    nlohmann::json raw;
    try {
        raw = nlohmann::json::parse(it->second);
    } catch (const nlohmann::json::exception& e) {
        throw DataError(str(file.string(), ": metadata 'lora_adapter_metadata' is not JSON (", e.what(),
                            "); rewrite the file or remove that metadata entry"));
    }
    nlohmann::json out = nlohmann::json::object();
    if (!raw.is_object()) return out;
    for (auto& [k, v] : raw.items()) {
        std::string key = k;
        for (const char* prefix : {"unet.", "transformer."})
            if (starts_with(key, prefix)) key = key.substr(std::strlen(prefix));
        out[key] = v;
    }
    return out;
}

// PEFT's alpha_pattern rule: a key applies to modules whose name ends with it at a '.' boundary.
std::optional<double> pattern_alpha(const nlohmann::json& meta, const std::string& module) {
    if (!meta.contains("alpha_pattern") || !meta["alpha_pattern"].is_object()) return std::nullopt;
    for (auto& [k, v] : meta["alpha_pattern"].items())
        if (v.is_number() && std::regex_match(module, std::regex("(.*\\.)?(" + k + ")")))
            return v.get<double>();
    return std::nullopt;
}

std::string shape_str(const at::Tensor& t) {
    return str(t.sizes());
}

}  // namespace

LoRAFormat parse_lora_format(const std::string& value) {
    if (value == "diffusers" || value.empty()) return LoRAFormat::kDiffusers;
    if (value == "comfyui") return LoRAFormat::kComfyUI;
    throw UsageError(str("lora_format '", value, "' is not supported; use 'diffusers' or 'comfyui'"));
}

std::string kohya_lora_name(const std::string& module) {
    std::string out = "lora_unet_" + module;
    for (char& c : out)
        if (c == '.') c = '_';
    return out;
}

namespace {

// Groups the file's UNet tensors by adapted module; unknown keys go to `unmatched`.
std::map<std::string, ModuleTensors> group_keys(const LoRAAdapters& adapters, const LoRATensors& lora,
                                                std::vector<std::string>& unmatched, LoRALoadReport& report) {
    std::map<std::string, std::string> by_kohya;  // "down_blocks_1_..._to_k" -> dotted module
    for (const auto& e : adapters.entries()) by_kohya[kohya_lora_name(e.module).substr(10)] = e.module;
    std::map<std::string, ModuleTensors> grouped;
    for (const auto& [key, t] : lora.tensors) {
        if (is_text_encoder_key(key)) {
            ++report.text_encoder_keys_skipped;
            continue;
        }
        const auto parsed = parse_key(key);
        std::string module;
        if (parsed && parsed->kohya) {
            auto it = by_kohya.find(parsed->module);
            if (it != by_kohya.end()) module = it->second;
            report.format = "kohya";
        } else if (parsed && adapters.find(parsed->module)) {
            module = parsed->module;
            if (report.format.empty())
                report.format = ends_with(key, ".lora.down.weight") ? "diffusers" : "peft";
        }
        if (module.empty()) {
            unmatched.push_back(key);
            continue;
        }
        ModuleTensors& m = grouped[module];
        m.keys.push_back(key);
        switch (parsed->part) {
            case Part::kDown: m.down = t; break;
            case Part::kUp: m.up = t; break;
            case Part::kAlpha: m.alpha = t; break;
            case Part::kMagnitude:
            case Part::kDoraScale: m.magnitude = t; break;
        }
    }
    return grouped;
}

// Shape checks for one module; problems are appended to `errors`.
void check_module(const std::string& module, LoRALayer& layer, const ModuleTensors& m,
                  std::vector<std::string>& errors) {
    if (!m.down.defined() || !m.up.defined()) {
        errors.push_back(str(module, ": the file has ",
                             m.down.defined() ? "no up (lora_B)" : "no down (lora_A)",
                             " weight (keys: ", m.keys.front(), " ...)"));
        return;
    }
    if (m.down.sizes() != layer.down().sizes() || m.up.sizes() != layer.up().sizes())
        errors.push_back(str(module, ": down ", shape_str(m.down), " / up ", shape_str(m.up),
                             " in the file vs ", shape_str(layer.down()), " / ", shape_str(layer.up()),
                             " in the model (file rank ", m.down.size(0), ", model rank ", layer.rank(),
                             ")"));
    if (m.magnitude.defined() && !layer.use_dora())
        errors.push_back(str(module, ": the file holds a DoRA magnitude but the adapter is plain LoRA"));
    else if (m.magnitude.defined() && m.magnitude.numel() != layer.magnitude().numel())
        errors.push_back(str(module, ": DoRA magnitude ", shape_str(m.magnitude), " vs ",
                             shape_str(layer.magnitude()), " in the model"));
    else if (!m.magnitude.defined() && layer.use_dora())
        errors.push_back(str(module, ": the adapter is DoRA but the file has no lora_magnitude_vector"));
}

// kohya's `.alpha` tensors and the metadata's alphas: a positive finite number. NaN or infinity
// would make every output NaN; zero would silently switch the adapter off, and a negative alpha
// inverts it (kohya's own trainer never writes either; a weaker or inverted LoRA is --lora_scale's
// job). DataError naming the file and the key.
double checked_alpha(double alpha, const std::string& where, const std::string& key) {
    if (std::isfinite(alpha) && alpha > 0) return alpha;
    throw DataError(str(where, ": ", key, " is ", alpha,
                        "; a LoRA alpha must be a positive finite number (kohya files store the rank or "
                        "the training's network_alpha there): fix or re-export the file"));
}

// Every factor, magnitude and alpha tensor of the file that will be loaded must be finite.
void check_finite(const std::map<std::string, ModuleTensors>& grouped, const std::string& where) {
    std::vector<at::Tensor> tensors;
    std::vector<std::string> keys;
    for (const auto& [module, m] : grouped)
        for (const std::string& key : m.keys) {
            const Part part = parse_key(key)->part;  // grouped keys parsed before
            tensors.push_back(part == Part::kDown    ? m.down
                              : part == Part::kUp    ? m.up
                              : part == Part::kAlpha ? m.alpha
                                                     : m.magnitude);
            keys.push_back(key);
        }
    const int64_t bad = first_non_finite(tensors);
    if (bad < 0) return;
    throw DataError(str(where, ": tensor '", keys[static_cast<std::size_t>(bad)],
                        "' holds NaN or infinite values; the LoRA is damaged (its training diverged, or a "
                        "conversion broke it): use another copy or an earlier checkpoint of it"));
}

}  // namespace

LoRATensors LoRATensors::read(const std::filesystem::path& file) {
    const io::SafetensorsFile f(file);
    LoRATensors lora{file.string(), {}, f.metadata(), ""};
    for (const std::string& key : f.keys()) lora.tensors.emplace_back(key, f.get(key));
    return lora;
}

LoRALoadReport load_lora(LoRAAdapters& adapters, const std::filesystem::path& file,
                         const LoRALoadOptions& options) {
    return load_lora(adapters, LoRATensors::read(file), options);
}

LoRALoadReport load_lora(LoRAAdapters& adapters, const LoRATensors& lora, const LoRALoadOptions& options) {
    LoRALoadReport report;
    std::vector<std::string> unmatched, errors, missing;
    auto grouped = group_keys(adapters, lora, unmatched, report);
    if (!lora.layout.empty()) report.format = lora.layout;
    const std::string& where = lora.origin;
    if (!unmatched.empty())
        throw DataError(
            str(where, ": ", unmatched.size(), " key(s) match no LoRA-adapted module of the UNet:",
                joined(unmatched), "\n  adapted modules are named like '", adapters.entries().front().module,
                "'; check the LoRA target modules and that the file is an SDXL UNet LoRA in diffusers, "
                "PEFT or kohya (lora_unet_<diffusers path>) layout"));
    for (const auto& e : adapters.entries()) {
        auto it = grouped.find(e.module);
        if (it == grouped.end())
            missing.push_back(e.module);
        else
            check_module(e.module, *e.layer, it->second, errors);
    }
    if (!errors.empty())
        throw DataError(str(where, ": the LoRA does not fit the injected adapters:", joined(errors), "\n  ",
                            options.shape_fix));
    if (options.strict && !missing.empty())
        throw DataError(str(where, ": ", missing.size(), " adapted module(s) have no weights in the file:",
                            joined(missing), "\n  restrict the LoRA target modules to the file's modules"));

    check_finite(grouped, where);
    const nlohmann::json meta = adapter_metadata(lora.metadata, lora.origin);
    torch::NoGradGuard no_grad;
    for (auto& [module, m] : grouped) {
        LoRALayer& layer = *adapters.find(module);
        DTUNE_CHECK_AS(UsageError, !layer.merged(), "load_lora: unmerge the adapters before loading ", where);
        layer.down().copy_(m.down);
        layer.up().copy_(m.up);
        if (m.magnitude.defined()) layer.magnitude().copy_(m.magnitude.reshape(layer.magnitude().sizes()));
        if (m.alpha.defined()) {
            std::string key;
            for (const auto& k : m.keys)
                if (ends_with(k, ".alpha")) key = k;
            DTUNE_CHECK_AS(DataError, m.alpha.numel() == 1, where, ": ", key, " has ", m.alpha.numel(),
                           " values; a LoRA alpha is one number: fix or re-export the file");
            const double alpha = checked_alpha(m.alpha.item<double>(), where, key);
            layer.set_scale(alpha / static_cast<double>(layer.rank()));  // kohya: alpha / r
        } else if (auto a = pattern_alpha(meta, module)) {
            layer.set_alpha(checked_alpha(*a, where, "lora_adapter_metadata alpha_pattern for " + module));
        } else if (meta.contains("lora_alpha") && meta["lora_alpha"].is_number()) {
            layer.set_alpha(
                checked_alpha(meta["lora_alpha"].get<double>(), where, "lora_adapter_metadata lora_alpha"));
        }
        ++report.modules_loaded;
    }
    if (report.text_encoder_keys_skipped > 0)
        log::warn() << where << ": skipped " << report.text_encoder_keys_skipped
                    << " text-encoder LoRA tensors (only the UNet is adapted)";
    log::info() << "LoRA: loaded " << report.modules_loaded << " modules from " << where << " ("
                << report.format << " layout)";
    return report;
}

std::vector<LoRAFileModule> lora_file_modules(const std::filesystem::path& file,
                                              const std::vector<std::string>& module_names) {
    return lora_file_modules(LoRATensors::read(file), module_names);
}

std::vector<LoRAFileModule> lora_file_modules(const LoRATensors& lora,
                                              const std::vector<std::string>& module_names) {
    const std::string& file = lora.origin;
    std::map<std::string, std::string> by_kohya;  // "down_blocks_1_..._to_k" -> dotted module
    for (const auto& m : module_names) by_kohya[kohya_lora_name(m).substr(10)] = m;
    const std::set<std::string> known(module_names.begin(), module_names.end());
    std::map<std::string, LoRAFileModule> found;
    std::vector<std::string> unmatched;
    for (const auto& [key, t] : lora.tensors) {
        if (is_text_encoder_key(key)) continue;
        const auto parsed = parse_key(key);
        std::string module;
        if (parsed && parsed->kohya) {
            if (auto it = by_kohya.find(parsed->module); it != by_kohya.end()) module = it->second;
        } else if (parsed && known.count(parsed->module)) {
            module = parsed->module;
        }
        if (module.empty()) {
            if (!parsed || parsed->part == Part::kDown || parsed->part == Part::kUp) unmatched.push_back(key);
            continue;
        }
        LoRAFileModule& m = found[module];
        m.module = module;
        if (parsed->part == Part::kDown) m.rank = t.dim() > 0 ? t.size(0) : 0;
        if (parsed->part == Part::kMagnitude || parsed->part == Part::kDoraScale) m.dora = true;
    }
    DTUNE_CHECK_AS(
        DataError, unmatched.empty(), file, ": ", unmatched.size(),
        " key(s) name no layer of the UNet:", joined(unmatched),
        "\n  the file must be an SDXL UNet LoRA in diffusers, PEFT or kohya (lora_unet_...) layout");
    std::vector<LoRAFileModule> out;
    for (auto& [name, m] : found) {
        DTUNE_CHECK_AS(DataError, m.rank > 0, file, ": module ", name,
                       " has no down (lora_A / lora_down) weight; the file is incomplete");
        out.push_back(m);
    }
    DTUNE_CHECK_AS(DataError, !out.empty(), file,
                   " holds no UNet LoRA weights (only text-encoder keys, or no LoRA keys at all)");
    return out;
}

namespace {

at::Tensor for_file(const at::Tensor& t, std::optional<c10::ScalarType> dtype) {
    at::Tensor out = t.detach().to(at::kCPU);
    return (dtype ? out.to(*dtype) : out).contiguous();
}

// r / lora_alpha for the whole file plus per-module patterns where a layer differs (PEFT's form).
nlohmann::json diffusers_metadata(const LoRAAdapters& adapters, const std::string& prefix) {
    const auto& first = *adapters.entries().front().layer;
    nlohmann::json rank_pattern = nlohmann::json::object(), alpha_pattern = nlohmann::json::object();
    for (const auto& e : adapters.entries()) {
        if (e.layer->rank() != first.rank()) rank_pattern[e.module] = e.layer->rank();
        if (e.layer->alpha() != first.alpha()) alpha_pattern[e.module] = e.layer->alpha();
    }
    const auto& c = adapters.config();
    nlohmann::json meta = {{prefix + ".r", first.rank()},
                           {prefix + ".lora_alpha", first.alpha()},
                           {prefix + ".use_dora", first.use_dora()},
                           {prefix + ".use_rslora", c.use_rslora},
                           // 0, not the training value: diffusers + PEFT leave the Dropout they inject
                           // in training mode after load_lora_weights, so a non-zero value would drop
                           // adapter activations at random in every generation (found by
                           // tools/ref/check_diffusers_exports.py). Dropout is training-only.
                           {prefix + ".lora_dropout", 0.0}};
    if (!c.target_regex.empty())
        meta[prefix + ".target_modules"] = c.target_regex;
    else
        meta[prefix + ".target_modules"] = c.target_modules;
    if (!rank_pattern.empty()) meta[prefix + ".rank_pattern"] = rank_pattern;
    if (!alpha_pattern.empty()) meta[prefix + ".alpha_pattern"] = alpha_pattern;
    return meta;
}

}  // namespace

void save_lora(const LoRAAdapters& adapters, const std::filesystem::path& file, LoRAFormat format,
               std::optional<c10::ScalarType> dtype, const std::string& prefix) {
    DTUNE_CHECK_AS(UsageError, adapters.size() > 0, "save_lora: no adapters to save to ", file.string());
    io::TensorList tensors;
    io::Metadata metadata{{"format", "pt"}};
    // kohya names exist for the UNet only; ComfyUI reads a transformer's LoRA under its diffusers
    // names (see the branch below).
    const bool kohya = format == LoRAFormat::kComfyUI && prefix == "unet";
    // One module of a ComfyUI file: the factors under `down` / `up`, kohya's `.alpha` (its scale is
    // alpha / r, so the alpha that gives this layer's scale), and DoRA's magnitudes as `.dora_scale`,
    // one per output channel: [out, 1(, 1, 1)].
    const auto comfyui_module = [&](LoRALayer& layer, const std::string& base, const char* down,
                                    const char* up) {
        tensors.emplace_back(base + down, for_file(layer.down(), dtype));
        tensors.emplace_back(base + up, for_file(layer.up(), dtype));
        tensors.emplace_back(
            base + ".alpha",
            at::scalar_tensor(layer.scale() * static_cast<double>(layer.rank()), at::kFloat));
        if (layer.use_dora()) {
            std::vector<int64_t> shape(layer.base_weight().dim(), 1);
            shape[0] = -1;
            tensors.emplace_back(base + ".dora_scale", for_file(layer.magnitude().reshape(shape), dtype));
        }
    };
    for (const auto& e : adapters.entries()) {
        LoRALayer& layer = *e.layer;
        if (format == LoRAFormat::kDiffusers) {
            // SDXL keeps diffusers' UNet names (.lora.down/.lora.up); other components are written
            // as diffusers' save_lora_weights writes them today, in PEFT's names (.lora_A/.lora_B).
            const std::string base = prefix + "." + e.module;
            const bool peft = prefix != "unet";
            tensors.emplace_back(base + (peft ? ".lora_A.weight" : ".lora.down.weight"),
                                 for_file(layer.down(), dtype));
            tensors.emplace_back(base + (peft ? ".lora_B.weight" : ".lora.up.weight"),
                                 for_file(layer.up(), dtype));
            if (layer.use_dora())
                tensors.emplace_back(base + ".lora_magnitude_vector", for_file(layer.magnitude(), dtype));
        } else if (!kohya) {
            // ComfyUI for a transformer (Flux), as SimpleTuner writes lora_format comfyui for it
            // (convert_diffusers_to_comfyui keeping the "transformer." prefix): PEFT's names under the
            // diffusers prefix plus a float32 `.alpha` per module. ComfyUI's Flux key map takes
            // "transformer.<diffusers module>" and points q, k and v at their rows of BFL's fused qkv
            // (and linear1) weight, so every projection keeps its own rank-r pair and the file applies
            // exactly. kohya's fused layout (lora_unet_double_blocks_0_img_attn_qkv) would need one
            // down matrix for q, k and v, which separate q/k/v LoRAs do not have (exact only at rank 3r
            // with a block-diagonal up). DoRA magnitudes go in ComfyUI's `.dora_scale` [out, 1].
            comfyui_module(layer, prefix + "." + e.module, ".lora_A.weight", ".lora_B.weight");
        } else {
            comfyui_module(layer, kohya_lora_name(e.module), ".lora_down.weight", ".lora_up.weight");
        }
    }
    if (format == LoRAFormat::kDiffusers) {
        metadata["lora_adapter_metadata"] = diffusers_metadata(adapters, prefix).dump();
    } else if (!kohya) {
        // The alphas are in the `.alpha` tensors. No lora_adapter_metadata beside them: diffusers'
        // load_lora_weights refuses a file with both, and without it loads this one too.
    } else {
        const auto& first = *adapters.entries().front().layer;
        metadata["ss_network_module"] = "networks.lora";
        metadata["ss_network_dim"] = std::to_string(first.rank());
        metadata["ss_network_alpha"] = str(first.scale() * static_cast<double>(first.rank()));
    }
    std::filesystem::create_directories(file.parent_path().empty() ? "." : file.parent_path());
    io::save_safetensors(file, tensors, metadata);
    log::info() << "LoRA: wrote " << adapters.size() << " modules to " << file.string() << " ("
                << (format == LoRAFormat::kDiffusers ? "diffusers" : "comfyui") << " layout)";
}

}  // namespace dtune::models
