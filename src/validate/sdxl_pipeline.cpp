// SDXL text-to-image generation (see sdxl_pipeline.h for the algorithm and invariants).
#include "validate/sdxl_pipeline.h"

#include <chrono>
#include <cmath>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/InferenceMode.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "diffusion/sampler.h"
#include "io/image_tensor.h"
#include "io/safetensors.h"
#include "models/adapters/lora_apply.h"

namespace dtune::validate {

struct SDXLPipeline::Conditioning {
    at::Tensor embeds;       // [M*B, T, D]   (M = 2 with CFG: uncond rows first)
    at::Tensor text_embeds;  // [M*B, P]
    at::Tensor time_ids;     // [M*B, 6]
    bool cfg = false;
};

SDXLPipeline::SDXLPipeline(models::SDXLTextEncoders text_encoders, models::UNet2DConditionModel unet,
                           models::AutoencoderKL vae, nlohmann::json scheduler_config, c10::Device device)
    : text_encoders_(std::move(text_encoders)),
      unet_(std::move(unet)),
      vae_(std::move(vae)),
      scheduler_config_(std::move(scheduler_config)),
      device_(device) {
    unet_->eval();
    vae_->eval();
}

namespace {

nlohmann::json read_scheduler_config(const models::PipelineFolder& pf) {
    const auto path = pf.component("scheduler").path / "scheduler_config.json";
    DTUNE_CHECK_AS(
        DataError, std::filesystem::exists(path), "missing ", path.string(),
        ": the pipeline folder needs scheduler/scheduler_config.json (copy it from the base model)");
    try {
        return nlohmann::json::parse(fs::read_file(path));
    } catch (const nlohmann::json::exception& e) {
        throw DataError(str(path.string(), ": not valid JSON (", e.what(), "); fix or replace the file"));
    }
}

}  // namespace

namespace {

// "loaded <what> on <device> in 2.31 s": how long a model took to reach its device (issue #18 compares
// it with diffusers' from_pretrained).
void log_load_time(const std::string& what, const c10::Device& device,
                   std::chrono::steady_clock::time_point t0) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    log::info() << "loaded " << what << " on " << device.str() << " in " << std::round(s * 100) / 100 << " s";
}

}  // namespace

SDXLPipeline SDXLPipeline::load(const std::filesystem::path& folder, const PipelineLoadOptions& options) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto pf = models::PipelineFolder::open(folder);
    auto text_encoders = models::SDXLTextEncoders::load(pf, {options.dtype, options.device});
    const models::ComponentLoadOptions comp{options.dtype, options.device};
    auto unet = models::load_unet(pf.component("unet").path, comp);
    auto vae = models::load_autoencoder_kl(pf.vae_path(), comp);
    log_load_time(str("SDXL pipeline ", folder.string()), options.device, t0);
    return SDXLPipeline(std::move(text_encoders), std::move(unet), std::move(vae), read_scheduler_config(pf),
                        options.device);
}

SDXLPipeline SDXLPipeline::load_single_file(const std::filesystem::path& checkpoint,
                                            const std::filesystem::path& config_folder,
                                            const PipelineLoadOptions& options) {
    if (!config_folder.empty())
        return load_single_file(checkpoint,
                                models::SDXLConfigs::from_folder(models::PipelineFolder::open(config_folder)),
                                options);
    const io::WeightSource file = io::WeightSource::open(checkpoint);
    models::check_builtin_architecture(file, checkpoint);
    auto configs = models::SDXLConfigs::builtin();
    // ComfyUI's markers for v-prediction / zero-terminal-SNR fine-tunes of SDXL (empty tensors).
    if (file.contains("v_pred")) {
        configs.scheduler["prediction_type"] = "v_prediction";
        log::info() << checkpoint.string() << " is marked v_pred: sampling with prediction_type v_prediction";
    }
    if (file.contains("ztsnr")) {
        configs.scheduler["rescale_betas_zero_snr"] = true;
        log::info() << checkpoint.string() << " is marked ztsnr: zero-terminal-SNR schedule";
    }
    return load_single_file(checkpoint, std::move(configs), options);
}

