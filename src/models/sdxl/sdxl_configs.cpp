// SDXL configs and tokenizers from the compiled-in files or a diffusers folder (see the header).
#include "models/sdxl/sdxl_configs.h"

#include <zlib.h>

#include <array>
#include <vector>

#include "core/error.h"
#include "core/fs.h"
#include "io/ldm_keys.h"
#include "io/safetensors.h"

namespace dtune::models {
namespace {

constexpr const char* kBuiltinOrigin = "built-in SDXL base 1.0 configs";

std::string_view builtin_file(const char* name) {
    const std::string_view data = embedded_file(name);
    // Only a broken build gets here: the files are compiled in by src/models/CMakeLists.txt.
    DTUNE_CHECK(!data.empty(), "built-in file '", name, "' is missing from this binary; rebuild dtune");
    return data;
}

nlohmann::json parse_builtin_json(const char* name) {
    return nlohmann::json::parse(builtin_file(name));  // compiled-in and tested: always valid
}

// The gzip member in `data`, inflated.
std::string gunzip(std::string_view data, const char* name) {
    z_stream zs{};
    DTUNE_CHECK(inflateInit2(&zs, 16 + MAX_WBITS) == Z_OK, "zlib: inflateInit2 failed for ", name);
    zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
    zs.avail_in = static_cast<uInt>(data.size());
    std::string out;
    std::array<char, 1 << 16> chunk{};
    int rc = Z_OK;
    while (rc == Z_OK) {
        zs.next_out = reinterpret_cast<Bytef*>(chunk.data());
        zs.avail_out = static_cast<uInt>(chunk.size());
        rc = inflate(&zs, Z_NO_FLUSH);
        out.append(chunk.data(), chunk.size() - zs.avail_out);
    }
    inflateEnd(&zs);
    DTUNE_CHECK(rc == Z_STREAM_END, "built-in file '", name, "' is not valid gzip (zlib error ", rc,
                "); rebuild dtune");
    return out;
}

nlohmann::json read_json(const std::filesystem::path& path, const char* what) {
    DTUNE_CHECK_AS(DataError, std::filesystem::is_regular_file(path), "missing ", path.string(), ": the ",
                   what, " is needed; copy it from the base model's diffusers folder");
    try {
        return nlohmann::json::parse(fs::read_file(path));
    } catch (const nlohmann::json::exception& e) {
        throw DataError(str(path.string(), ": not valid JSON (", e.what(), "); fix or replace the file"));
    }
}

std::string shape_text(const std::vector<int64_t>& shape) {
    std::string s = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
}

}  // namespace

SDXLConfigs SDXLConfigs::builtin() {
    const std::string merges = gunzip(builtin_file("clip_merges.txt.gz"), "clip_merges.txt.gz");
    CLIPSpecialTokens special_2;
    special_2.pad = "!";  // SDXL's tokenizer_2 (OpenCLIP's padding)
    const auto clip = [](const char* name, const char* what) {
        return CLIPTextConfig::from_json_text(std::string(builtin_file(name)), what);
    };
    return SDXLConfigs{
        kBuiltinOrigin,
        ConfigReader(parse_builtin_json("unet_config.json"), "built-in SDXL base UNet config"),
        ConfigReader(parse_builtin_json("vae_config.json"), "built-in SDXL base VAE config"),
        clip("text_encoder_config.json", "built-in SDXL base text_encoder config"),
        clip("text_encoder_2_config.json", "built-in SDXL base text_encoder_2 config"),
        parse_builtin_json("scheduler_config.json"),
        CLIPTokenizer::from_merges(merges, "built-in CLIP merges"),
        CLIPTokenizer::from_merges(merges, "built-in CLIP merges", special_2),
        /*force_zeros_for_empty_prompt=*/true,
    };
}

SDXLConfigs SDXLConfigs::from_folder(const PipelineFolder& folder) {
    const auto component = [&](const char* name) { return folder.component(name).path; };
    // A VAE override given as a bare .safetensors has no config: the folder's own vae/ config then.
    const std::filesystem::path vae =
        std::filesystem::is_directory(folder.vae_path()) ? folder.vae_path() : component("vae");
    return SDXLConfigs{
        folder.root().string(),
        ConfigReader::from_file(component("unet") / "config.json"),
        ConfigReader::from_file(vae / "config.json"),
        CLIPTextConfig::from_json_file(component("text_encoder") / "config.json"),
        CLIPTextConfig::from_json_file(component("text_encoder_2") / "config.json"),
        read_json(component("scheduler") / "scheduler_config.json", "scheduler config"),
        CLIPTokenizer::from_folder(component("tokenizer")),
        CLIPTokenizer::from_folder(component("tokenizer_2")),
        folder.force_zeros_for_empty_prompt(),
    };
}

void check_builtin_architecture(const io::WeightSource& checkpoint, const std::filesystem::path& path) {
    const std::string fix =
        "; dtune's built-in configs are SDXL base 1.0's: for another architecture pass the diffusers "
        "folder of the same model family (--config_folder) for its configs and tokenizers";
    DTUNE_CHECK_AS(DataError, io::is_ldm_sdxl_checkpoint(checkpoint.keys()), path.string(),
                   " is not an SDXL single-file checkpoint (it lacks model.diffusion_model.* or one of the "
                   "conditioner.embedders.{0,1} text encoders)",
                   fix);
    // Shapes that pin SDXL base: channels, pooled+time embedding width, cross-attention width,
    // transformer depth of the middle block, both text encoders' widths, the VAE's latent channels.
    const std::pair<const char*, std::vector<int64_t>> expected[] = {
        {"model.diffusion_model.input_blocks.0.0.weight", {320, 4, 3, 3}},
        {"model.diffusion_model.label_emb.0.0.weight", {1280, 2816}},
        {"model.diffusion_model.middle_block.1.transformer_blocks.9.attn2.to_k.weight", {1280, 2048}},
        {"conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight", {49408, 768}},
        {"conditioner.embedders.1.model.token_embedding.weight", {49408, 1280}},
        {"first_stage_model.decoder.conv_in.weight", {512, 4, 3, 3}},
    };
    for (const auto& [key, shape] : expected) {
        DTUNE_CHECK_AS(DataError, checkpoint.contains(key), path.string(), " has no tensor ", key,
                       ", so it is not an SDXL base-architecture checkpoint", fix);
        const auto& found = checkpoint.info(key).shape;
        DTUNE_CHECK_AS(DataError, found == shape, path.string(), ": ", key, " is ", shape_text(found),
                       " but SDXL base has ", shape_text(shape), fix);
    }
}

}  // namespace dtune::models
