// `dtune inspect <path>`: what a weights file (or sharded set, or folder) holds.
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <string>

#include "cli/command.h"
#include "core/error.h"
#include "io/ldm_keys.h"
#include "io/safetensors.h"
#include "models/clip/clip_text_model.h"
#include "models/common/pipeline_folder.h"
#include "models/flux/flux_lora.h"
#include "models/flux/flux_transformer.h"

namespace dtune::cli {
namespace {

std::string human_bytes(double bytes) {
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (bytes >= 1024 && u < 4) {
        bytes /= 1024;
        ++u;
    }
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f %s", bytes, units[u]);
    return buf;
}

struct WeightsSummary {
    uint64_t tensors = 0, params = 0, bytes = 0;
    std::map<std::string, std::pair<uint64_t, uint64_t>> by_dtype;  // dtype -> (tensors, elements)
};

// Counts over the keys that start with `prefix` (all keys for "").
WeightsSummary summarize(const io::WeightSource& src, const std::string& prefix = "") {
    WeightsSummary s;
    for (const auto& key : src.keys()) {
        if (key.rfind(prefix, 0) != 0) continue;
        const auto& info = src.info(key);
        auto& row = s.by_dtype[io::st_dtype_name(info.dtype)];
        row.first++;
        row.second += info.numel();
        s.tensors++;
        s.params += info.numel();
        s.bytes += info.nbytes();
    }
    return s;
}

std::string dtypes_of(const WeightsSummary& s) {
    std::string out;
    for (const auto& [dtype, row] : s.by_dtype) out += (out.empty() ? "" : ",") + dtype;
    return out;
}

void print_row(const std::string& name, const WeightsSummary& s) {
    std::printf("  %-16s %6llu tensors %15llu params  %10s  %s\n", name.c_str(),
                static_cast<unsigned long long>(s.tensors), static_cast<unsigned long long>(s.params),
                human_bytes(static_cast<double>(s.bytes)).c_str(), dtypes_of(s).c_str());
}

// The LoRA rank of a file whose keys carry lora down/A matrices (0 when it is no LoRA file).
int64_t lora_rank(const io::WeightSource& src) {
    for (const auto& key : src.keys()) {
        if (key.find("lora_down.weight") != std::string::npos ||
            key.find("lora.down.weight") != std::string::npos ||
            key.find("lora_A.weight") != std::string::npos)
            return src.info(key).shape.empty() ? 0 : src.info(key).shape[0];
    }
    return 0;
}

// Black Forest Labs' Flux transformer keys, bare or under ComfyUI's prefix.
bool is_flux_transformer(const io::WeightSource& src) {
    for (const auto& k : src.keys())
        if (k.rfind("double_blocks.", 0) == 0 || k.rfind("model.diffusion_model.double_blocks.", 0) == 0)
            return true;
    return false;
}

// Where the file holds a CLIP text encoder; nullopt also when it holds several (inspect describes,
// it does not pick one).
std::optional<std::string> clip_prefix(const io::WeightSource& src, const std::string& path) {
    try {
        return models::clip_text_file_prefix(src.keys(), path);
    } catch (const DataError&) {
        return std::nullopt;
    }
}

// A CLIP text encoder on its own (ComfyUI's clip_l.safetensors): its layers and width.
void print_clip_file(const io::WeightSource& src, const std::string& prefix) {
    const std::string text = src.contains(prefix + "text_model.embeddings.token_embedding.weight")
                                 ? prefix + "text_model."
                                 : prefix;
    int layers = 0;
    while (src.contains(str(text, "encoder.layers.", layers, ".self_attn.q_proj.weight"))) ++layers;
    const std::string embedding = text + "embeddings.token_embedding.weight";
    const int64_t width = src.contains(embedding) ? src.info(embedding).shape.at(1) : 0;
    const std::string where = text.empty() ? "without a prefix" : "under '" + text + "'";
    const char* role = layers == 12 && width == 768
                           ? " (CLIP-L: Flux's text_encoder, dtune sample --text_encoder_file)"
                           : "";
    std::printf("  CLIP text encoder single file (transformers' keys %s): %d layers, %lld wide%s\n",
                where.c_str(), layers, static_cast<long long>(width), role);
}

// An ldm-layout VAE on its own or inside a checkpoint: its latent channels and quant convs.
void print_vae_file(const io::WeightSource& src, const std::string& prefix) {
    const auto& conv_in = src.info(prefix + "decoder.conv_in.weight");
    const int64_t channels = conv_in.shape.size() == 4 ? conv_in.shape[1] : 0;
    const bool quant = src.contains(prefix + "quant_conv.weight");
    const std::string where = prefix.empty() ? "no prefix" : "prefix '" + prefix + "'";
    const char* role = channels == 16 && !quant
                           ? " (Flux.1's VAE, as Black Forest Labs' ae.safetensors: dtune sample --vae_file)"
                       : channels == 4 ? " (an SD / SDXL VAE)"
                                       : "";
    std::printf("  VAE single file (ldm layout, %s): %lld latent channels, %s%s\n", where.c_str(),
                static_cast<long long>(channels), quant ? "quant convs" : "no quant convs", role);
}

int inspect_pipeline(const std::filesystem::path& root) {
    const auto pipeline = models::PipelineFolder::open(root);
    std::printf("%s\n  diffusers pipeline: %s\n", root.string().c_str(), pipeline.class_name().c_str());
    uint64_t total = 0;
    for (const auto& name : pipeline.component_names()) {
        const auto& c = pipeline.component(name);
        bool has_weights = false;
        for (const auto& e : std::filesystem::directory_iterator(c.path))
            has_weights |=
                e.path().string().ends_with(".safetensors") || e.path().string().ends_with(".index.json");
        if (!has_weights) {
            std::printf("  %-16s %s (no weights)\n", name.c_str(), c.class_name.c_str());
            continue;
        }
        const auto s = summarize(io::WeightSource::open(c.path));
        total += s.params;
        print_row(name + " ", s);
        std::printf("  %-16s   %s\n", "", c.class_name.c_str());
    }
    std::printf("  total parameters: %llu\n", static_cast<unsigned long long>(total));
    return 0;
}

void inspect_file(const std::string& path, bool list) {
    io::WeightSource src = io::WeightSource::open(path);
    const WeightsSummary all = summarize(src);
    std::printf("%s\n", path.c_str());
    if (io::is_ldm_sdxl_checkpoint(src.keys())) {
        std::printf("  SDXL single-file checkpoint (ldm/sgm key layout)\n");
        for (auto c : {io::LdmComponent::kUNet, io::LdmComponent::kVAE, io::LdmComponent::kTextEncoder,
                       io::LdmComponent::kTextEncoder2})
            print_row(io::ldm_component_name(c), summarize(src, io::ldm_prefix(c)));
    } else if (const int64_t rank = lora_rank(src); rank > 0) {
        if (const auto flux = models::flux_lora_layout(src.keys()))
            std::printf("  Flux/transformer LoRA adapter, rank %lld (%s layout)\n",
                        static_cast<long long>(rank), models::flux_lora_layout_name(*flux));
        else
            std::printf("  LoRA adapter, rank %lld\n", static_cast<long long>(rank));
    } else if (is_flux_transformer(src)) {
        // Black Forest Labs' / ComfyUI's layout: report what dtune reads from it.
        const auto c = models::flux_config_from_bfl(src, path, /*any_head_size=*/true);
        std::printf(
            "  Flux.1 transformer single file (Black Forest Labs' layout): %s, %lld double + %lld single "
            "blocks, %lld wide\n",
            c.guidance_embeds ? "[dev] (guidance embedding)" : "[schnell] (no guidance embedding)",
            static_cast<long long>(c.num_layers), static_cast<long long>(c.num_single_layers),
            static_cast<long long>(c.inner_dim()));
    } else if (const auto clip = clip_prefix(src, path)) {
        print_clip_file(src, *clip);
    } else if (const auto vae = io::ldm_vae_prefix(src.keys())) {
        print_vae_file(src, *vae);
    }
    std::printf("  files:      %zu\n", src.files().size());
    std::printf("  tensors:    %llu\n", static_cast<unsigned long long>(all.tensors));
    std::printf("  parameters: %llu (%s)\n", static_cast<unsigned long long>(all.params),
                human_bytes(static_cast<double>(src.total_bytes())).c_str());
    for (const auto& [dtype, row] : all.by_dtype)
        std::printf("  dtype %-8s %llu tensors, %llu elements\n", dtype.c_str(),
                    static_cast<unsigned long long>(row.first), static_cast<unsigned long long>(row.second));
    for (const auto& [k, v] : src.metadata())
        std::printf("  metadata %s = %s\n", k.c_str(), v.substr(0, 120).c_str());
    if (!list) return;
    for (const auto& key : src.keys()) {
        const auto& info = src.info(key);
        std::string shape = "[";
        for (std::size_t i = 0; i < info.shape.size(); ++i)
            shape += (i ? ", " : "") + std::to_string(info.shape[i]);
        shape += "]";
        std::printf("  %-8s %-20s %s\n", io::st_dtype_name(info.dtype), shape.c_str(), key.c_str());
    }
}

int run_inspect(const std::vector<std::string>& args) {
    std::string path;
    bool list = false;
    for (const auto& a : args) {
        if (a == "--tensors")
            list = true;
        else if (a.rfind("--", 0) == 0)
            throw UsageError(str("unknown option '", a, "' for inspect; see dtune inspect --help"));
        else
            path = a;
    }
    if (path.empty())
        throw UsageError(
            "inspect needs a path: dtune inspect <model folder | file.safetensors | index.json>");
    if (std::filesystem::is_regular_file(std::filesystem::path(path) / "model_index.json"))
        return inspect_pipeline(path);
    inspect_file(path, list);
    return 0;
}

}  // namespace

DTUNE_REGISTER_COMMAND(inspect, "inspect", "describe a model folder, checkpoint, LoRA or weights file",
                       "usage: dtune inspect <path> [--tensors]\n\n"
                       "<path> is a diffusers pipeline folder (model_index.json), a component folder,\n"
                       "a .safetensors file (recognised: SDXL single-file checkpoints, Flux transformer\n"
                       "files, CLIP text encoder files such as clip_l, ldm VAE files such as Flux's\n"
                       "ae.safetensors, and LoRA files, with the key layout of Flux LoRAs) or a\n"
                       ".safetensors.index.json of a sharded set. Prints what it is,\n"
                       "its components with tensor and parameter counts and dtypes, and the file\n"
                       "metadata; --tensors lists every tensor of a file with dtype and shape.\n",
                       run_inspect);

}  // namespace dtune::cli
