// Everything about an SDXL model that is not weights: the component configs, the two tokenizers,
// the scheduler config and force_zeros_for_empty_prompt. A diffusers folder carries them; a
// single-file checkpoint (ComfyUI/A1111 style) does not, so dtune has them built in.
//
// Built-ins (SDXLConfigs::builtin()): stabilityai/stable-diffusion-xl-base-1.0's unet, vae,
// text_encoder, text_encoder_2 and scheduler configs (src/models/sdxl/builtin/*.json, identical to
// that repository's files) and CLIP's BPE merges (builtin/clip_merges.txt.gz, the 48,894 merges of
// openai/clip-vit-large-patch14 shared by both SDXL tokenizers; the vocabulary follows from them,
// CLIPTokenizer::from_merges). They are compiled into the binary (cmake/embed_files.cmake), so
// `dtune sample --model sd_xl_base_1.0.safetensors` needs nothing else. tokenizer pads with
// <|endoftext|>, tokenizer_2 with "!", both 77 tokens, as in the SDXL base repository.
//
// Single files of other architectures (the SDXL refiner, SD 1.x, a tiny test model) are rejected
// by check_builtin_architecture() with a message that asks for a diffusers folder of the right
// architecture (from_folder(), `--config_folder`), whose weights are then ignored.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "models/clip/clip_text_model.h"
#include "models/clip/clip_tokenizer.h"
#include "models/common/config_json.h"
#include "models/common/pipeline_folder.h"

namespace dtune::io {
class WeightSource;
}

namespace dtune::models {

struct SDXLConfigs {
    std::string origin;  // "built-in SDXL base 1.0 configs" or the folder, for messages
    ConfigReader unet;
    ConfigReader vae;
    CLIPTextConfig text_encoder;
    CLIPTextConfig text_encoder_2;
    nlohmann::json scheduler;
    CLIPTokenizer tokenizer;
    CLIPTokenizer tokenizer_2;
    bool force_zeros_for_empty_prompt = true;

    // The compiled-in SDXL base 1.0 configs and tokenizers.
    static SDXLConfigs builtin();
    // A diffusers SDXL pipeline folder's configs and tokenizers (its weights are not read); the
    // VAE config follows the folder's VAE override when one is set.
    static SDXLConfigs from_folder(const PipelineFolder& folder);
};

// A data file compiled into the binary (see sdxl_configs.h); empty when there is no such file.
// Defined in the generated embedded_files.cpp.
std::string_view embedded_file(std::string_view name);

// Throws DataError when the single file `checkpoint` does not have SDXL base's architecture (UNet
// input/label-embedding shapes and both text encoders), naming the tensor that differs and telling
// the user to pass the diffusers folder of the model's architecture instead.
void check_builtin_architecture(const io::WeightSource& checkpoint, const std::filesystem::path& path);

}  // namespace dtune::models
