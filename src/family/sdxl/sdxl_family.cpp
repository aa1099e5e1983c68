// SDXL behind the model-family layer (family/model_family.h): the UNet, the two CLIP text encoders,
// the 4-channel VAE, SDXL's time ids and the DDPM objective.
//
// Conditioning names: prompt_embeds [B, 77, 2048], pooled_prompt_embeds [B, 1280] (the text cache's
// entry, as SimpleTuner names them), time_ids [B, 6] (from each sample's crop geometry).
#include "family/sdxl/sdxl_family.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/quant_preset.h"
#include "data/sample_variants.h"
#include "family/data_encoders.h"
#include "family/export.h"
#include "models/clip/sdxl_text_encoders.h"
#include "models/common/pipeline_folder.h"
#include "models/common/quantize.h"
#include "models/unet/unet_2d_condition.h"
#include "models/vae/autoencoder_kl.h"
#include "validate/sdxl_pipeline.h"

namespace dtune::family {
namespace {

class SdxlDenoiser final : public Denoiser {
  public:
    explicit SdxlDenoiser(models::UNet2DConditionModel unet) : unet_(std::move(unet)) {}
    torch::nn::Module& module() override { return *unet_; }
    at::Tensor forward(const at::Tensor& noisy, const at::Tensor& timesteps,
                       const Conditioning& cond) override {
        const models::UNetAddedCond added{cond.at("pooled_prompt_embeds"), cond.at("time_ids")};
        return unet_->forward(noisy, timesteps, cond.at("prompt_embeds"), added);  // [B, 4, h, w]
    }
    std::pair<int64_t, int64_t> set_gradient_checkpointing(bool enabled, int64_t interval) override {
        unet_->set_gradient_checkpointing(enabled, interval);
        return unet_->checkpointed_blocks();
    }
    c10::ScalarType dtype() const override { return unet_->dtype(); }
    bool set_channels_last(bool enabled) override {
        unet_->set_channels_last(enabled);
        return true;
    }
    models::UNet2DConditionModel& unet() { return unet_; }

  private:
    models::UNet2DConditionModel unet_;
};

// Validation images: diffusers' StableDiffusionXLPipeline around the live UNet, with the
// inference scheduler SimpleTuner validates with (trailing timestep spacing).
class SdxlSampler final : public ImageSampler {
  public:
    SdxlSampler(const std::filesystem::path& model_dir, SdxlDenoiser& denoiser, const SamplerLoadOptions& o) {
        auto pf = models::PipelineFolder::open(model_dir);
        if (!o.vae_override.empty()) pf.set_vae_override(o.vae_override);
        auto te = models::SDXLTextEncoders::load(pf, {denoiser.dtype(), o.device});
        models::ComponentLoadOptions vae_load;
        vae_load.device = o.device;  // float32: SDXL's VAE overflows in half precision
        auto vae = models::load_autoencoder_kl(pf.vae_path(), vae_load);
        auto sched =
            nlohmann::json::parse(fs::read_file(pf.component("scheduler").path / "scheduler_config.json"));
        sched["timestep_spacing"] = "trailing";  // SimpleTuner's inference_scheduler_timestep_spacing
        // The pipeline shares the trainer's UNet module (a holder copy), so it samples live weights.
        const bool was_training = denoiser.unet()->is_training();
        pipeline_ = std::make_unique<validate::SDXLPipeline>(std::move(te), denoiser.unet(), std::move(vae),
                                                             std::move(sched), o.device);
        if (was_training) denoiser.unet()->train();  // the pipeline's constructor switched it to eval
    }
    validate::GenerationResult generate(const validate::GenerationRequest& request,
                                        const validate::StepCallback& on_step) override {
        return pipeline_->generate(request, on_step);
    }

