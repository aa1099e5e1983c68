// Flux LoRA key layouts (see flux_lora.h).
#include "models/flux/flux_lora.h"

#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "models/common/weights.h"

namespace dtune::models {
namespace {

// Top-level layer names of BFL's checkpoint as BFL keys spell them (kohya's put '_' for '.').
const char* const kBflTops[] = {"double_blocks.", "single_blocks.", "img_in.",      "txt_in.",
                                "time_in.",       "vector_in.",     "guidance_in.", "final_layer."};
// Top-level layer names of diffusers' FluxTransformer2DModel.
const char* const kDiffusersTops[] = {"transformer_blocks.",
                                      "single_transformer_blocks.",
                                      "x_embedder.",
                                      "context_embedder.",
                                      "time_text_embed.",
                                      "norm_out.",
                                      "proj_out."};
const char* const kBflPrefixes[] = {"model.diffusion_model.", "diffusion_model."};

enum class Part { kDown, kUp, kAlpha };
const std::pair<const char*, Part> kSuffixes[] = {{".lora_down.weight", Part::kDown},
                                                  {".lora_up.weight", Part::kUp},
                                                  {".lora_A.weight", Part::kDown},
                                                  {".lora_B.weight", Part::kUp},
                                                  {".alpha", Part::kAlpha}};

bool starts_with(const std::string& s, const std::string& p) {
    return s.rfind(p, 0) == 0;
}

bool is_text_encoder_key(const std::string& key) {
    return starts_with(key, "lora_te") || starts_with(key, "text_encoders.") ||
           starts_with(key, "text_encoder.") || starts_with(key, "text_encoder_2.");
}

// "double_blocks.0.img_attn.qkv" -> "double_blocks_0_img_attn_qkv" (kohya's name without lora_unet_).
std::string kohya_name(const std::string& bfl) {
    std::string out = bfl;
    for (char& c : out)
        if (c == '.') c = '_';
    return out;
}

std::string strip_bfl_prefix(const std::string& key) {
    for (const char* prefix : kBflPrefixes)
        if (starts_with(key, prefix)) return key.substr(std::string(prefix).size());
    return key;
}

// (layer name, part) of a key once its layout prefix is gone; nullopt for an unknown suffix.
std::optional<std::pair<std::string, Part>> split_suffix(const std::string& rest) {
    for (const auto& [suffix, part] : kSuffixes)
        if (rest.size() > std::string(suffix).size() && rest.ends_with(suffix))
            return std::pair{rest.substr(0, rest.size() - std::string(suffix).size()), part};
    return std::nullopt;
}

std::string listed(const std::vector<std::string>& keys) {
    std::string out;
    for (std::size_t i = 0; i < keys.size() && i < 12; ++i) out += "\n    " + keys[i];
    if (keys.size() > 12) out += str("\n    ... and ", keys.size() - 12, " more");
    return out;
}

struct LayerTensors {
    at::Tensor down, up, alpha;
    std::string down_key, up_key, alpha_key;  // the file's keys, for messages
};

// Checks one BFL layer's factors against the transformer and appends its diffusers-layout tensors.
void convert_layer(const FluxBflLinear& layer, const LayerTensors& t, const std::string& origin,
                   io::TensorList& out) {
    DTUNE_CHECK_AS(DataError, t.down.defined() && t.up.defined(), origin, ": layer ", layer.bfl, " has ",
                   t.down.defined() ? str("a down matrix (", t.down_key, ") but no up (lora_up / lora_B)")
                                    : str("an up matrix (", t.up_key, ") but no down (lora_down / lora_A)"),
                   " weight; the file is incomplete: use another copy of it");
    const int64_t rank = t.down.dim() == 2 ? t.down.size(0) : -1;
    DTUNE_CHECK_AS(DataError,
                   t.down.dim() == 2 && t.up.dim() == 2 && t.up.size(1) == rank &&
                       t.down.size(1) == layer.in_features && t.up.size(0) == layer.out_features(),
                   origin, ": ", t.down_key, " ", t.down.sizes(), " / ", t.up_key, " ", t.up.sizes(),
                   " do not fit this transformer's ", layer.bfl, " (", layer.in_features, " inputs, ",
                   layer.out_features(), " outputs; down must be [rank, ", layer.in_features, "], up [",
                   layer.out_features(),
                   ", rank]): the LoRA was made for another model; pass one trained on this "
                   "Flux model");
    double alpha = static_cast<double>(rank);
    if (t.alpha.defined()) {
        DTUNE_CHECK_AS(DataError, t.alpha.numel() == 1, origin, ": ", t.alpha_key, " has ", t.alpha.numel(),
                       " values; a LoRA alpha is one number: fix or re-export the file");
        alpha = t.alpha.to(at::kDouble).item<double>();
        DTUNE_CHECK_AS(DataError, std::isfinite(alpha) && alpha > 0, origin, ": ", t.alpha_key, " is ", alpha,
                       "; a LoRA alpha must be a positive finite number (kohya files store the rank or the "
                       "training's network_alpha there): fix or re-export the file");
    }
    at::Tensor up = t.up;
    if (layer.swap_halves) {  // BFL's (shift, scale) rows -> diffusers' (scale, shift)
        const auto halves = up.chunk(2, 0);
        up = at::cat({halves[1], halves[0]}, 0);
    }
    int64_t lo = 0;
    for (const auto& [name, rows] : layer.parts) {
        const std::string base = "transformer." + name;
        out.emplace_back(base + ".lora_A.weight", t.down);
        out.emplace_back(base + ".lora_B.weight", up.narrow(0, lo, rows));
        if (t.alpha.defined()) out.emplace_back(base + ".alpha", at::scalar_tensor(alpha, at::kFloat));
        lo += rows;
    }
}

LoRATensors convert(const LoRATensors& file, FluxLoRALayout layout, const FluxTransformerConfig& config) {
    std::map<std::string, const FluxBflLinear*> layers;  // by the layer's name in this layout
    const std::vector<FluxBflLinear> table = flux_bfl_linear_layers(config);
    for (const FluxBflLinear& l : table)
        layers[layout == FluxLoRALayout::kKohya ? kohya_name(l.bfl) : l.bfl] = &l;
    std::map<std::string, LayerTensors> found;
    std::vector<std::string> unknown, refused;
    std::vector<at::Tensor> values;
    std::vector<std::string> value_keys;
    std::size_t text_encoder = 0;
    for (const auto& [key, tensor] : file.tensors) {
        if (is_text_encoder_key(key)) {
            ++text_encoder;
            continue;
        }
        std::string rest = key;
        if (layout == FluxLoRALayout::kKohya)
            rest = starts_with(key, "lora_unet_") ? key.substr(10) : "";
        else
            rest = strip_bfl_prefix(key);
        const auto split = split_suffix(rest);
        if (!split) {
            const bool dora_or_diff = key.ends_with(".dora_scale") || key.ends_with(".diff") ||
                                      key.ends_with(".diff_b") || key.ends_with(".bias");
            (dora_or_diff ? refused : unknown).push_back(key);
            continue;
        }
        const auto it = layers.find(split->first);
        if (it == layers.end()) {
            unknown.push_back(key);
            continue;
        }
        LayerTensors& t = found[it->second->bfl];
        at::Tensor& slot = split->second == Part::kDown ? t.down
                           : split->second == Part::kUp ? t.up
                                                        : t.alpha;
        std::string& slot_key = split->second == Part::kDown ? t.down_key
                                : split->second == Part::kUp ? t.up_key
                                                             : t.alpha_key;
        slot = tensor;
        slot_key = key;
        values.push_back(tensor);
        value_keys.push_back(key);
    }
    const char* example = layout == FluxLoRALayout::kKohya
                              ? "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"
                              : "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight";
    DTUNE_CHECK_AS(
        DataError, refused.empty(), file.origin, ": ", refused.size(),
        " key(s) hold DoRA magnitudes, full-weight or bias differences, which dtune does not read in ",
        flux_lora_layout_name(layout), " Flux LoRAs:", listed(refused),
        "\n  use a plain LoRA (down/up matrices and alphas only), or convert it to diffusers' layout");
    DTUNE_CHECK_AS(DataError, unknown.empty(), file.origin, ": ", unknown.size(),
                   " key(s) name no LoRA layer of this Flux transformer (", config.num_layers, " double + ",
                   config.num_single_layers, " single blocks",
                   config.guidance_embeds ? ", guidance embedding" : ", no guidance embedding",
                   "):", listed(unknown), "\n  ", flux_lora_layout_name(layout), " keys look like '", example,
                   "'; check that the LoRA was made for this Flux model");
    DTUNE_CHECK_AS(
        DataError, !found.empty(), file.origin,
        " holds no transformer LoRA weights (only text-encoder keys); dtune adapts the transformer only");
    const int64_t bad = first_non_finite(values);
    DTUNE_CHECK_AS(DataError, bad < 0, file.origin, ": tensor '",
                   bad < 0 ? "" : value_keys[static_cast<std::size_t>(bad)],
                   "' holds NaN or infinite values; the LoRA is damaged: use another copy of it");
    if (text_encoder > 0)
        log::warn() << file.origin << ": skipped " << text_encoder
                    << " text-encoder LoRA tensors (only the transformer is adapted)";
    LoRATensors out{file.origin, {}, {}, flux_lora_layout_name(layout)};
    for (const FluxBflLinear& l : table)  // the table's order: embedders, then blocks
        if (const auto it = found.find(l.bfl); it != found.end())
            convert_layer(l, it->second, file.origin, out.tensors);
    return out;
}

}  // namespace

const char* flux_lora_layout_name(FluxLoRALayout layout) {
    switch (layout) {
        case FluxLoRALayout::kDiffusers: return "diffusers/PEFT";
        case FluxLoRALayout::kKohya: return "kohya/ComfyUI";
        case FluxLoRALayout::kBlackForestLabs: return "Black Forest Labs";
    }
    return "";
}

std::optional<FluxLoRALayout> flux_lora_layout(const std::vector<std::string>& keys) {
    bool kohya = false, bfl = false, diffusers = false;
    for (const std::string& key : keys) {
        if (is_text_encoder_key(key)) continue;
        const std::string bare = strip_bfl_prefix(key);
        for (const char* top : kBflTops) {
            // kohya: "lora_unet_img_in.lora_down.weight", "lora_unet_double_blocks_0_...".
            const std::string name = kohya_name(top).substr(0, std::string(top).size() - 1);
            const std::size_t n = 10 + name.size();
            kohya |=
                starts_with(key, "lora_unet_" + name) && key.size() > n && (key[n] == '_' || key[n] == '.');
            bfl |= starts_with(bare, top) && split_suffix(bare).has_value();
        }
        std::string rest = key;
        for (const char* prefix : {"transformer.", "base_model.model."})
            if (starts_with(rest, prefix)) rest = rest.substr(std::string(prefix).size());
        for (const char* top : kDiffusersTops) diffusers |= starts_with(rest, top);
    }
    if (kohya) return FluxLoRALayout::kKohya;
    if (bfl) return FluxLoRALayout::kBlackForestLabs;
    if (diffusers) return FluxLoRALayout::kDiffusers;
    return std::nullopt;
}

FluxLoRA read_flux_lora(const std::filesystem::path& file, const FluxTransformerConfig& config) {
    LoRATensors lora = LoRATensors::read(file);
    std::vector<std::string> keys;
    for (const auto& kv : lora.tensors) keys.push_back(kv.first);
    const auto layout = flux_lora_layout(keys);
    DTUNE_CHECK_AS(
        DataError, layout.has_value(), file.string(),
        " is not a Flux LoRA in a layout dtune reads (its first key: '",
        keys.empty() ? std::string("none, the file is empty") : keys.front(),
        "'). Flux LoRA keys look like 'transformer.transformer_blocks.0.attn.to_q.lora_A.weight' "
        "(diffusers/PEFT), 'lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight' (kohya/ComfyUI) "
        "or 'diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight' (Black Forest Labs); an SDXL "
        "LoRA (lora_unet_down_blocks_..., unet....) does not fit Flux");
    if (*layout == FluxLoRALayout::kDiffusers) return {*layout, std::move(lora)};
    return {*layout, convert(lora, *layout, config)};
}

}  // namespace dtune::models
