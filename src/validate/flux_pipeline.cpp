// Flux.1 text-to-image (see flux_pipeline.h).
#include "validate/flux_pipeline.h"

#include <ATen/CPUGeneratorImpl.h>
#ifdef DTUNE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <chrono>
#include <cmath>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "models/adapters/lora_apply.h"
#include "models/clip/clip_text_model.h"
#include "models/common/pipeline_folder.h"
#include "models/flux/flux_lora.h"

namespace dtune::validate {

FluxPipeline::FluxPipeline(models::CLIPTokenizer tokenizer, models::CLIPTextModel text_encoder,
                           models::T5Tokenizer tokenizer_2, models::T5EncoderModel text_encoder_2,
                           models::FluxTransformer2DModel transformer, models::AutoencoderKL vae,
                           diffusion::FlowMatchConfig scheduler, c10::Device device)
    : tokenizer_(std::move(tokenizer)),
      text_encoder_(std::move(text_encoder)),
      tokenizer_2_(std::move(tokenizer_2)),
      text_encoder_2_(std::move(text_encoder_2)),
      transformer_(std::move(transformer)),
      vae_(std::move(vae)),
      scheduler_(std::move(scheduler)),
      device_(device) {
    text_encoder_->eval();
    text_encoder_2_->eval();
    transformer_->eval();
    vae_->eval();
}

FluxPipeline FluxPipeline::load(const std::filesystem::path& folder, const PipelineLoadOptions& options,
                                const FluxComponentFiles& files) {
    const auto start = std::chrono::steady_clock::now();
    const auto pf = models::PipelineFolder::open(folder);
    DTUNE_CHECK_AS(DataError, pf.class_name() == "FluxPipeline", folder.string(), "/model_index.json names ",
                   pf.class_name(), "; a Flux folder's is FluxPipeline");
    const models::ComponentLoadOptions component{options.dtype, options.device};
    const auto single = [&](const std::filesystem::path& file) {
        models::ComponentLoadOptions load = component;
        if (!file.empty()) load.single_file = file;
        return load;
    };
    models::TextEncoderLoadOptions clip_load{options.dtype, options.device};
    if (!files.text_encoder.empty()) clip_load.single_file = files.text_encoder;
    auto clip = models::load_clip_text_model(pf.component("text_encoder").path, clip_load);
    auto t5 = models::load_t5_encoder(pf.component("text_encoder_2").path, single(files.text_encoder_2));
    models::ComponentLoadOptions transformer_load = single(files.transformer);
    if (!files.transformer.empty()) {
        // The folder's transformer config, when it has one, describes the file (as diffusers'
        // from_single_file(config=...)).
        const auto config = pf.component("transformer").path / "config.json";
        if (std::filesystem::is_regular_file(config))
            transformer_load.config = models::ConfigReader::from_file(config);
    }
    auto transformer = models::load_flux_transformer(pf.component("transformer").path, transformer_load);
    auto vae = models::load_autoencoder_kl(pf.vae_path(), single(files.vae));
    const auto sched_dir = pf.component("scheduler").path;
    const auto sched = diffusion::FlowMatchConfig::from_json(
        nlohmann::json::parse(fs::read_file(sched_dir / "scheduler_config.json")),
        (sched_dir / "scheduler_config.json").string());
    auto tok = models::CLIPTokenizer::from_folder(pf.component("tokenizer").path);
    auto tok2 = models::T5Tokenizer::load(pf.component("tokenizer_2").path);
    log::info() << "loaded Flux pipeline " << folder.string() << " on " << options.device.str() << " in "
                << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() << " s";
    return FluxPipeline(std::move(tok), std::move(clip), std::move(tok2), std::move(t5),
                        std::move(transformer), std::move(vae), sched, options.device);
}

void FluxPipeline::load_lora(const std::filesystem::path& file, double strength) {
    DTUNE_CHECK_AS(UsageError, !lora_, "this pipeline already has a LoRA applied; load one LoRA file (",
                   file.string(), " was the second)");
    const models::FluxLoRA lora = models::read_flux_lora(file, transformer_->config());
    lora_.emplace(models::apply_lora(*transformer_, lora.tensors, strength));
}

FluxPipeline::TextEmbeds FluxPipeline::encode(const std::vector<std::string>& prompts,
                                              int64_t max_sequence_length, int64_t per_prompt) {
    const auto dtype = transformer_->dtype();
    std::vector<at::Tensor> ids;
    for (const auto& p : prompts) ids.push_back(at::tensor(tokenizer_.encode(p, 77)));
    const at::Tensor clip_ids = at::stack(ids).to(device_);
    TextEmbeds e;
    e.pooled = text_encoder_->forward(clip_ids, false).pooler_output.to(dtype);  // [B, 768]
    const at::Tensor t5_ids = tokenizer_2_.encode_batch(prompts, max_sequence_length).to(device_);
    e.context = text_encoder_2_->forward(t5_ids).to(dtype);                          // [B, L, D]
    e.mask = tokenizer_2_.attention_mask(prompts, max_sequence_length).to(device_);  // [B, L]
    e.pooled = e.pooled.repeat_interleave(per_prompt, 0);
    e.context = e.context.repeat_interleave(per_prompt, 0);
    e.mask = e.mask.repeat_interleave(per_prompt, 0);
    return e;
}

namespace {

void check_request(const FluxRequest& r) {
    DTUNE_CHECK_AS(UsageError, !r.prompt.empty(), "generate needs at least one prompt");
    DTUNE_CHECK_AS(UsageError, r.steps >= 1, "steps = ", r.steps, " is invalid: use 1 or more");
    DTUNE_CHECK_AS(UsageError, r.width > 0 && r.height > 0 && r.width % 16 == 0 && r.height % 16 == 0,
                   "image size ", r.width, "x", r.height, " is invalid: Flux needs multiples of 16");
    DTUNE_CHECK_AS(UsageError, r.num_images_per_prompt >= 1, "num_images_per_prompt must be 1 or more");
    DTUNE_CHECK_AS(UsageError, std::isfinite(r.true_cfg_scale), "true_cfg_scale ", r.true_cfg_scale,
                   " is invalid: use a finite number (> 1 with a negative prompt for true CFG, e.g. 4.0)");
    DTUNE_CHECK_AS(UsageError, r.true_cfg_start_step >= 0, "true_cfg_start_step ", r.true_cfg_start_step,
                   " is invalid: use 0 (every step) or more");
    DTUNE_CHECK_AS(
        UsageError,
        !r.negative_prompt || r.negative_prompt->size() == 1 || r.negative_prompt->size() == r.prompt.size(),
        "the negative prompt list has ", r.negative_prompt ? r.negative_prompt->size() : 0, " entries for ",
        r.prompt.size(), " prompts; give one negative prompt or one per prompt");
}

// FluxPipeline's sigmas: linspace(1, 1/n, n).
std::vector<double> flux_sigmas(int64_t steps) {
    std::vector<double> sigmas(static_cast<size_t>(steps));
    for (int64_t i = 0; i < steps; ++i)
        sigmas[static_cast<size_t>(i)] =
            steps == 1 ? 1.0
                       : 1.0 + (1.0 / steps - 1.0) * static_cast<double>(i) / static_cast<double>(steps - 1);
    return sigmas;
}

}  // namespace

GenerationResult FluxPipeline::generate(const FluxRequest& r, const StepCallback& on_step) {
    check_request(r);
    DTUNE_CHECK_AS(
        UsageError, text_encoder_ && text_encoder_2_,
        "this Flux pipeline freed its text encoders after an earlier generate (free_text_encoders); "
        "load it again");
    const at::NoGradGuard no_grad;
    const auto dtype = transformer_->dtype();
    const int64_t b = static_cast<int64_t>(r.prompt.size()), n = r.num_images_per_prompt;
    const bool true_cfg = r.negative_prompt.has_value() && r.true_cfg_scale > 1;

    // Text: CLIP's pooled output and T5's sequence, each prompt repeated per image; the negative
    // prompts only for true CFG.
    const TextEmbeds pos = encode(r.prompt, r.max_sequence_length, n);
    TextEmbeds neg;
    if (true_cfg) {
        std::vector<std::string> negative = *r.negative_prompt;
        if (negative.size() == 1) negative.assign(r.prompt.size(), negative.front());
        neg = encode(negative, r.max_sequence_length, n);
    }
    const at::Tensor txt_ids = at::zeros({pos.context.size(1), 3}, at::TensorOptions(device_).dtype(dtype));
    if (r.free_text_encoders) {
        text_encoder_ = nullptr;
        text_encoder_2_ = nullptr;
#ifdef DTUNE_WITH_CUDA
        if (device_.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
    }

    // Latents: N(0, 1) on the CPU from the seed, then packed.
    const int64_t lh = 2 * (r.height / 16), lw = 2 * (r.width / 16);
    const int64_t c = transformer_->config().in_channels / 4;
    at::Tensor noise = r.latents;
    if (!noise.defined()) {
        at::Generator gen = at::detail::createCPUGenerator(r.seed);
        noise = at::randn({b * n, c, lh, lw}, gen, at::TensorOptions(at::kCPU).dtype(at::kFloat));
    }
    DTUNE_CHECK_AS(UsageError, noise.sizes() == at::IntArrayRef({b * n, c, lh, lw}), "latents of shape ",
                   noise.sizes(), " do not fit ", r.width, "x", r.height, " (expected [", b * n, ", ", c,
                   ", ", lh, ", ", lw, "])");
    at::Tensor latents = models::flux_pack_latents(noise.to(device_, dtype));
    const at::Tensor img_ids = models::flux_image_ids(lh, lw).to(device_, dtype);

    // Schedule: FluxPipeline's sigmas and the resolution-dependent shift.
    diffusion::FlowMatchEulerSampler sampler(scheduler_);
    sampler.set_timesteps(r.steps, flux_sigmas(r.steps),
                          diffusion::flow_match_mu(scheduler_, latents.size(1)));
    const at::Tensor guidance =
        transformer_->config().guidance_embeds
            ? at::full({b * n}, r.guidance_scale, at::TensorOptions(device_).dtype(at::kFloat))
            : at::Tensor();
    // Every step's timestep on the device up front: a copy from the host inside the loop would wait
    // for the previous step to finish, and the host would then launch each step's ~2,000 kernels
    // with the GPU idle.
    const at::Tensor timesteps = sampler.timesteps().to(device_, dtype);  // [steps]
    for (int64_t i = 0; i < r.steps; ++i) {
        const at::Tensor t = timesteps[i].expand({b * n});
        at::Tensor v = transformer_->forward(latents, pos.context, pos.pooled, t / 1000, guidance, img_ids,
                                             txt_ids, r.attention_mask ? pos.mask : at::Tensor());
        if (true_cfg && i >= r.true_cfg_start_step) {  // a second pass, as diffusers runs it (not batched)
            const at::Tensor v_neg =
                transformer_->forward(latents, neg.context, neg.pooled, t / 1000, guidance, img_ids, txt_ids,
                                      r.attention_mask ? neg.mask : at::Tensor());
            v = v_neg + r.true_cfg_scale * (v - v_neg);
        }
        latents = sampler.step(v, i, latents);
        if (r.on_latents)
            r.on_latents(StepLatents{i, r.steps, sampler.timesteps()[i].item<double>(),
                                     models::flux_unpack_latents(latents, lh, lw).to(at::kFloat)});
        if (on_step) on_step(i + 1, r.steps);
    }
    GenerationResult out;
    const at::Tensor unpacked = models::flux_unpack_latents(latents, lh, lw);
    out.latents = unpacked.to(at::kCPU, at::kFloat);
    if (r.decode) {
        const at::Tensor z = vae_->unscale_latents(unpacked);
        const at::Tensor decoded =
            r.vae_tiling ? vae_->decode_tiled(z, {}) : vae_->decode(z);  // [B*N, 3, H, W]
        out.images = decoded.to(at::kCPU, at::kFloat).div(2).add(0.5).clamp(0, 1);
    }
    return out;
}

}  // namespace dtune::validate