SDXLPipeline SDXLPipeline::load_single_file(const std::filesystem::path& checkpoint,
                                            models::SDXLConfigs configs, const PipelineLoadOptions& options) {
    log::info() << "single file " << checkpoint.string() << " with " << configs.origin;
    const auto t0 = std::chrono::steady_clock::now();
    auto text_encoders = models::SDXLTextEncoders::load_single_file(
        checkpoint, configs.text_encoder, configs.text_encoder_2, std::move(configs.tokenizer),
        std::move(configs.tokenizer_2), configs.force_zeros_for_empty_prompt,
        {options.dtype, options.device});
    models::ComponentLoadOptions comp{options.dtype, options.device};
    comp.single_file = checkpoint;
    comp.config = configs.unet;
    auto unet = models::load_unet({}, comp);
    comp.config = configs.vae;
    auto vae = models::load_autoencoder_kl({}, comp);
    log_load_time(str("SDXL single file ", checkpoint.string()), options.device, t0);
    return SDXLPipeline(std::move(text_encoders), std::move(unet), std::move(vae),
                        std::move(configs.scheduler), options.device);
}

void SDXLPipeline::load_lora(const std::filesystem::path& file, double strength) {
    DTUNE_CHECK_AS(UsageError, !lora_, "this pipeline already has a LoRA applied; load one LoRA file (",
                   file.string(), " was the second)");
    lora_.emplace(models::apply_lora_file(*unet_, file, strength));
}

namespace {

void check_request(const GenerationRequest& r, int64_t factor) {
    if (r.prompt.empty()) throw UsageError("generate needs at least one prompt");
    if (r.steps < 1) throw UsageError(str("steps = ", r.steps, " is invalid: use 1 or more"));
    if (r.num_images_per_prompt < 1)
        throw UsageError(
            str("num_images_per_prompt = ", r.num_images_per_prompt, " is invalid: use 1 or more"));
    if (r.width <= 0 || r.height <= 0 || r.width % factor != 0 || r.height % factor != 0)
        throw UsageError(str("image size ", r.width, "x", r.height, " is invalid: width and height must be ",
                             "positive multiples of ", factor));
    if (r.negative_prompt && r.negative_prompt->size() != 1 && r.negative_prompt->size() != r.prompt.size())
        throw UsageError(str("got ", r.negative_prompt->size(), " negative prompts for ", r.prompt.size(),
                             " prompts: give one negative prompt or one per prompt"));
}

// The sampler for a request: dtune sample's names (dpmpp_2m, dpmpp_2m_karras) map onto the
// diffusion layer's DPM++ with use_karras_sigmas forced either way; other names pass through.
std::unique_ptr<diffusion::Sampler> sampler_for(nlohmann::json config, const std::string& name) {
    std::string kind = name;
    if (name == "dpmpp_2m" || name == "dpmpp_2m_karras") {
        config["use_karras_sigmas"] = name == "dpmpp_2m_karras";
        kind = "dpm++";
    }
    return diffusion::make_sampler(config, kind);
}

}  // namespace

SDXLPipeline::Conditioning SDXLPipeline::condition(const GenerationRequest& r, bool cfg) {
    models::SDXLEncodeOptions enc;
    enc.do_classifier_free_guidance = cfg;
    enc.negative_prompt = r.negative_prompt;
    if (enc.negative_prompt && enc.negative_prompt->size() == 1 && r.prompt.size() > 1)
        enc.negative_prompt = std::vector<std::string>(r.prompt.size(), enc.negative_prompt->front());
    enc.num_images_per_prompt = r.num_images_per_prompt;
    enc.clip_skip = r.clip_skip;
    const auto e = text_encoders_.encode_prompt(r.prompt, enc);
    const int64_t rows = e.prompt_embeds.size(0);

    const diffusion::SizeHW hw{r.height, r.width};
    const at::Tensor ids = diffusion::sdxl_time_ids(r.original_size.value_or(hw), r.crops_coords_top_left,
                                                    r.target_size.value_or(hw),
                                                    rows);  // [B*N, 6]
    Conditioning c;
    c.cfg = cfg;
    if (!cfg) {
        c.embeds = e.prompt_embeds;
        c.text_embeds = e.pooled_prompt_embeds;
        c.time_ids = ids;
    } else {
        at::Tensor neg_ids = ids;
        if (r.negative_original_size && r.negative_target_size)
            neg_ids = diffusion::sdxl_time_ids(*r.negative_original_size, r.negative_crops_coords_top_left,
                                               *r.negative_target_size, rows);
        c.embeds = at::cat({e.negative_prompt_embeds, e.prompt_embeds});
        c.text_embeds = at::cat({e.negative_pooled_prompt_embeds, e.pooled_prompt_embeds});
        c.time_ids = at::cat({neg_ids, ids});
    }
    c.embeds = c.embeds.to(device_);
    c.text_embeds = c.text_embeds.to(device_);
    c.time_ids = c.time_ids.to(device_);
    return c;
}

