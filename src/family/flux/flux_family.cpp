// Flux.1 behind the model-family layer (family/model_family.h): the transformer on 2×2-packed
// latents, CLIP-L's pooled output and T5's sequence, the 16-channel VAE with its shift, and flow
// matching.
//
// Conditioning names: prompt_embeds [B, L, 4096] (T5), pooled_prompt_embeds [B, 768] (CLIP-L),
// attention_mask [B, L] (T5's padding, applied in the joint attention with
// flux_attention_masked_training; not by default, as diffusers and SimpleTuner do), optionally
// guidance [B] (the embedded guidance of [dev], drawn by the step from flux_guidance_*; 1.0 when
// absent, SimpleTuner's training default).
//
// SimpleTuner's Flux keys (flux_*, flow_*, fuse_qkv_projections, tokenizer_max_length) reach the
// family through apply_training_config and lora_targets; their meanings are in config.cpp's table
// and README's "Flux options".
#include "family/flux/flux_family.h"

#include <optional>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "family/data_encoders.h"
#include "io/safetensors.h"
#include "models/clip/clip_text_model.h"
#include "models/clip/clip_tokenizer.h"
#include "models/common/pipeline_folder.h"
#include "models/common/quantize.h"
#include "models/common/weights.h"
#include "models/flux/flux_transformer.h"
#include "models/t5/t5_encoder.h"
#include "models/t5/t5_tokenizer.h"
#include "models/vae/autoencoder_kl.h"
#include "train/config.h"
#include "validate/flux_pipeline.h"

namespace dtune::family {
namespace {

constexpr double kTrainingGuidance = 1.0;  // SimpleTuner's flux_guidance_value default

class FluxDenoiser final : public Denoiser {
  public:
    explicit FluxDenoiser(models::FluxTransformer2DModel transformer)
        : transformer_(std::move(transformer)) {}
    torch::nn::Module& module() override { return *transformer_; }
    at::Tensor forward(const at::Tensor& noisy, const at::Tensor& timesteps,
                       const Conditioning& cond) override {
        const int64_t b = noisy.size(0), h = noisy.size(2), w = noisy.size(3);
        const auto dtype = transformer_->dtype();
        const auto opts = noisy.options().dtype(dtype);
        const at::Tensor& context = cond.at("prompt_embeds");  // [B, L, 4096]
        at::Tensor guidance;
        if (transformer_->config().guidance_embeds) {
            const auto it = cond.find("guidance");
            guidance = it != cond.end() ? it->second.to(noisy.device(), at::kFloat)
                                        : at::full({b}, kTrainingGuidance, noisy.options().dtype(at::kFloat));
        }
        const at::Tensor packed = models::flux_pack_latents(noisy.to(dtype));  // [B, hw/4, 64]
        // The image ids depend only on the latent size: built on the host once per size, not
        // copied to the device in every step (a copy from pageable memory waits for the GPU).
        if (!img_ids_.defined() || ids_hw_ != std::pair{h, w} || img_ids_.device() != noisy.device() ||
            img_ids_.scalar_type() != dtype) {
            img_ids_ = models::flux_image_ids(h, w).to(noisy.device(), dtype);
            ids_hw_ = {h, w};
        }
        const at::Tensor& img_ids = img_ids_;
        const at::Tensor txt_ids = at::zeros({context.size(1), 3}, opts);
        at::Tensor text_mask;  // [B, L] with flux_attention_masked_training
        if (settings_.mask_text) {
            const auto it = cond.find("attention_mask");
            DTUNE_CHECK_AS(DataError, it != cond.end(),
                           "flux_attention_masked_training needs the T5 attention mask in the text cache, "
                           "and this batch has none; delete the text cache folder so it is rebuilt");
            text_mask = it->second;
        }
        // The transformer takes sigmas in [0, 1]; the step passes sigma · 1000, as the pipeline does.
        const at::Tensor v = transformer_->forward(
            packed, context.to(dtype), cond.at("pooled_prompt_embeds").to(dtype),
            (timesteps.to(at::kFloat) / 1000.0).to(dtype), guidance, img_ids, txt_ids, text_mask);
        return models::flux_unpack_latents(v, h, w);  // [B, 16, h, w]
    }
    std::pair<int64_t, int64_t> set_gradient_checkpointing(bool enabled, int64_t interval) override {
        transformer_->set_gradient_checkpointing(enabled, interval);
        const int64_t budget = transformer_->attention_stash().budget();
        const auto params = transformer_->parameters();
        if (enabled && budget > 0 && !params.empty() && params.front().is_cuda())
            log::info()
                << "gradient checkpointing: checkpointed blocks keep their attention outputs in pinned host "
                   "memory for the recomputation (at most "
                << budget / (1 << 20) << " MiB; DTUNE_ATTENTION_STASH_GIB sets it, 0 recomputes them)";
        return transformer_->checkpointed_blocks();
    }
    c10::ScalarType dtype() const override { return transformer_->dtype(); }
    models::FluxTransformer2DModel& transformer() { return transformer_; }