  private:
    std::unique_ptr<validate::SDXLPipeline> pipeline_;
};

// `dtune sample`'s SDXL: a diffusers folder or a single-file checkpoint (configs from
// config_folder, or the built-in SDXL base ones), quantised as asked, with its LoRA.
class SdxlFilePipeline final : public ImageSampler {
  public:
    explicit SdxlFilePipeline(const PipelineSource& s)
        : pipeline_(
              std::filesystem::is_regular_file(s.model)
                  ? validate::SDXLPipeline::load_single_file(s.model, s.config_folder, {s.dtype, s.device})
                  : validate::SDXLPipeline::load(s.model, {s.dtype, s.device})) {
        // Quantised after loading, on the device, one layer at a time (the LoRA rides beside the base).
        const std::array<torch::nn::Module*, 3> parts{pipeline_.unet().get(),
                                                      pipeline_.text_encoders().text_encoder.get(),
                                                      pipeline_.text_encoders().text_encoder_2.get()};
        const std::array<const char*, 3> keys{"base_model_precision", "text_encoder_1_precision",
                                              "text_encoder_2_precision"};
        for (size_t i = 0; i < parts.size(); ++i) {
            const QuantPreset preset = parse_quant_preset(s.precision[i], str("--", keys[i]));
            if (preset.active())
                log::info() << (i == 0 ? "UNet" : str("text encoder ", i)) << " "
                            << models::describe(models::quantize_module(*parts[i], preset), preset);
        }
        if (!s.lora.empty()) pipeline_.load_lora(s.lora, s.lora_scale);
    }
    validate::GenerationResult generate(const validate::GenerationRequest& request,
                                        const validate::StepCallback& on_step) override {
        return pipeline_.generate(request, on_step);
    }

