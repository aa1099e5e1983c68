// The model-family layer: what differs between SDXL, Flux.1 and the next family, behind one
// interface, so that the trainer, the data path, validation, the reports and the CLI name no
// family's types. docs/ARCHITECTURE.md describes the data flow and where a new family plugs in.
//
//   ModelFamily            one object per family (family_named / family_of_model_folder); stateless
//     load_denoiser        → Denoiser: the trained network (SDXL's UNet, Flux's transformer) with a
//                            family-neutral forward(noisy latents, timesteps, conditioning)
//     load_data_encoders   → the data layer's callables: image → latents (scaling, shift), prompt →
//                            text-cache entry (named tensors), per-sample conditioning (SDXL's time ids)
//     drop_caption         caption dropout of one batch row
//     training_objective   the target and the timestep/sigma sampling (DDPM or flow matching)
//     load_sampler         the inference pipeline (validation images) around a live Denoiser
//     open_pipeline        the same pipeline from files (`dtune sample`)
//     lora_prefix / default_lora_targets   LoRA file prefix and target modules
//     export_pipeline / export_single_file  the trained weights as a loadable diffusers folder / file
//
// Conditioning is a name → tensor map with a batch dimension: a family's text-cache entry (one row
// per caption) plus what its dataset source adds per sample. The step, the CUDA graph and caption
// dropout move it as a whole, so a family adds inputs without touching them.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "data/cache_builder.h"
#include "diffusion/flow_match.h"
#include "diffusion/noise_schedule.h"
#include "diffusion/training_sampling.h"
#include "models/common/component.h"
#include "validate/generation.h"

namespace dtune::train {
class TrainConfig;
}

namespace dtune::family {

// name → [B, ...] (see the file comment). Ordered, so iteration (graph inputs, checkpoints) is stable.
using Conditioning = data::TextEmbeds;

// The trained network of a family, with a forward every family shares.
class Denoiser {
  public:
    virtual ~Denoiser() = default;
    // The network as a module: parameters, LoRA injection, EMA, checkpoints, quantisation.
    virtual torch::nn::Module& module() = 0;
    std::shared_ptr<torch::nn::Module> module_ptr() { return module().shared_from_this(); }
    // The prediction [B, C, h, w] for noisy latents [B, C, h, w] at `timesteps` [B] (DDPM: the
    // integer steps; flow matching: sigma · 1000, float), conditioned on `cond` (the family's names).
    virtual at::Tensor forward(const at::Tensor& noisy, const at::Tensor& timesteps,
                               const Conditioning& cond) = 0;
    // gradient_checkpointing (interval n: every n-th block). Returns (checkpointed, all) blocks.
    virtual std::pair<int64_t, int64_t> set_gradient_checkpointing(bool enabled, int64_t interval) = 0;
    // The dtype the network computes in (its dense dtype when quantised).
    virtual c10::ScalarType dtype() const = 0;
    // Convolution weights and activations in NHWC memory order (call before adapters, optimizer and
    // data-parallel set-up: the parameters' storage changes). False: the family has no such mode.
    virtual bool set_channels_last(bool enabled) {
        (void)enabled;
        return false;
    }
};

// What the step trains toward and how it draws timesteps.
struct TrainingObjective {
    // kDiffusion: DDPM noise schedule (epsilon / v-prediction / sample targets, min-SNR, timestep
    // bias). kFlowMatching: x_sigma = (1 - sigma) x0 + sigma noise, target noise - x0, sigmas drawn
    // by `flow` (SimpleTuner's flow_* options), the network sees sigma · 1000.
    enum class Kind { kDiffusion, kFlowMatching };
    Kind kind = Kind::kDiffusion;
    std::optional<diffusion::NoiseSchedule> schedule;  // kDiffusion
    diffusion::FlowMatchingOptions flow;               // kFlowMatching
    // kFlowMatching: the model folder's FlowMatchEulerDiscreteScheduler config as written. Eval loss
    // takes its fixed sigmas from it, with flow.shift as the static shift (SimpleTuner loads the
    // scheduler with shift=flow_schedule_shift; report/eval_loss.h). nullopt: the folder has none.
    std::optional<diffusion::FlowMatchConfig> flow_scheduler;

