// ldm single-file <-> diffusers key and tensor mapping (see ldm_keys.h for the layout).
#include "io/ldm_keys.h"

#include <ATen/ATen.h>

#include <cctype>
#include <map>
#include <set>

#include "core/error.h"

namespace dtune::io {
namespace {

bool starts_with(const std::string& s, const std::string& prefix) {
    return s.rfind(prefix, 0) == 0;
}

// Replaces a leading `from` with `to`; false when `s` does not start with `from`.
bool swap_prefix(const std::string& s, const std::string& from, const std::string& to, std::string& out) {
    if (!starts_with(s, from)) return false;
    out = to + s.substr(from.size());
    return true;
}

// Splits "a.12.b" after `head` ("a.") into the number 12 and the rest "b"; false when not numeric.
bool take_index(const std::string& s, std::size_t at, int& index, std::string& rest) {
    std::size_t end = at;
    while (end < s.size() && std::isdigit(static_cast<unsigned char>(s[end]))) ++end;
    if (end == at || end >= s.size() || s[end] != '.') return false;
    index = std::stoi(s.substr(at, end - at));
    rest = s.substr(end + 1);
    return true;
}

// Table-driven prefix renames: the first matching pair wins.
using Renames = std::vector<std::pair<std::string, std::string>>;
std::string rename_first(const std::string& s, const Renames& table, bool reverse) {
    std::string out;
    for (const auto& [a, b] : table)
        if (swap_prefix(s, reverse ? b : a, reverse ? a : b, out)) return out;
    return "";
}

const Renames kUNetTop = {{"time_embed.0.", "time_embedding.linear_1."},
                          {"time_embed.2.", "time_embedding.linear_2."},
                          {"input_blocks.0.0.", "conv_in."},
                          {"out.0.", "conv_norm_out."},
                          {"out.2.", "conv_out."},
                          {"label_emb.0.0.", "add_embedding.linear_1."},
                          {"label_emb.0.2.", "add_embedding.linear_2."}};
const Renames kUNetResnet = {{"in_layers.0.", "norm1."},          {"in_layers.2.", "conv1."},
                             {"out_layers.0.", "norm2."},         {"out_layers.3.", "conv2."},
                             {"emb_layers.1.", "time_emb_proj."}, {"skip_connection.", "conv_shortcut."}};
const Renames kVaeTop = {{"encoder.norm_out.", "encoder.conv_norm_out."},
                         {"decoder.norm_out.", "decoder.conv_norm_out."},
                         {"encoder.conv_in.", "encoder.conv_in."},
                         {"encoder.conv_out.", "encoder.conv_out."},
                         {"decoder.conv_in.", "decoder.conv_in."},
                         {"decoder.conv_out.", "decoder.conv_out."},
                         {"quant_conv.", "quant_conv."},
                         {"post_quant_conv.", "post_quant_conv."}};
const Renames kVaeResnet = {{"norm1.", "norm1."},
                            {"conv1.", "conv1."},
                            {"norm2.", "norm2."},
                            {"conv2.", "conv2."},
                            {"nin_shortcut.", "conv_shortcut."}};
const Renames kVaeAttention = {
    {"norm.", "group_norm."}, {"q.", "to_q."}, {"k.", "to_k."}, {"v.", "to_v."}, {"proj_out.", "to_out.0."}};
const Renames kOpenClipTop = {{"positional_embedding", "text_model.embeddings.position_embedding.weight"},
                              {"token_embedding.", "text_model.embeddings.token_embedding."},
                              {"ln_final.", "text_model.final_layer_norm."},
                              {"text_projection", "text_projection.weight"}};
const Renames kOpenClipLayer = {{"ln_1.", "layer_norm1."},
                                {"ln_2.", "layer_norm2."},
                                {"mlp.c_fc.", "mlp.fc1."},
                                {"mlp.c_proj.", "mlp.fc2."},
                                {"attn.out_proj.", "self_attn.out_proj."}};

std::string with_inner(const std::string& head, const std::string& rest, const Renames& inner, bool reverse) {
    const std::string r = rename_first(rest, inner, reverse);
    return r.empty() ? "" : head + r;
}

}  // namespace

const char* ldm_prefix(LdmComponent c) {
    switch (c) {
        case LdmComponent::kUNet: return "model.diffusion_model.";
        case LdmComponent::kVAE: return "first_stage_model.";
        case LdmComponent::kTextEncoder: return "conditioner.embedders.0.transformer.";
        case LdmComponent::kTextEncoder2: return "conditioner.embedders.1.model.";
    }
    return "";
}

const char* ldm_component_name(LdmComponent c) {
    switch (c) {
        case LdmComponent::kUNet: return "unet";
        case LdmComponent::kVAE: return "vae";
        case LdmComponent::kTextEncoder: return "text_encoder";
        case LdmComponent::kTextEncoder2: return "text_encoder_2";
    }
    return "";
}

bool is_ldm_sdxl_checkpoint(const std::vector<std::string>& keys) {
    bool unet = false, te1 = false, te2 = false;
    for (const auto& k : keys) {
        unet = unet || starts_with(k, ldm_prefix(LdmComponent::kUNet));
        te1 = te1 || starts_with(k, ldm_prefix(LdmComponent::kTextEncoder));
        te2 = te2 || starts_with(k, ldm_prefix(LdmComponent::kTextEncoder2));
    }
    return unet && te1 && te2;
}

std::string ldm_unet_key_to_diffusers(const std::string& key, int lpb) {
    if (std::string top = rename_first(key, kUNetTop, false); !top.empty()) return top;
    int i = 0, j = 0;
    std::string rest, inner;
    const auto block = [&](const char* head, bool down) {
        return take_index(key, std::string(head).size(), i, rest) && take_index(rest, 0, j, inner) &&
               (!down || i >= 1);
    };
    if (block("input_blocks.", true)) {
        const int b = (i - 1) / (lpb + 1), layer = (i - 1) % (lpb + 1);
        const std::string blk = "down_blocks." + std::to_string(b);
        if (layer == lpb) {  // the downsampler slot
            std::string out;
            return j == 0 && swap_prefix(inner, "op.", blk + ".downsamplers.0.conv.", out) ? out : "";
        }
        if (j == 0)
            return with_inner(blk + ".resnets." + std::to_string(layer) + ".", inner, kUNetResnet, false);
        if (j == 1) return blk + ".attentions." + std::to_string(layer) + "." + inner;
        return "";
    }
    if (starts_with(key, "middle_block.") && take_index(key, 13, j, inner)) {
        if (j == 1) return "mid_block.attentions.0." + inner;
        if (j == 0 || j == 2)
            return with_inner("mid_block.resnets." + std::to_string(j / 2) + ".", inner, kUNetResnet, false);
        return "";
    }
    if (block("output_blocks.", false)) {
        const int b = i / (lpb + 1), layer = i % (lpb + 1);
        const std::string blk = "up_blocks." + std::to_string(b);
        std::string out;
        if (j == 0)
            return with_inner(blk + ".resnets." + std::to_string(layer) + ".", inner, kUNetResnet, false);
        if ((j == 1 || j == 2) && swap_prefix(inner, "conv.", blk + ".upsamplers.0.conv.", out)) return out;
        if (j == 1) return blk + ".attentions." + std::to_string(layer) + "." + inner;
    }
    return "";
}

std::string diffusers_unet_key_to_ldm(const std::string& key, int lpb,
                                      const std::set<int>& up_blocks_with_attention) {
    if (std::string top = rename_first(key, kUNetTop, true); !top.empty()) return top;
    int b = 0, l = 0;
    std::string rest, inner, out;
    const auto two = [&](const std::string& head, const std::string& mid) {  // "<head>B.<mid>L.inner"
        return starts_with(key, head) && take_index(key, head.size(), b, rest) && starts_with(rest, mid) &&
               take_index(rest, mid.size(), l, inner);
    };
    const auto n = [](int v) { return std::to_string(v); };
    if (two("down_blocks.", "resnets."))
        return with_inner("input_blocks." + n(b * (lpb + 1) + l + 1) + ".0.", inner, kUNetResnet, true);
    if (two("down_blocks.", "attentions.")) return "input_blocks." + n(b * (lpb + 1) + l + 1) + ".1." + inner;
    if (two("down_blocks.", "downsamplers.") && l == 0 && swap_prefix(inner, "conv.", "", out))
        return "input_blocks." + n(b * (lpb + 1) + lpb + 1) + ".0.op." + out;
    if (two("up_blocks.", "resnets."))
        return with_inner("output_blocks." + n(b * (lpb + 1) + l) + ".0.", inner, kUNetResnet, true);
    if (two("up_blocks.", "attentions.")) return "output_blocks." + n(b * (lpb + 1) + l) + ".1." + inner;
    if (two("up_blocks.", "upsamplers.") && l == 0 && swap_prefix(inner, "conv.", "", out))
        return "output_blocks." + n(b * (lpb + 1) + lpb) +
               (up_blocks_with_attention.count(b) ? ".2.conv." : ".1.conv.") + out;
    if (starts_with(key, "mid_block.attentions.0.")) return "middle_block.1." + key.substr(23);
    if (starts_with(key, "mid_block.resnets.") && take_index(key, 18, l, inner) && l <= 1)
        return with_inner("middle_block." + n(2 * l) + ".", inner, kUNetResnet, true);
    return "";
}

std::string ldm_vae_key_to_diffusers(const std::string& key, int num_blocks) {
    if (std::string top = rename_first(key, kVaeTop, false); !top.empty()) return top;
    const std::string side = starts_with(key, "encoder.")   ? "encoder."
                             : starts_with(key, "decoder.") ? "decoder."
                                                            : "";
    if (side.empty()) return "";
    const std::string k = key.substr(side.size());
    int i = 0, j = 0;
    std::string rest, inner, out;
    if (starts_with(k, "mid.block_") && take_index(k, 10, i, inner) && (i == 1 || i == 2))
        return with_inner(side + "mid_block.resnets." + std::to_string(i - 1) + ".", inner, kVaeResnet,
                          false);
    if (swap_prefix(k, "mid.attn_1.", "", rest))
        return with_inner(side + "mid_block.attentions.0.", rest, kVaeAttention, false);
    const bool down = side == "encoder.";
    const std::string level = down ? "down." : "up.";
    if (!starts_with(k, level) || !take_index(k, level.size(), i, rest) || i >= num_blocks) return "";
    const int d = down ? i : num_blocks - 1 - i;  // the decoder's ldm levels count from the bottom
    const std::string blk = side + (down ? "down_blocks." : "up_blocks.") + std::to_string(d);
    if (starts_with(rest, "block.") && take_index(rest, 6, j, inner))
        return with_inner(blk + ".resnets." + std::to_string(j) + ".", inner, kVaeResnet, false);
    if (swap_prefix(rest, down ? "downsample.conv." : "upsample.conv.",
                    blk + (down ? ".downsamplers.0.conv." : ".upsamplers.0.conv."), out))
        return out;
    return "";
}

std::string diffusers_vae_key_to_ldm(const std::string& key, int num_blocks) {
    if (std::string top = rename_first(key, kVaeTop, true); !top.empty()) return top;
    const std::string side = starts_with(key, "encoder.")   ? "encoder."
                             : starts_with(key, "decoder.") ? "decoder."
                                                            : "";
    if (side.empty()) return "";
    const std::string k = key.substr(side.size());
    int i = 0, j = 0;
    std::string rest, inner, out;
    if (starts_with(k, "mid_block.resnets.") && take_index(k, 18, i, inner) && i <= 1)
        return with_inner(side + "mid.block_" + std::to_string(i + 1) + ".", inner, kVaeResnet, true);
    if (swap_prefix(k, "mid_block.attentions.0.", "", rest))
        return with_inner(side + "mid.attn_1.", rest, kVaeAttention, true);
    const bool down = side == "encoder.";
    const std::string level = down ? "down_blocks." : "up_blocks.";
    if (!starts_with(k, level) || !take_index(k, level.size(), i, rest) || i >= num_blocks) return "";
    const int d = down ? i : num_blocks - 1 - i;
    const std::string blk = side + (down ? "down." : "up.") + std::to_string(d);
    if (starts_with(rest, "resnets.") && take_index(rest, 8, j, inner))
        return with_inner(blk + ".block." + std::to_string(j) + ".", inner, kVaeResnet, true);
    if (swap_prefix(rest, down ? "downsamplers.0.conv." : "upsamplers.0.conv.",
                    blk + (down ? ".downsample.conv." : ".upsample.conv."), out))
        return out;
    return "";
}

std::string open_clip_key_to_transformers(const std::string& key) {
    if (std::string top = rename_first(key, kOpenClipTop, false); !top.empty()) return top;
    int i = 0;
    std::string rest;
    if (!starts_with(key, "transformer.resblocks.") || !take_index(key, 22, i, rest)) return "";
    return with_inner("text_model.encoder.layers." + std::to_string(i) + ".", rest, kOpenClipLayer, false);
}

std::string transformers_key_to_open_clip(const std::string& key) {
    if (std::string top = rename_first(key, kOpenClipTop, true); !top.empty()) return top;
    int i = 0;
    std::string rest;
    if (!starts_with(key, "text_model.encoder.layers.") || !take_index(key, 26, i, rest)) return "";
    return with_inner("transformer.resblocks." + std::to_string(i) + ".", rest, kOpenClipLayer, true);
}

namespace {

// transformers >= 5 saves CLIPTextModel keys without "text_model."; the ldm file always has it.
std::string clip_with_text_model_prefix(const std::string& key) {
    if (starts_with(key, "text_model.") || starts_with(key, "text_projection")) return key;
    return "text_model." + key;
}

bool is_vae_attention_projection(const std::string& diffusers_key) {
    return diffusers_key.find("mid_block.attentions.0.to_") != std::string::npos &&
           diffusers_key.ends_with(".weight");
}

std::set<int> up_blocks_with_attention(const TensorList& tensors) {
    std::set<int> out;
    int b = 0;
    std::string rest;
    for (const auto& [k, v] : tensors)
        if (starts_with(k, "up_blocks.") && take_index(k, 10, b, rest) && starts_with(rest, "attentions."))
            out.insert(b);
    return out;
}

// OpenCLIP's fused attention input projection -> q/k/v (rows in that order).
void split_in_proj(const std::string& layer, const std::string& kind, const at::Tensor& fused,
                   TensorList& out) {
    DTUNE_CHECK_AS(DataError, fused.size(0) % 3 == 0, "OpenCLIP ", layer, "attn.in_proj_", kind, " has ",
                   fused.size(0), " rows, not a multiple of 3; the single-file checkpoint is corrupt");
    const auto chunks = fused.chunk(3, 0);  // 3 x [D(, D)]
    const char* names[] = {"q_proj", "k_proj", "v_proj"};
    for (int i = 0; i < 3; ++i) out.emplace_back(layer + "self_attn." + names[i] + "." + kind, chunks[i]);
}

}  // namespace

std::optional<std::string> ldm_vae_prefix(const std::vector<std::string>& keys) {
    const std::set<std::string> all(keys.begin(), keys.end());
    for (const char* prefix : {"first_stage_model.", "vae.", ""})
        if (all.count(std::string(prefix) + "decoder.mid.block_1.conv1.weight")) return std::string(prefix);
    return std::nullopt;
}

TensorList ldm_to_diffusers(const WeightSource& file, LdmComponent component, const LdmLayout& layout) {
    const std::string prefix = component == LdmComponent::kVAE
                                   ? ldm_vae_prefix(file.keys()).value_or(ldm_prefix(component))
                                   : std::string(ldm_prefix(component));
    TensorList out;
    std::vector<std::string> unknown;
    for (const std::string& full : file.keys()) {
        if (!starts_with(full, prefix)) continue;
        const std::string key = full.substr(prefix.size());
        at::Tensor value = file.get(full);
        std::string name;
        switch (component) {
            case LdmComponent::kUNet:
                name = ldm_unet_key_to_diffusers(key, layout.unet_layers_per_block);
                break;
            case LdmComponent::kVAE:
                name = ldm_vae_key_to_diffusers(key, layout.vae_num_blocks);
                if (is_vae_attention_projection(name) && value.dim() == 4)
                    value = value.flatten(1);  // [C, C]
                break;
            case LdmComponent::kTextEncoder:
                name = key.ends_with("position_ids") ? "" : clip_with_text_model_prefix(key);
                if (name.empty()) continue;
                break;
            case LdmComponent::kTextEncoder2: {
                if (key == "logit_scale") continue;  // OpenCLIP's contrastive temperature, unused
                int i = 0;
                std::string rest;
                if (starts_with(key, "transformer.resblocks.") && take_index(key, 22, i, rest) &&
                    starts_with(rest, "attn.in_proj_")) {
                    const std::string layer = "text_model.encoder.layers." + std::to_string(i) + ".";
                    split_in_proj(layer, rest == "attn.in_proj_weight" ? "weight" : "bias", value, out);
                    continue;
                }
                name = open_clip_key_to_transformers(key);
                if (key == "text_projection") value = value.t();  // [D, P] -> [P, D]
                break;
            }
        }
        if (name.empty()) {
            unknown.push_back(full);
            continue;
        }
        out.emplace_back(name, value);
    }
    DTUNE_CHECK_AS(DataError, unknown.empty(), "single-file checkpoint ", file.files().front().string(), ": ",
                   unknown.size(), " ", ldm_component_name(component),
                   " key(s) have no diffusers name, first: ", unknown.empty() ? "" : unknown.front(),
                   "; this is not an SDXL ldm checkpoint (or a variant dtune does not map yet)");
    DTUNE_CHECK_AS(DataError, !out.empty(), "single-file checkpoint ", file.files().front().string(),
                   " has no ", ldm_component_name(component), " (no key starts with \"", prefix,
                   "\"); load that component from a diffusers folder instead");
    return out;
}

TensorList diffusers_to_ldm(const TensorList& tensors, LdmComponent component, const LdmLayout& layout) {
    const std::string prefix = ldm_prefix(component);
    const std::set<int> up_attention = up_blocks_with_attention(tensors);
    std::map<std::string, std::map<std::string, at::Tensor>> qkv;  // layer -> "q_proj.weight" -> tensor
    TensorList out;
    for (const auto& [key, v] : tensors) {
        at::Tensor value = v;
        std::string name;
        switch (component) {
            case LdmComponent::kUNet:
                name = diffusers_unet_key_to_ldm(key, layout.unet_layers_per_block, up_attention);
                break;
            case LdmComponent::kVAE:
                name = diffusers_vae_key_to_ldm(key, layout.vae_num_blocks);
                if (is_vae_attention_projection(key) && value.dim() == 2)
                    value = value.view({value.size(0), -1, 1, 1});
                break;
            case LdmComponent::kTextEncoder:
                name = key.ends_with("position_ids") ? "" : clip_with_text_model_prefix(key);
                if (name.empty()) continue;
                break;
            case LdmComponent::kTextEncoder2: {
                const auto at = key.find(".self_attn.");
                const std::string tail = at == std::string::npos ? "" : key.substr(at + 11);
                if (tail.size() > 7 && (starts_with(tail, "q_proj.") || starts_with(tail, "k_proj.") ||
                                        starts_with(tail, "v_proj."))) {
                    qkv[key.substr(0, at + 1)][tail] = value;
                    continue;
                }
                name = transformers_key_to_open_clip(key);
                if (key == "text_projection.weight") value = value.t().contiguous();  // [P, D] -> [D, P]
                break;
            }
        }
        DTUNE_CHECK_AS(UsageError, !name.empty(), ldm_component_name(component), " key \"", key,
                       "\" has no ldm single-file name; only SDXL components can be exported this way");
        out.emplace_back(prefix + name, value);
    }
    for (const auto& [layer, parts] : qkv) {
        const std::string ldm_layer =
            prefix + transformers_key_to_open_clip(layer + "self_attn.out_proj.weight");
        const std::string base =
            ldm_layer.substr(0, ldm_layer.size() - std::string("out_proj.weight").size());
        for (const char* kind : {"weight", "bias"}) {
            const std::string k = kind;
            DTUNE_CHECK_AS(
                UsageError,
                parts.count("q_proj." + k) && parts.count("k_proj." + k) && parts.count("v_proj." + k), layer,
                "self_attn lacks one of q/k/v_proj.", k, "; cannot fuse OpenCLIP's in_proj_", k);
            out.emplace_back(
                base + "in_proj_" + k,
                at::cat({parts.at("q_proj." + k), parts.at("k_proj." + k), parts.at("v_proj." + k)}, 0));
        }
    }
    return out;
}

}  // namespace dtune::io