  private:
    validate::SDXLPipeline pipeline_;
};

class SdxlFamily final : public ModelFamily {
  public:
    const char* name() const override { return "sdxl"; }
    const char* denoiser_folder() const override { return "unet"; }
    const char* network_name() const override { return "UNet"; }
    int64_t latent_channels() const override { return 4; }
    std::unique_ptr<Denoiser> load_denoiser(const std::filesystem::path& dir,
                                            const models::ComponentLoadOptions& options) const override;
    std::unique_ptr<Denoiser> load_quantized_denoiser(
        const std::filesystem::path& dir, const std::filesystem::path& file,
        const models::ComponentLoadOptions& options) const override;
    std::unique_ptr<Denoiser> wrap_denoiser(std::shared_ptr<torch::nn::Module> network) const override;
    data::DataEncoders load_data_encoders(const DataEncoderOptions& options) const override;
    void drop_caption(Conditioning& batch, int64_t row, const Conditioning& empty) const override;
    TrainingObjective training_objective(const std::filesystem::path& model_dir) const override;
    std::unique_ptr<ImageSampler> load_sampler(const std::filesystem::path& model_dir, Denoiser& denoiser,
                                               const SamplerLoadOptions& options) const override;
    std::unique_ptr<ImageSampler> open_pipeline(const PipelineSource& source) const override {
        return std::make_unique<SdxlFilePipeline>(source);
    }
    std::vector<std::string> default_lora_targets() const override;
    void export_single_file(const std::filesystem::path& base, const torch::nn::Module& network,
                            const std::filesystem::path& out_file,
                            const std::optional<std::filesystem::path>& vae_dir) const override;
    const char* single_file_name() const override { return "sdxl_checkpoint.safetensors"; }
    const char* preview_decoder_id() const override { return "madebyollin/taesdxl"; }
};

}  // namespace

std::vector<double> sdxl_time_ids(const data::SamplePlan& plan, bool flipped) {
    const int left = flipped ? data::mirrored_crop_left(plan) : plan.crop_left;
    return {double(plan.intermediary.height),
            double(plan.intermediary.width),
            double(plan.crop_top),
            double(left),
            double(plan.target.height),
            double(plan.target.width)};
}

void add_sdxl_time_ids(Conditioning& batch, const std::vector<data::SamplePlan>& plans,
                       const std::vector<bool>& flips) {
    std::vector<double> ids;
    for (size_t i = 0; i < plans.size(); ++i)
        for (double v : sdxl_time_ids(plans[i], i < flips.size() && flips[i])) ids.push_back(v);
    batch["time_ids"] = at::tensor(ids, at::kFloat).view({static_cast<int64_t>(plans.size()), 6});  // [B, 6]
}

std::unique_ptr<Denoiser> SdxlFamily::load_denoiser(const std::filesystem::path& dir,
                                                    const models::ComponentLoadOptions& options) const {
    return std::make_unique<SdxlDenoiser>(models::load_unet(dir, options));
}

std::unique_ptr<Denoiser> SdxlFamily::load_quantized_denoiser(
    const std::filesystem::path& dir, const std::filesystem::path& file,
    const models::ComponentLoadOptions& options) const {
    return std::make_unique<SdxlDenoiser>(models::load_quantized_unet(dir, file, options));
}

std::unique_ptr<Denoiser> SdxlFamily::wrap_denoiser(std::shared_ptr<torch::nn::Module> network) const {
    auto unet = std::dynamic_pointer_cast<models::UNet2DConditionModelImpl>(network);
    DTUNE_CHECK_AS(UsageError, unet != nullptr,
                   "model_family sdxl trains a UNet2DConditionModel; got another network");
    return std::make_unique<SdxlDenoiser>(models::UNet2DConditionModel(unet));
}

data::DataEncoders SdxlFamily::load_data_encoders(const DataEncoderOptions& o) const {
    data::DataEncoders e;
    load_vae_encoder(o.model_dir, o.vae_override, o.device, o.vae_dtype, e);
    auto folder = models::PipelineFolder::open(o.model_dir);
    models::TextEncoderLoadOptions to;
    to.device = o.device;
    auto text = std::make_shared<models::SDXLTextEncoders>(models::SDXLTextEncoders::load(folder, to));
    e.text_identity = text_encoder_identity(o.model_dir, "SDXLTextEncoders");
    quantize_text_encoders({text->text_encoder.get(), text->text_encoder_2.get()}, o.text_encoder_precision,
                           e.text_identity);
    e.text = [text](const std::vector<std::string>& captions) {
        models::SDXLEncodeOptions opt;
        opt.do_classifier_free_guidance = false;  // "" is encoded, as SimpleTuner's dropout embedding
        const auto out = text->encode_prompt(captions, opt);
        return data::TextEmbeds{{"prompt_embeds", out.prompt_embeds.to(at::kCPU, at::kFloat)},
                                {"pooled_prompt_embeds", out.pooled_prompt_embeds.to(at::kCPU, at::kFloat)}};
    };
    e.text_tensor_names = {"pooled_prompt_embeds", "prompt_embeds"};
    e.sample_conditioning = add_sdxl_time_ids;
    return e;
}

void SdxlFamily::drop_caption(Conditioning& batch, int64_t row, const Conditioning& empty) const {
    // SimpleTuner's SDXL dropout: the empty caption's embedding, zeroed pooled embedding and time ids.
    batch.at("prompt_embeds")[row].copy_(empty.at("prompt_embeds"));  // [77, D]
    batch.at("pooled_prompt_embeds")[row].zero_();                    // [P]
    batch.at("time_ids")[row].zero_();                                // [6]
}

TrainingObjective SdxlFamily::training_objective(const std::filesystem::path& model_dir) const {
    const auto file = model_dir / "scheduler" / "scheduler_config.json";
    TrainingObjective o;
    o.kind = TrainingObjective::Kind::kDiffusion;
    o.schedule.emplace(diffusion::NoiseScheduleConfig::from_json(nlohmann::json::parse(fs::read_file(file)),
                                                                 (model_dir / "scheduler").string()));
    return o;
}

std::unique_ptr<ImageSampler> SdxlFamily::load_sampler(const std::filesystem::path& model_dir,
                                                       Denoiser& denoiser,
                                                       const SamplerLoadOptions& options) const {
    auto* sdxl = dynamic_cast<SdxlDenoiser*>(&denoiser);
    DTUNE_CHECK(sdxl != nullptr, "the SDXL sampler needs an SDXL denoiser");
    return std::make_unique<SdxlSampler>(model_dir, *sdxl, options);
}

std::vector<std::string> SdxlFamily::default_lora_targets() const {
    // SimpleTuner's SDXL UNet targets (PEFT's attention projections).
    return {"to_k", "to_q", "to_v", "to_out.0"};
}

void SdxlFamily::export_single_file(const std::filesystem::path& base, const torch::nn::Module& network,
                                    const std::filesystem::path& out_file,
                                    const std::optional<std::filesystem::path>& vae_dir) const {
    family::export_single_file(base, network, out_file, vae_dir);
}

const ModelFamily& sdxl_family() {
    static const SdxlFamily family;
    return family;
}

}  // namespace dtune::family
