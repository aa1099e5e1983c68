// SDXL's two text encoders + tokenizers, loaded from a pipeline folder, and prompt encoding equal
// to diffusers' StableDiffusionXLPipeline.encode_prompt.
//
// encode_prompt():
//   prompt_embeds        = concat(te1 hidden_states[-2], te2 hidden_states[-2]) along features
//                          ([B*N, 77, 768+1280] for real SDXL; clip_skip k uses [-(k+2)])
//   pooled_prompt_embeds = te2's projected pooled output (text_embeds) [B*N, 1280]
//   negatives: with classifier-free guidance, when no negative prompt is given (nullopt) and
//   force_zeros_for_empty_prompt is set, zeros shaped like the positives; otherwise the negative
//   prompts ("" when not given) are encoded the same way. As in diffusers, an explicitly given
//   empty string "" is encoded, not zeroed. prompt_2 / negative_prompt_2 default to prompt /
//   negative_prompt. N = num_images_per_prompt repeats each row.
//
// Long prompts (opt-in, `chunked_long_prompts`): every prompt is tokenized with
// CLIPTokenizer::encode_chunked; all prompts and negatives are padded to the same chunk count
// with empty chunks (BOS EOS pad...), each 77-token chunk is encoded on its own and the hidden
// states are concatenated along the sequence ([B, 77*chunks, D]); pooled embeds come from the
// first chunk. Off, prompts are truncated to 77 tokens exactly like diffusers.
#pragma once

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "models/clip/clip_text_model.h"
#include "models/clip/clip_tokenizer.h"
#include "models/common/pipeline_folder.h"

namespace dtune::models {

struct SDXLPromptEmbeds {
    at::Tensor prompt_embeds;                  // [B*N, T, D1+D2]
    at::Tensor pooled_prompt_embeds;           // [B*N, P2]
    at::Tensor negative_prompt_embeds;         // undefined without classifier-free guidance
    at::Tensor negative_pooled_prompt_embeds;  // undefined without classifier-free guidance
};

struct SDXLEncodeOptions {
    std::optional<std::vector<std::string>> prompt_2;  // tokenizer_2's prompts; default = prompt
    bool do_classifier_free_guidance = true;
    // nullopt = "no negative prompt" (zeros when force_zeros_for_empty_prompt); size 1 or B.
    std::optional<std::vector<std::string>> negative_prompt;
    std::optional<std::vector<std::string>> negative_prompt_2;
    int num_images_per_prompt = 1;
    std::optional<int> clip_skip;  // layers skipped from the end (diffusers' clip_skip)
    bool chunked_long_prompts = false;
    int max_chunks = 0;  // with chunked_long_prompts: cap on chunks per prompt (0 = no cap)
};

struct SDXLTextEncoders {
    CLIPTokenizer tokenizer;
    CLIPTokenizer tokenizer_2;
    CLIPTextModel text_encoder{nullptr};
    CLIPTextModelWithProjection text_encoder_2{nullptr};
    bool force_zeros_for_empty_prompt = true;

    // tokenizer/, tokenizer_2/, text_encoder/, text_encoder_2/ of an SDXL pipeline folder.
    static SDXLTextEncoders load(const PipelineFolder& folder, const TextEncoderLoadOptions& options = {});
    // An SDXL single-file checkpoint (ldm layout, mapped by io/ldm_keys.h): the text encoder
    // weights come from `checkpoint`; tokenizers and the two config.json from `config_folder`, a
    // diffusers SDXL folder (what diffusers' from_single_file takes as `config`), since single
    // files carry neither. Strict: missing/unexpected tensors are listed in a DataError.
    static SDXLTextEncoders load_single_file(const std::filesystem::path& checkpoint,
                                             const PipelineFolder& config_folder,
                                             const TextEncoderLoadOptions& options = {});
    // The same with the configs and tokenizers given (e.g. the built-in SDXL base ones of
    // models/sdxl/sdxl_configs.h), so that the file alone is enough.
    static SDXLTextEncoders load_single_file(const std::filesystem::path& checkpoint,
                                             const CLIPTextConfig& config, const CLIPTextConfig& config_2,
                                             CLIPTokenizer tokenizer, CLIPTokenizer tokenizer_2,
                                             bool force_zeros_for_empty_prompt,
                                             const TextEncoderLoadOptions& options = {});

    // No gradient is recorded (text encoders are frozen in SDXL fine-tuning).
    SDXLPromptEmbeds encode_prompt(const std::vector<std::string>& prompt,
                                   const SDXLEncodeOptions& options = {});
};

}  // namespace dtune::models
