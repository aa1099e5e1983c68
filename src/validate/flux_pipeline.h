// Text-to-image with Flux.1 [dev] / [schnell] from a diffusers FluxPipeline folder, as diffusers'
// FluxPipeline (0.42) computes it:
//   pooled  = CLIPTextModel(tokenizer(prompt, 77)).pooler_output                 [B, 768]
//   context = T5EncoderModel(tokenizer_2(prompt, max_sequence_length))            [B, L, 4096]
//   latents = N(0, 1) [B, 16, 2·(H/16), 2·(W/16)] from the seeded CPU generator, packed 2×2
//   sigmas  = linspace(1, 1/n, n) shifted with mu(image tokens) (flow_match_mu)
//   each step: v = transformer(latents, t/1000, guidance, pooled, context, ids); Euler step
//   image   = vae.decode(unpack(latents) / scaling_factor + shift_factor)
// [dev] embeds the guidance scale in the model (guidance_embeds), [schnell] ignores it. True
// classifier-free guidance is FluxPipeline's opt-in: with a negative prompt and true_cfg_scale > 1
// each step runs the transformer twice, v = v_neg + true_cfg_scale · (v − v_neg) (the negative pass
// with the negative prompt's embeddings, everything else equal); otherwise one pass and the negative
// prompt is not encoded. SimpleTuner's validation starts true CFG at a later step
// (true_cfg_start_step: its validation_no_cfg_until_timestep) and, for runs trained with
// flux_attention_masked_training, masks T5's padding in the joint attention (attention_mask).
// Seeds give the same image on any device (the noise is drawn on the CPU).
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "diffusion/flow_match.h"
#include "models/adapters/lora.h"
#include "models/clip/clip_text_model.h"
#include "models/clip/clip_tokenizer.h"
#include "models/flux/flux_transformer.h"
#include "models/t5/t5_encoder.h"
#include "models/t5/t5_tokenizer.h"
#include "models/vae/autoencoder_kl.h"
#include "validate/generation.h"

namespace dtune::validate {

struct FluxRequest {
    std::vector<std::string> prompt;  // B prompts
    // True CFG (both needed, as in diffusers): a negative prompt (size 1 or B; "" is a prompt too)
    // and true_cfg_scale > 1. Otherwise a single transformer pass per step.
    std::optional<std::vector<std::string>> negative_prompt;
    double true_cfg_scale = 1.0;
    int64_t true_cfg_start_step = 0;  // steps before it run the positive pass only (diffusers: 0)
    bool attention_mask = false;      // T5's padding left out as keys in the joint attention
    int64_t width = 1024;
    int64_t height = 1024;
    int64_t steps = 28;
    double guidance_scale = 3.5;        // [dev]'s embedded guidance; unused by [schnell]
    int64_t max_sequence_length = 512;  // T5 tokens ([schnell]: at most 256)
    uint64_t seed = 0;
    int num_images_per_prompt = 1;
    at::Tensor latents;  // given N(0, 1) latents [B*N, 16, h, w] replace the draw
    bool decode = true;
    bool vae_tiling = false;  // decode in overlapping tiles (AutoencoderKL::decode_tiled)
    // Free both text encoders once the prompts are encoded (their memory goes before the
    // transformer runs); a later generate() on this pipeline is then a UsageError.
    bool free_text_encoders = false;
    // After every sampler step: the latents unpacked to [B*N, 16, h, w] float32, still shifted and
    // scaled (what taef1 decodes: validation_preview).
    std::function<void(const StepLatents&)> on_latents;
};

// Single files that replace a folder component's weights; its config (and the tokenizers) still come
// from the folder, as diffusers' from_single_file(config=...). Empty = the folder's weights.
struct FluxComponentFiles {
    std::filesystem::path transformer;     // Black Forest Labs' / ComfyUI's layout, fp8 e4m3 included
    std::filesystem::path text_encoder;    // CLIP-L: ComfyUI's clip_l.safetensors (transformers' keys)
    std::filesystem::path text_encoder_2;  // T5: ComfyUI's t5xxl_fp16 / t5xxl_fp8_e4m3fn
    std::filesystem::path vae;             // Black Forest Labs' ae.safetensors (ldm layout)
};

class FluxPipeline {
  public:
    FluxPipeline(models::CLIPTokenizer tokenizer, models::CLIPTextModel text_encoder,
                 models::T5Tokenizer tokenizer_2, models::T5EncoderModel text_encoder_2,
                 models::FluxTransformer2DModel transformer, models::AutoencoderKL vae,
                 diffusion::FlowMatchConfig scheduler, c10::Device device);

    // A diffusers FluxPipeline folder (model_index.json with tokenizer, text_encoder, tokenizer_2,
    // text_encoder_2, transformer, vae, scheduler); `files` replace components' weights.
    static FluxPipeline load(const std::filesystem::path& folder, const PipelineLoadOptions& options = {},
                             const FluxComponentFiles& files = {});

    // Applies a transformer LoRA at `strength`, unmerged (models/adapters/lora_apply.h), in any layout
    // of models/flux/flux_lora.h: diffusers/PEFT, kohya/ComfyUI or Black Forest Labs' (detected from
    // the keys). One per pipeline.
    void load_lora(const std::filesystem::path& file, double strength = 1.0);

    // Throws UsageError for sizes not a multiple of 16, empty prompts, steps < 1, a negative prompt
    // list that is neither 1 nor B long, or a non-finite true_cfg_scale.
    GenerationResult generate(const FluxRequest& request, const StepCallback& on_step = {});

    models::FluxTransformer2DModel& transformer() { return transformer_; }
    models::AutoencoderKL& vae() { return vae_; }
    c10::Device device() const { return device_; }

  private:
    struct TextEmbeds {
        at::Tensor pooled;   // [B*N, 768] CLIP's pooled output
        at::Tensor context;  // [B*N, L, D] T5's sequence
        at::Tensor mask;     // [B*N, L] T5's attention mask (1: a real token)
    };
    TextEmbeds encode(const std::vector<std::string>& prompts, int64_t max_sequence_length,
                      int64_t per_prompt);

    models::CLIPTokenizer tokenizer_;
    models::CLIPTextModel text_encoder_;
    models::T5Tokenizer tokenizer_2_;
    models::T5EncoderModel text_encoder_2_;
    models::FluxTransformer2DModel transformer_;
    models::AutoencoderKL vae_;
    diffusion::FlowMatchConfig scheduler_;
    c10::Device device_;
    std::optional<models::LoRAAdapters> lora_;  // refers to transformer_'s layers, declared after it
};

}  // namespace dtune::validate