at::Tensor SDXLPipeline::denoise(const GenerationRequest& r, const Conditioning& c, at::Tensor latents,
                                 at::Generator& gen, const StepCallback& on_step) {
    auto sampler = sampler_for(scheduler_config_, r.sampler);
    sampler->set_timesteps(r.steps);
    latents = (latents * sampler->init_noise_sigma()).to(device_);  // [B*N, 4, h, w] float32
    const models::UNetAddedCond added{c.text_embeds, c.time_ids};
    const int64_t n = sampler->num_steps();
    for (int64_t i = 0; i < n; ++i) {
        const at::Tensor x = c.cfg ? at::cat({latents, latents}) : latents;  // [M*B, 4, h, w]
        const at::Tensor t = sampler->timesteps()[i].to(device_);
        const at::Tensor pred =
            unet_->forward(sampler->scale_model_input(x, i), t, c.embeds, added).to(at::kFloat);
        at::Tensor eps = pred;
        if (c.cfg) {
            const auto halves = pred.chunk(2);
            eps = diffusion::classifier_free_guidance(halves[0], halves[1], r.guidance_scale,
                                                      r.guidance_rescale);
        }
        latents = sampler->step(eps, i, latents, gen);
        if (r.on_latents)
            r.on_latents(StepLatents{i, n, t.to(at::kCPU, at::kDouble).item<double>(), latents});
        if (on_step) on_step(i + 1, n);
    }
    return latents;
}

GenerationResult SDXLPipeline::generate(const GenerationRequest& r, const StepCallback& on_step) {
    const int64_t factor = vae_->config().downsampling_factor();
    check_request(r, factor);
    c10::InferenceMode no_grad;
    const int64_t rows = static_cast<int64_t>(r.prompt.size()) * r.num_images_per_prompt;
    const std::vector<int64_t> shape{rows, unet_->config().in_channels, r.height / factor, r.width / factor};
    // One CPU generator feeds the initial noise and then the ancestral / eta noise, as in diffusers.
    at::Generator gen = at::detail::createCPUGenerator(r.seed);
    at::Tensor init;
    if (r.latents.defined()) {
        if (r.latents.sizes() != at::IntArrayRef(shape))
            throw UsageError(str("initial latents have shape ", r.latents.sizes(), ", expected ",
                                 at::IntArrayRef(shape), " for ", rows, " images of ", r.width, "x",
                                 r.height));
        init = r.latents.to(at::kCPU, at::kFloat);
    } else {
        init = at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat));  // as diffusers' randn_tensor
    }
    // CFG as diffusers decides it (scale > 1); scale <= 1 is exactly the unguided path.
    const Conditioning cond = condition(r, diffusion::uses_cfg(r.guidance_scale));
    GenerationResult out;
    const at::Tensor latents = denoise(r, cond, init, gen, on_step);
    out.latents = latents.to(at::kCPU);
    if (r.decode) {
        const at::Tensor z = vae_->unscale_latents(latents);
        const at::Tensor decoded =
            r.vae_tiling ? vae_->decode_tiled(z, {}) : vae_->decode(z);  // [B*N, 3, H, W]
        out.images = decoded.to(at::kCPU, at::kFloat).div(2).add(0.5).clamp(0, 1);
    }
    return out;
}

std::vector<io::RgbImage> to_rgb_images(const at::Tensor& images) {
    DTUNE_CHECK(images.dim() == 4 && images.size(1) == 3, "to_rgb_images expects [B, 3, H, W], got ",
                images.sizes());
    std::vector<io::RgbImage> out;
    for (int64_t b = 0; b < images.size(0); ++b)
        out.push_back(io::from_tensor(images[b].to(at::kFloat).mul(2).sub(1)));  // from_tensor takes [-1, 1]
    return out;
}

}  // namespace dtune::validate