    // What a run's Flux keys set on the network (FluxFamily::apply_training_config); validation
    // images follow them too.
    struct Settings {
        bool mask_text = false;   // flux_attention_masked_training
        int64_t t5_tokens = 512;  // the text cache's T5 length (tokenizer_max_length as resolved)
    };
    void set_settings(const Settings& s) { settings_ = s; }
    const Settings& settings() const { return settings_; }

  private:
    models::FluxTransformer2DModel transformer_;
    Settings settings_;
    at::Tensor img_ids_;                  // [(h/2)(w/2), 3] of the last latent size
    std::pair<int64_t, int64_t> ids_hw_;  // that size
};

// The family-neutral request as FluxPipeline reads it.
validate::FluxRequest flux_request(const validate::GenerationRequest& r) {
    validate::FluxRequest f;
    f.prompt = r.prompt;
    f.negative_prompt = r.negative_prompt;
    f.true_cfg_scale = r.true_cfg_scale;
    f.true_cfg_start_step = r.true_cfg_start_step;
    f.width = r.width;
    f.height = r.height;
    f.steps = r.steps;
    f.guidance_scale = r.guidance_scale;  // [dev]'s embedded guidance
    f.max_sequence_length = r.max_sequence_length;
    f.seed = r.seed;
    f.num_images_per_prompt = r.num_images_per_prompt;
    f.latents = r.latents;
    f.decode = r.decode;
    f.vae_tiling = r.vae_tiling;
    f.free_text_encoders = r.free_text_encoders;
    f.on_latents = r.on_latents;  // validation_preview
    return f;
}

// Validation images: diffusers' FluxPipeline around the live transformer.
class FluxSampler final : public ImageSampler {
  public:
    FluxSampler(const std::filesystem::path& model_dir, FluxDenoiser& denoiser, const SamplerLoadOptions& o)
        : denoiser_(denoiser) {
        auto pf = models::PipelineFolder::open(model_dir);
        if (!o.vae_override.empty()) pf.set_vae_override(o.vae_override);
        const c10::ScalarType dtype = denoiser.dtype();
        models::ComponentLoadOptions load{dtype, o.device};
        auto clip = models::load_clip_text_model(pf.component("text_encoder").path, {dtype, o.device});
        auto t5 = models::load_t5_encoder(pf.component("text_encoder_2").path, load);
        auto vae = models::load_autoencoder_kl(pf.vae_path(), load);
        const auto sched_file = pf.component("scheduler").path / "scheduler_config.json";
        const auto sched = diffusion::FlowMatchConfig::from_json(
            nlohmann::json::parse(fs::read_file(sched_file)), sched_file.string());
        const bool was_training = denoiser.transformer()->is_training();
        pipeline_ = std::make_unique<validate::FluxPipeline>(
            models::CLIPTokenizer::from_folder(pf.component("tokenizer").path), std::move(clip),
            models::T5Tokenizer::load(pf.component("tokenizer_2").path), std::move(t5),
            denoiser.transformer(), std::move(vae), sched, o.device);
        if (was_training) denoiser.transformer()->train();  // the pipeline's constructor switched it to eval
    }
    validate::GenerationResult generate(const validate::GenerationRequest& r,
                                        const validate::StepCallback& on_step) override {
        // Prompts encoded as the text cache holds them (SimpleTuner validates from cached embeds),
        // masked as in training.
        validate::FluxRequest f = flux_request(r);
        f.max_sequence_length = denoiser_.settings().t5_tokens;
        f.attention_mask = denoiser_.settings().mask_text;
        return pipeline_->generate(f, on_step);
    }