    TrainingObjective() = default;
    // A DDPM objective (implicit: tests and benchmarks pass a schedule where an objective is wanted).
    TrainingObjective(diffusion::NoiseSchedule s)  // NOLINT(google-explicit-constructor)
        : kind(Kind::kDiffusion), schedule(std::move(s)) {}
    bool flow_matching() const { return kind == Kind::kFlowMatching; }
    // The DDPM schedule; UsageError naming `what` for a flow-matching objective.
    const diffusion::NoiseSchedule& ddpm(const char* what) const;
};

struct DataEncoderOptions {
    std::filesystem::path model_dir;     // the diffusers folder (tokenizers, text encoders, vae)
    std::filesystem::path vae_override;  // pretrained_vae_model_name_or_path when a local folder
    c10::Device device = c10::Device(c10::kCPU);
    c10::ScalarType vae_dtype = c10::kFloat;  // bf16 on CUDA (SimpleTuner's default), fp32 on CPU
    // text_encoder_N_precision (core/quant_preset.h); "no_change" keeps an encoder dense. A
    // quantised encoder gives other embeddings, so its caches get another identity.
    std::array<std::string, 2> text_encoder_precision{"no_change", "no_change"};
    int64_t max_sequence_length = 0;  // T5 tokens (Flux: tokenizer_max_length; 0: the family's default)
};

// Steps and guidance a pipeline samples with when the user gives none.
struct SampleDefaults {
    int64_t steps = 30;
    double guidance = 5.0;
};

// An inference pipeline: around a live Denoiser (validation images during training) or opened
// from files (`dtune sample`).
class ImageSampler {
  public:
    virtual ~ImageSampler() = default;
    // The family's reading of the request (validate/generation.h): SDXL: CFG at guidance_scale;
    // Flux [dev]: guidance_scale is the embedded guidance, true_cfg_scale the optional real CFG.
    virtual validate::GenerationResult generate(const validate::GenerationRequest& request,
                                                const validate::StepCallback& on_step = {}) = 0;
    virtual SampleDefaults defaults() const { return {}; }
};

// What `dtune sample` opens: a diffusers folder, or a single file with `config_folder` for the
// configs; component weights from single files; the precision of the denoiser and the two text
// encoders (core/quant_preset.h); a LoRA.
struct PipelineSource {
    std::filesystem::path model;
    std::filesystem::path config_folder;
    std::filesystem::path text_encoder_file, text_encoder_2_file, vae_file;
    std::array<std::string, 3> precision{"no_change", "no_change", "no_change"};
    std::filesystem::path lora;
    double lora_scale = 1.0;
    c10::Device device = c10::Device(c10::kCPU);
    c10::ScalarType dtype = c10::kFloat;
};

struct SamplerLoadOptions {
    c10::Device device = c10::Device(c10::kCPU);
    c10::ScalarType dtype = c10::kFloat;
    std::filesystem::path vae_override;  // a VAE folder other than model_dir/vae
};

class ModelFamily {
  public:
    virtual ~ModelFamily() = default;
    // SimpleTuner's model_family value ("sdxl", "flux").
    virtual const char* name() const = 0;
    // The diffusers subfolder of the trained network ("unet", "transformer") and LoRA files' key
    // prefix for it (diffusers: "unet." / "transformer."; kohya: "lora_unet_" / "lora_transformer_").
    virtual const char* denoiser_folder() const = 0;
    // The network's name in messages ("UNet", "Flux transformer").
    virtual const char* network_name() const = 0;
    // The latent channels of the family's VAE (SDXL 4, Flux 16).
    virtual int64_t latent_channels() const = 0;
    virtual std::unique_ptr<Denoiser> load_denoiser(const std::filesystem::path& denoiser_dir,
                                                    const models::ComponentLoadOptions& options) const = 0;
    // The network of `denoiser_dir`'s config with the weights of a models::save_quantized file
    // (base_model_precision's quantized_model_cache).
    virtual std::unique_ptr<Denoiser> load_quantized_denoiser(
        const std::filesystem::path& denoiser_dir, const std::filesystem::path& file,
        const models::ComponentLoadOptions& options) const = 0;
    // Wraps an already built network of this family (tests, benchmarks); UsageError for another kind.
    virtual std::unique_ptr<Denoiser> wrap_denoiser(std::shared_ptr<torch::nn::Module> network) const = 0;
    virtual data::DataEncoders load_data_encoders(const DataEncoderOptions& options) const = 0;
    // Caption dropout: row `row` of `batch` takes the empty caption's conditioning `empty` (one
    // caption, no batch dimension) as the family's trainer does it.
    virtual void drop_caption(Conditioning& batch, int64_t row, const Conditioning& empty) const = 0;
    virtual TrainingObjective training_objective(const std::filesystem::path& model_dir) const = 0;
    // A run's family keys applied to its loaded network and to the objective from
    // training_objective (Flux: flow_*, flux_guidance_*, flux_attention_masked_training,
    // fuse_qkv_projections). Called once by the trainer; the default applies nothing.
    virtual void apply_training_config(const train::TrainConfig& /*config*/, Denoiser& /*denoiser*/,
                                       TrainingObjective& /*objective*/) const {}
    virtual std::unique_ptr<ImageSampler> load_sampler(const std::filesystem::path& model_dir,
                                                       Denoiser& denoiser,
                                                       const SamplerLoadOptions& options) const = 0;
    // The family's pipeline from files, with its LoRA applied (`dtune sample`).
    virtual std::unique_ptr<ImageSampler> open_pipeline(const PipelineSource& source) const = 0;
    // peft_lora_target_modules' default for this family.
    virtual std::vector<std::string> default_lora_targets() const = 0;
    // ... and for a run (Flux: flux_lora_target's list); the default is default_lora_targets().
    virtual std::vector<std::string> lora_targets(const train::TrainConfig& /*config*/) const {
        return default_lora_targets();
    }
    // model_type full: a diffusers folder with the trained network in denoiser_folder() and the
    // base's other components (family/export.h; `vae_dir` replaces the base's VAE), and the
    // family's single file.
    virtual void export_pipeline(const std::filesystem::path& base_model_dir,
                                 const torch::nn::Module& network, const std::filesystem::path& out_dir,
                                 const std::optional<std::filesystem::path>& vae_dir) const;
    // UsageError when the family has no single-file export.
    virtual void export_single_file(const std::filesystem::path& base_model_dir,
                                    const torch::nn::Module& network, const std::filesystem::path& out_file,
                                    const std::optional<std::filesystem::path>& vae_dir) const = 0;
    // The name of the single file export_single_file writes in output_dir ("" when none).
    virtual const char* single_file_name() const = 0;
    // validation_preview's tiny autoencoder when validation_preview_model is unset: the Hugging Face
    // id of a diffusers AutoencoderTiny for this family's latents (SimpleTuner's VALIDATION_PREVIEW_SPEC).
    virtual const char* preview_decoder_id() const = 0;
};

// The family of SimpleTuner's model_family value; UsageError listing the known ones otherwise.
const ModelFamily& family_named(const std::string& name);
// The family a diffusers folder's model_index.json names (StableDiffusionXLPipeline → sdxl,
// FluxPipeline → flux); nullptr without model_index.json or for another class.
const ModelFamily* family_of_model_folder(const std::filesystem::path& model_dir);
// The family of what `dtune sample --model` names: a folder by its model_index.json, a single
// file by its keys (Flux's transformer layout, else an SDXL checkpoint). Anything else goes to
// SDXL, whose loader explains what the folder or file is not.
const ModelFamily& family_of_model(const std::filesystem::path& model);
// Every family's name, for messages ("sdxl, flux").
std::string family_names();

}  // namespace dtune::family
