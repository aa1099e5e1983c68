// SDXL text encoders: loading from folders and diffusers-equal prompt encoding (see the header).
#include "models/clip/sdxl_text_encoders.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <type_traits>

#include "core/error.h"
#include "io/ldm_keys.h"
#include "models/common/layers.h"
#include "models/common/weights.h"

namespace dtune::models {
namespace stdfs = std::filesystem;

std::string clip_text_key_to_module(const std::string& key) {
    if (key.ends_with("embeddings.position_ids")) return "";  // a non-persistent buffer in transformers
    if (key.rfind("text_model.", 0) == 0 || key.rfind("text_projection.", 0) == 0) return key;
    return "text_model." + key;
}

std::optional<std::string> clip_text_file_prefix(const std::vector<std::string>& keys,
                                                 const std::string& origin) {
    static const std::string kProbe = "encoder.layers.0.self_attn.q_proj.weight";
    std::vector<std::string> found;
    for (const auto& key : keys) {
        if (!key.ends_with(kProbe)) continue;
        std::string prefix = key.substr(0, key.size() - kProbe.size());
        if (prefix.ends_with("vision_model.")) continue;  // a CLIPModel's image tower
        if (prefix.ends_with("text_model.")) prefix.resize(prefix.size() - 11);
        if (prefix.empty() || prefix.back() == '.') found.push_back(prefix);
    }
    if (found.size() > 1) {
        std::vector<std::string> clip_l;
        for (const auto& p : found)
            if (p.find("clip_l") != std::string::npos) clip_l.push_back(p);
        if (clip_l.size() == 1) return clip_l.front();
        std::string all;
        for (const auto& p : found) all += " '" + p + "'";
        throw DataError(str(origin, " holds several CLIP text encoders (under", all,
                            "), none of them named clip_l; pass a file with one CLIP-L text encoder"));
    }
    if (found.empty()) return std::nullopt;
    return found.front();
}

namespace {

io::WeightSource open_text_encoder_weights(const stdfs::path& dir) {
    // transformers' names first, so a folder that also holds model.fp16.safetensors stays unambiguous.
    for (const char* name : {"model.safetensors.index.json", "model.safetensors"})
        if (stdfs::is_regular_file(dir / name)) return io::WeightSource::open(dir / name);
    return io::WeightSource::open(dir);
}

// The module with its large tensors allocated uninitialised in the target dtype/device; only for
// the strict loads below, which overwrite every tensor.
template <typename Module>
Module build_uninitialized(const CLIPTextConfig& config, const TextEncoderLoadOptions& o) {
    UninitializedParameters scope(o.dtype.value_or(at::kFloat), o.device.value_or(c10::Device(c10::kCPU)));
    return Module(config);
}

template <typename Module>
Module load_text_encoder(const stdfs::path& dir, const TextEncoderLoadOptions& options,
                         const char* class_name) {
    DTUNE_CHECK_AS(DataError, stdfs::is_directory(dir), class_name, " folder not found: ", dir.string(),
                   "; pass the pipeline's text encoder folder (config.json + model.safetensors)");
    const CLIPTextConfig config = CLIPTextConfig::from_json_file(dir / "config.json");
    Module module = build_uninitialized<Module>(config, options);
    LoadOptions load;
    load.rename = clip_text_key_to_module;
    load.dtype = options.dtype.value_or(at::kFloat);
    load.device = options.device;
    if (options.single_file) {
        const std::string origin = options.single_file->string();
        const io::WeightSource file = io::WeightSource::open(*options.single_file);
        const auto prefix = clip_text_file_prefix(file.keys(), origin);
        DTUNE_CHECK_AS(DataError, prefix.has_value(), origin,
                       " holds no CLIP text encoder in transformers' layout (no key ends with "
                       "'encoder.layers.0.self_attn.q_proj.weight'); pass ComfyUI's clip_l.safetensors or "
                       "a transformers CLIPTextModel model.safetensors");
        load.prefix = *prefix;
        // CLIPTextModelWithProjection's projection and CLIP's contrastive temperature: saved by
        // ComfyUI and OpenAI-derived files, not part of CLIPTextModel (transformers skips them too).
        constexpr bool kProjection = std::is_same_v<Module, CLIPTextModelWithProjection>;
        load.rename = [](const std::string& key) -> std::string {
            if (key == "logit_scale" || (!kProjection && key.rfind("text_projection", 0) == 0)) return "";
            return clip_text_key_to_module(key);
        };
        load_weights(*module, file, load, str(class_name, " from ", origin));
    } else {
        load_weights(*module, open_text_encoder_weights(dir), load, str(class_name, " from ", dir.string()));
    }
    module->eval();
    return module;
}

std::vector<std::string> broadcast(const std::vector<std::string>& prompts, std::size_t batch,
                                   const char* what) {
    if (prompts.size() == batch) return prompts;
    DTUNE_CHECK_AS(UsageError, prompts.size() == 1, what, " has ", prompts.size(),
                   " entries but the batch has ", batch, " prompts; give one ", what, " or one per prompt");
    return std::vector<std::string>(batch, prompts[0]);
}

// Token ids for every prompt: [B, chunks, T] (chunks = 1 unless chunked long prompts).
std::vector<std::vector<CLIPTokenizer::Ids>> tokenize(const CLIPTokenizer& tok,
                                                      const std::vector<std::string>& prompts,
                                                      const SDXLEncodeOptions& o) {
    std::vector<std::vector<CLIPTokenizer::Ids>> out;
    for (const auto& p : prompts)
        out.push_back(o.chunked_long_prompts ? tok.encode_chunked(p, o.max_chunks)
                                             : std::vector<CLIPTokenizer::Ids>{tok.encode(p)});
    return out;
}

// Pads every prompt to `chunks` chunks with empty ones and stacks: [B * chunks, T] int64.
at::Tensor stack_ids(const CLIPTokenizer& tok, std::vector<std::vector<CLIPTokenizer::Ids>> ids,
                     std::size_t chunks) {
    const CLIPTokenizer::Ids empty = tok.encode("");
    std::vector<int64_t> flat;
    for (auto& prompt : ids) {
        prompt.resize(chunks, empty);
        for (const auto& chunk : prompt) flat.insert(flat.end(), chunk.begin(), chunk.end());
    }
    const auto rows = static_cast<int64_t>(ids.size() * chunks);
    return at::tensor(flat, at::kLong).view({rows, -1});
}

struct Encoded {
    at::Tensor hidden;  // [B, chunks*T, D]
    at::Tensor pooled;  // [B, P] (text_embeds of encoder 2)
};

template <typename Model>
Encoded run_encoder(Model& model, const at::Tensor& ids, int64_t batch, const SDXLEncodeOptions& o) {
    const int skip = o.clip_skip.value_or(0);
    DTUNE_CHECK_AS(UsageError, skip >= 0 && skip < model->config().num_hidden_layers, "clip_skip ", skip,
                   " is out of range for a text encoder with ", model->config().num_hidden_layers, " layers");
    const CLIPTextOutput out = model->forward(ids, /*all_hidden_states=*/skip > 0);
    const auto n = static_cast<int64_t>(out.hidden_states.size());
    const at::Tensor h = out.hidden_states[static_cast<std::size_t>(n - 2 - skip)];  // [B*C, T, D]
    Encoded e;
    e.hidden = h.reshape({batch, -1, h.size(-1)});  // [B, C*T, D]
    if (out.text_embeds.defined())
        e.pooled = out.text_embeds.view({batch, -1, out.text_embeds.size(-1)}).select(1, 0);
    return e;
}

// Loads tensors already in memory (a single file's component after its key dialect was mapped)
// with the same renaming and strictness as a folder.
void copy_named_tensors(torch::nn::Module& module, const io::TensorList& tensors,
                        const TextEncoderLoadOptions& o, const std::string& what,
                        const io::WeightSource& file) {
    LoadOptions load;
    load.rename = clip_text_key_to_module;
    load.dtype = o.dtype.value_or(at::kFloat);
    load.device = o.device.value_or(c10::Device(c10::kCPU));
    load_weights(module, tensors, load, what, what, &file);
    module.eval();
}

}  // namespace

CLIPTextModel load_clip_text_model(const stdfs::path& dir, const TextEncoderLoadOptions& options) {
    return load_text_encoder<CLIPTextModel>(dir, options, "CLIPTextModel");
}

CLIPTextModelWithProjection load_clip_text_model_with_projection(const stdfs::path& dir,
                                                                 const TextEncoderLoadOptions& options) {
    return load_text_encoder<CLIPTextModelWithProjection>(dir, options, "CLIPTextModelWithProjection");
}

SDXLTextEncoders SDXLTextEncoders::load(const PipelineFolder& folder, const TextEncoderLoadOptions& options) {
    SDXLTextEncoders e{CLIPTokenizer::from_folder(folder.component("tokenizer").path),
                       CLIPTokenizer::from_folder(folder.component("tokenizer_2").path),
                       load_clip_text_model(folder.component("text_encoder").path, options),
                       load_clip_text_model_with_projection(folder.component("text_encoder_2").path, options),
                       folder.force_zeros_for_empty_prompt()};
    return e;
}

SDXLTextEncoders SDXLTextEncoders::load_single_file(const stdfs::path& checkpoint,
                                                    const PipelineFolder& config_folder,
                                                    const TextEncoderLoadOptions& options) {
    const auto config = [&](const char* name) {
        return CLIPTextConfig::from_json_file(config_folder.component(name).path / "config.json");
    };
    return load_single_file(checkpoint, config("text_encoder"), config("text_encoder_2"),
                            CLIPTokenizer::from_folder(config_folder.component("tokenizer").path),
                            CLIPTokenizer::from_folder(config_folder.component("tokenizer_2").path),
                            config_folder.force_zeros_for_empty_prompt(), options);
}

SDXLTextEncoders SDXLTextEncoders::load_single_file(const stdfs::path& checkpoint,
                                                    const CLIPTextConfig& config,
                                                    const CLIPTextConfig& config_2, CLIPTokenizer tokenizer,
                                                    CLIPTokenizer tokenizer_2,
                                                    bool force_zeros_for_empty_prompt,
                                                    const TextEncoderLoadOptions& options) {
    const io::WeightSource file = io::WeightSource::open(checkpoint);
    auto te1 = build_uninitialized<CLIPTextModel>(config, options);
    auto te2 = build_uninitialized<CLIPTextModelWithProjection>(config_2, options);
    const std::string from = " from " + checkpoint.string();
    copy_named_tensors(*te1, io::ldm_to_diffusers(file, io::LdmComponent::kTextEncoder), options,
                       "CLIPTextModel" + from, file);
    copy_named_tensors(*te2, io::ldm_to_diffusers(file, io::LdmComponent::kTextEncoder2), options,
                       "CLIPTextModelWithProjection" + from, file);
    return SDXLTextEncoders{std::move(tokenizer), std::move(tokenizer_2), te1, te2,
                            force_zeros_for_empty_prompt};
}

SDXLPromptEmbeds SDXLTextEncoders::encode_prompt(const std::vector<std::string>& prompt,
                                                 const SDXLEncodeOptions& o) {
    DTUNE_CHECK_AS(UsageError, !prompt.empty(),
                   "encode_prompt got no prompts; pass at least one (\"\" is allowed)");
    DTUNE_CHECK_AS(UsageError, o.num_images_per_prompt >= 1, "num_images_per_prompt is ",
                   o.num_images_per_prompt, "; use 1 or more");
    at::NoGradGuard no_grad;
    const std::size_t batch = prompt.size();
    const auto prompt_2 = o.prompt_2 ? broadcast(*o.prompt_2, batch, "prompt_2") : prompt;
    const bool zero_negative =
        o.do_classifier_free_guidance && !o.negative_prompt && force_zeros_for_empty_prompt;
    const bool encode_negative = o.do_classifier_free_guidance && !zero_negative;
    std::vector<std::string> neg, neg_2;
    if (encode_negative) {
        neg = broadcast(o.negative_prompt.value_or(std::vector<std::string>{""}), batch, "negative_prompt");
        neg_2 = o.negative_prompt_2 ? broadcast(*o.negative_prompt_2, batch, "negative_prompt_2") : neg;
    }
    // Tokenize everything first so that chunked prompts and negatives share one chunk count.
    auto ids1 = tokenize(tokenizer, prompt, o), ids2 = tokenize(tokenizer_2, prompt_2, o);
    auto nids1 = tokenize(tokenizer, neg, o), nids2 = tokenize(tokenizer_2, neg_2, o);
    std::size_t chunks = 1;
    for (const auto* set : {&ids1, &ids2, &nids1, &nids2})
        for (const auto& p : *set) chunks = std::max(chunks, p.size());

    const auto b = static_cast<int64_t>(batch);
    const auto dtype = text_encoder_2->text_projection->dtype();
    const auto encode_both = [&](auto& a, auto& c) {
        Encoded e1 = run_encoder(text_encoder, stack_ids(tokenizer, a, chunks), b, o);
        Encoded e2 = run_encoder(text_encoder_2, stack_ids(tokenizer_2, c, chunks), b, o);
        const at::Tensor hidden = at::cat({e1.hidden.to(dtype), e2.hidden.to(dtype)}, -1);  // [B, T, D1+D2]
        return std::pair{hidden, e2.pooled.to(dtype)};
    };
    const int64_t n = o.num_images_per_prompt;
    SDXLPromptEmbeds out;
    auto [hidden, pooled] = encode_both(ids1, ids2);
    out.prompt_embeds = hidden.repeat_interleave(n, 0);  // [B*N, T, D1+D2], rows p0,p0,p1,p1 as diffusers
    out.pooled_prompt_embeds = pooled.repeat_interleave(n, 0);
    if (zero_negative) {
        out.negative_prompt_embeds = at::zeros_like(out.prompt_embeds);
        out.negative_pooled_prompt_embeds = at::zeros_like(out.pooled_prompt_embeds);
    } else if (encode_negative) {
        auto [nhidden, npooled] = encode_both(nids1, nids2);
        out.negative_prompt_embeds = nhidden.repeat_interleave(n, 0);
        out.negative_pooled_prompt_embeds = npooled.repeat_interleave(n, 0);
    }
    return out;
}

}  // namespace dtune::models