  private:
    FluxDenoiser& denoiser_;
    std::unique_ptr<validate::FluxPipeline> pipeline_;
};

// `dtune sample`'s Flux: a diffusers folder, or a BFL/ComfyUI transformer file with config_folder,
// component files, a LoRA in any of the three layouts. [dev] samples 28 steps at guidance 3.5,
// [schnell] 4 steps (FluxPipeline's defaults).
class FluxFilePipeline final : public ImageSampler {
  public:
    explicit FluxFilePipeline(const PipelineSource& s)
        : pipeline_(validate::FluxPipeline::load(
              s.config_folder.empty() ? s.model : s.config_folder, {s.dtype, s.device},
              validate::FluxComponentFiles{s.config_folder.empty() ? "" : s.model.string(),
                                           s.text_encoder_file.string(), s.text_encoder_2_file.string(),
                                           s.vae_file.string()})) {
        for (size_t i = 0; i < s.precision.size(); ++i)
            DTUNE_CHECK_AS(UsageError, s.precision[i] == "no_change",
                           "the precision options are not supported for Flux pipelines yet; leave them at "
                           "no_change");
        if (!s.lora.empty()) pipeline_.load_lora(s.lora, s.lora_scale);
        dev_ = pipeline_.transformer()->config().guidance_embeds;
    }
    validate::GenerationResult generate(const validate::GenerationRequest& r,
                                        const validate::StepCallback& on_step) override {
        return pipeline_.generate(flux_request(r), on_step);
    }
    SampleDefaults defaults() const override { return {dev_ ? 28 : 4, 3.5}; }

  private:
    validate::FluxPipeline pipeline_;
    bool dev_ = true;  // [dev] (guidance embedded) or [schnell]
};

// CLIP-L's pooled output and T5's sequence, as FluxPipeline.encode_prompt computes them.
// CLIP-L and T5 for the text cache. The tokenizers load at once (cheap); the encoders (T5-XXL is
// 9.5 GB in bf16) only when the first caption must be encoded, so a run whose text cache is
// complete never loads them (issue #23: a resumed or re-run job keeps that memory and time).
struct FluxTextEncoders {
    std::optional<models::CLIPTokenizer> clip_tokenizer;
    models::CLIPTextModel clip{nullptr};
    std::optional<models::T5Tokenizer> t5_tokenizer;
    models::T5EncoderModel t5{nullptr};
    c10::Device device = c10::Device(c10::kCPU);
    int64_t max_length = 512;
    std::filesystem::path clip_dir, t5_dir;
    std::array<std::string, 2> precisions;

    void load() {
        log::info()
            << "loading the Flux text encoders (CLIP-L, T5) to encode captions missing from the text cache";
        const c10::ScalarType dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
        clip = models::load_clip_text_model(clip_dir, {dtype, device});
        clip->eval();
        t5 = models::load_t5_encoder(t5_dir, {dtype, device});
        t5->eval();
        std::string unused;  // the identity was written when the cache was opened
        quantize_text_encoders({clip.get(), t5.get()}, precisions, unused);
    }

    data::TextEmbeds encode(const std::vector<std::string>& captions) {
        if (!t5) load();
        const at::NoGradGuard no_grad;
        std::vector<at::Tensor> ids;
        for (const auto& c : captions) ids.push_back(at::tensor(clip_tokenizer->encode(c, 77)));
        const at::Tensor pooled = clip->forward(at::stack(ids).to(device), false).pooler_output;  // [B, 768]
        const at::Tensor t5_ids = t5_tokenizer->encode_batch(captions, max_length).to(device);    // [B, L]
        const at::Tensor context = t5->forward(t5_ids);  // [B, L, 4096]
        // Stored in the encoder's dtype (bf16 on CUDA: a 512-token T5 entry is 4 MiB in bf16).
        return {{"prompt_embeds", context.to(at::kCPU)},
                {"pooled_prompt_embeds", pooled.to(at::kCPU)},
                {"attention_mask", t5_tokenizer->attention_mask(captions, max_length)}};
    }
};

class FluxFamily final : public ModelFamily {
  public:
    const char* name() const override { return "flux"; }
    const char* denoiser_folder() const override { return "transformer"; }
    const char* network_name() const override { return "Flux transformer"; }
    int64_t latent_channels() const override { return 16; }
    std::unique_ptr<Denoiser> load_denoiser(const std::filesystem::path& dir,
                                            const models::ComponentLoadOptions& options) const override;
    std::unique_ptr<Denoiser> load_quantized_denoiser(
        const std::filesystem::path& dir, const std::filesystem::path& file,
        const models::ComponentLoadOptions& options) const override;
    std::unique_ptr<Denoiser> wrap_denoiser(std::shared_ptr<torch::nn::Module> network) const override;
    data::DataEncoders load_data_encoders(const DataEncoderOptions& options) const override;
    void drop_caption(Conditioning& batch, int64_t row, const Conditioning& empty) const override;
    TrainingObjective training_objective(const std::filesystem::path& model_dir) const override;
    void apply_training_config(const train::TrainConfig& config, Denoiser& denoiser,
                               TrainingObjective& objective) const override;
    std::unique_ptr<ImageSampler> load_sampler(const std::filesystem::path& model_dir, Denoiser& denoiser,
                                               const SamplerLoadOptions& options) const override;
    std::unique_ptr<ImageSampler> open_pipeline(const PipelineSource& source) const override {
        return std::make_unique<FluxFilePipeline>(source);
    }
    std::vector<std::string> default_lora_targets() const override;
    std::vector<std::string> lora_targets(const train::TrainConfig& config) const override {
        return flux_lora_target_modules(config.text("flux_lora_target"));
    }
    void export_single_file(const std::filesystem::path& base, const torch::nn::Module& network,
                            const std::filesystem::path& out_file,
                            const std::optional<std::filesystem::path>& vae_dir) const override;
    const char* single_file_name() const override { return "flux_transformer.safetensors"; }
    const char* preview_decoder_id() const override { return "madebyollin/taef1"; }
};

}  // namespace

std::unique_ptr<Denoiser> FluxFamily::load_denoiser(const std::filesystem::path& dir,
                                                    const models::ComponentLoadOptions& options) const {
    return std::make_unique<FluxDenoiser>(models::load_flux_transformer(dir, options));
}

std::unique_ptr<Denoiser> FluxFamily::load_quantized_denoiser(
    const std::filesystem::path& dir, const std::filesystem::path& file,
    const models::ComponentLoadOptions& options) const {
    auto transformer = models::load_flux_transformer(dir, options);
    models::load_quantized(*transformer, file, options.device, options.dtype);
    return std::make_unique<FluxDenoiser>(std::move(transformer));
}

std::unique_ptr<Denoiser> FluxFamily::wrap_denoiser(std::shared_ptr<torch::nn::Module> network) const {
    auto transformer = std::dynamic_pointer_cast<models::FluxTransformer2DModelImpl>(network);
    DTUNE_CHECK_AS(UsageError, transformer != nullptr,
                   "model_family flux trains a FluxTransformer2DModel; got another network");
    return std::make_unique<FluxDenoiser>(models::FluxTransformer2DModel(transformer));
}

data::DataEncoders FluxFamily::load_data_encoders(const DataEncoderOptions& o) const {
    data::DataEncoders e;
    load_vae_encoder(o.model_dir, o.vae_override, o.device, o.vae_dtype, e);
    const auto pf = models::PipelineFolder::open(o.model_dir);
    auto text = std::make_shared<FluxTextEncoders>();
    text->clip_tokenizer.emplace(models::CLIPTokenizer::from_folder(pf.component("tokenizer").path));
    text->t5_tokenizer.emplace(models::T5Tokenizer::load(pf.component("tokenizer_2").path));
    text->clip_dir = pf.component("text_encoder").path;
    text->t5_dir = pf.component("text_encoder_2").path;
    text->precisions = o.text_encoder_precision;
    text->device = o.device;
    text->max_length = o.max_sequence_length > 0 ? o.max_sequence_length : 512;
    e.text_identity =
        text_encoder_identity(o.model_dir, "FluxTextEncoders") + str(" max_length=", text->max_length);
    e.text_identity += text_precision_identity(o.text_encoder_precision, 2);
    e.text = [text](const std::vector<std::string>& captions) { return text->encode(captions); };
    e.text_tensor_names = {"attention_mask", "pooled_prompt_embeds", "prompt_embeds"};
    return e;
}

void FluxFamily::drop_caption(Conditioning& batch, int64_t row, const Conditioning& empty) const {
    // SimpleTuner's Flux dropout: the empty caption's encodings, pooled included.
    for (const auto& [name, t] : empty)
        if (auto it = batch.find(name); it != batch.end()) it->second[row].copy_(t);
}

TrainingObjective FluxFamily::training_objective(const std::filesystem::path& model_dir) const {
    TrainingObjective o;
    o.kind = TrainingObjective::Kind::kFlowMatching;
    // The scheduler config gives eval loss its fixed sigmas (report/eval_loss.h).
    const auto file = model_dir / "scheduler" / "scheduler_config.json";
    if (std::filesystem::is_regular_file(file))
        o.flow_scheduler =
            diffusion::FlowMatchConfig::from_json(nlohmann::json::parse(fs::read_file(file)), file.string());
    if (o.flow_scheduler) {  // flow_schedule_auto_shift's anchors, as SimpleTuner reads them
        o.flow.base_image_seq_len = o.flow_scheduler->base_image_seq_len;
        o.flow.max_image_seq_len = o.flow_scheduler->max_image_seq_len;
        o.flow.base_shift = o.flow_scheduler->base_shift;
        o.flow.max_shift = o.flow_scheduler->max_shift;
    }
    o.flow.guidance = diffusion::EmbeddedGuidanceOptions{};  // constant 1.0; [schnell]'s network ignores it
    return o;  // SimpleTuner's flow_* defaults (diffusion::FlowMatchingOptions)
}

void FluxFamily::apply_training_config(const train::TrainConfig& c, Denoiser& denoiser,
                                       TrainingObjective& o) const {
    diffusion::FlowMatchingOptions& f = o.flow;
    f.shift = c.opt_real("flow_schedule_shift");
    f.auto_shift = c.flag("flow_schedule_auto_shift");
    f.sigmoid_scale = c.real("flow_sigmoid_scale");
    f.uniform = c.flag("flow_use_uniform_schedule");
    f.beta = c.flag("flow_use_beta_schedule");
    f.beta_alpha = c.real("flow_beta_schedule_alpha");
    f.beta_beta = c.real("flow_beta_schedule_beta");
    f.flux_fast_schedule = c.flag("flux_fast_schedule");
    diffusion::EmbeddedGuidanceOptions g;
    g.mode = diffusion::parse_embedded_guidance_mode(c.text("flux_guidance_mode"));
    g.value = c.real("flux_guidance_value");
    g.min = c.real("flux_guidance_min");
    g.max = c.real("flux_guidance_max");
    f.guidance = g;

    auto* flux = dynamic_cast<FluxDenoiser*>(&denoiser);
    DTUNE_CHECK(flux != nullptr, "the Flux training keys need a Flux denoiser");
    FluxDenoiser::Settings s;
    s.mask_text = c.flag("flux_attention_masked_training");
    s.t5_tokens = c.opt_integer("tokenizer_max_length").value_or(512);
    flux->set_settings(s);
    flux->transformer()->set_fused_qkv(c.flag("fuse_qkv_projections"));

    const char* schedules[] = {"logit-normal", "uniform", "beta", "flux_fast_schedule"};
    const auto shift = f.auto_shift ? std::string("auto (from the image size)")
                                    : (f.shift && *f.shift > 0 ? str(*f.shift) : std::string("none"));
    log::info() << "Flux training: sigmas " << schedules[static_cast<int>(diffusion::flow_sigma_schedule(f))]
                << (diffusion::flow_sigma_schedule(f) == diffusion::FlowSigmaSchedule::kFluxFast
                        ? std::string(" (never shifted)")
                        : ", shift " + shift)
                << "; guidance "
                << (g.mode == diffusion::EmbeddedGuidanceOptions::Mode::kConstant
                        ? str(g.value)
                        : str("uniform in [", g.min, ", ", g.max, "]"))
                << (flux->transformer()->config().guidance_embeds ? "" : " (unused: no guidance embedding)")
                << "; T5 " << s.t5_tokens << " tokens"
                << (s.mask_text ? ", padding masked in attention" : "");
}

std::unique_ptr<ImageSampler> FluxFamily::load_sampler(const std::filesystem::path& model_dir,
                                                       Denoiser& denoiser,
                                                       const SamplerLoadOptions& options) const {
    auto* flux = dynamic_cast<FluxDenoiser*>(&denoiser);
    DTUNE_CHECK(flux != nullptr, "the Flux sampler needs a Flux denoiser");
    return std::make_unique<FluxSampler>(model_dir, *flux, options);
}

std::vector<std::string> FluxFamily::default_lora_targets() const {
    return flux_lora_target_modules("all");  // SimpleTuner's flux_lora_target default
}

std::vector<std::string> flux_lora_target_modules(const std::string& target) {
    // SimpleTuner's lists (helpers/models/flux/model.py, get_lora_target_layers) without "to_qkv" and
    // "add_qkv_proj": those names exist only in a model whose projections were fused into new layers,
    // and dtune keeps the separate q/k/v layers (fuse_qkv_projections only runs them as one matmul).
    const std::vector<std::string> attention = {"to_k",       "to_q",       "to_v",     "add_k_proj",
                                                "add_q_proj", "add_v_proj", "to_out.0", "to_add_out"};
    const std::vector<std::string> context = {"add_k_proj", "add_q_proj", "add_v_proj", "to_add_out"};
    const std::vector<std::string> ffs = {"ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                                          "ff_context.net.2"};
    const auto join = [](std::vector<std::string> a, const std::vector<std::string>& b) {
        a.insert(a.end(), b.begin(), b.end());
        return a;
    };
    // An unknown name falls back to SimpleTuner's DEFAULT_LORA_TARGET there; "mmdit" is one.
    if (target == "mmdit") return {"to_k", "to_q", "to_v", "to_out.0"};
    if (target == "all") return attention;
    if (target == "context") return context;
    if (target == "context+ffs") return join(context, {"ff_context.net.0.proj", "ff_context.net.2"});
    if (target == "all+ffs") return join(join(attention, ffs), {"proj_mlp", "proj_out"});
    if (target == "all+ffs+embedder")
        return join({"x_embedder"}, join(join(attention, ffs), {"proj_mlp", "proj_out"}));
    if (target == "ai-toolkit")
        return join(join(attention, ffs),
                    {"norm.linear", "norm1.linear", "norm1_context.linear", "proj_mlp", "proj_out"});
    // TheLastBen's small LoRAs: two (tiny) or one (nano) of FLUX.1's 38 single-stream blocks.
    if (target == "tiny")
        return {"single_transformer_blocks.7.proj_out", "single_transformer_blocks.20.proj_out"};
    if (target == "nano") return {"single_transformer_blocks.7.proj_out"};
    throw UsageError(str("flux_lora_target \"", target,
                         "\" is not supported; choose one of: ", kFluxLoraTargets,
                         " (controlnet needs ControlNet training, which dtune does not do)"));
}

void FluxFamily::export_single_file(const std::filesystem::path&, const torch::nn::Module& network,
                                    const std::filesystem::path& out_file,
                                    const std::optional<std::filesystem::path>&) const {
    // The transformer alone, as Black Forest Labs ship flux1-dev.safetensors: what ComfyUI's
    // diffusion-model loader and `dtune sample --model FILE --config_folder ...` read. The text
    // encoders and the VAE stay the base model's (the pipeline folder export has them).
    const auto* transformer = dynamic_cast<const models::FluxTransformer2DModelImpl*>(&network);
    DTUNE_CHECK_AS(UsageError, transformer != nullptr,
                   "export_single_file for Flux writes a FluxTransformer2DModel; got another network");
    const io::TensorList tensors =
        models::flux_diffusers_to_bfl(models::state_dict(network), transformer->config());
    if (!out_file.parent_path().empty()) std::filesystem::create_directories(out_file.parent_path());
    io::save_safetensors(out_file, tensors, {{"format", "pt"}});
    log::info() << "wrote the Flux transformer single file " << out_file.string()
                << " (Black Forest Labs' layout, " << tensors.size() << " tensors)";
}

bool is_flux_transformer_file(const std::filesystem::path& file) {
    if (!std::filesystem::is_regular_file(file)) return false;
    try {
        const io::SafetensorsFile f(file);
        return f.contains("double_blocks.0.img_attn.qkv.weight") ||
               f.contains("model.diffusion_model.double_blocks.0.img_attn.qkv.weight");
    } catch (const std::exception&) {
    }
    return false;
}

const ModelFamily& flux_family() {
    static const FluxFamily family;
    return family;
}

}  // namespace dtune::family
