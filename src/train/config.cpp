// TrainConfig: option table, JSON/CLI parsing, typed access, resolved output (see config.h).
#include "train/config.h"
#include "train/config_toml.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <limits>
#include <map>

#include "core/config_json.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/quant_preset.h"
#include "core/redact.h"
#include "core/resolution_range.h"
#include "family/family_names.h"
#include "train/simpletuner_options.h"

namespace dtune::train {
namespace {

using nlohmann::json;

// clang-format off
// Built on first use: the CLI's usage text reads it during static initialisation.
const std::vector<OptionSpec>& specs() {
    static const std::vector<OptionSpec> kSpecs = {
    {"model_family", OptionType::kString, "null", "model architecture (required): sdxl, or flux (Flux.1 [dev]/[schnell])", "sdxl,flux"},
    {"model_type", OptionType::kString, "\"full\"", "lora or full fine-tune", "full,lora"},
    {"model_flavour", OptionType::kString, "null", "SDXL: base-1.0 (default), refiner-1.0, base-0.9, refiner-0.9; Flux: dev or krea (trained alike), schnell (T5 256 tokens, needs flux_fast_schedule); the weights always come from pretrained_model_name_or_path", "base-1.0,refiner-1.0,base-0.9,refiner-0.9,dev,krea,schnell"},
    {"pretrained_model_name_or_path", OptionType::kString, "\"\"", "local diffusers model folder", nullptr},
    {"pretrained_vae_model_name_or_path", OptionType::kString, "\"madebyollin/sdxl-vae-fp16-fix\"", "VAE folder (a local folder; a hub id falls back to <model>/vae)", nullptr},
    {"output_dir", OptionType::kString, "\"simpletuner-results\"", "where checkpoints, metrics and outputs go", nullptr},
    {"data_backend_config", OptionType::kString, "null", "path to multidatabackend.json", nullptr},
    {"lora_type", OptionType::kString, "\"standard\"", "LoRA implementation", "standard"},
    {"lora_rank", OptionType::kInt, "16", "LoRA rank", nullptr},
    {"lora_alpha", OptionType::kFloat, "null", "LoRA alpha (default: the rank)", nullptr},
    {"lora_dropout", OptionType::kFloat, "0.1", "LoRA dropout", nullptr},
    {"lora_init_type", OptionType::kString, "\"default\"", "LoRA initialisation", "default,gaussian,loftq,olora,pissa"},
    {"use_dora", OptionType::kBool, "false", "DoRA (weight-decomposed LoRA)", nullptr},
    {"lora_format", OptionType::kString, "\"diffusers\"", "LoRA file key format", "diffusers,comfyui"},
    {"init_lora", OptionType::kString, "\"\"", "start from an existing LoRA file", nullptr},
    {"peft_lora_target_modules", OptionType::kAny, "null", "LoRA target module suffixes: JSON list or JSON file (default to_k,to_q,to_v,to_out.0)", nullptr},
    {"learning_rate", OptionType::kFloat, "4e-7", "base learning rate", nullptr},
    {"lr_scheduler", OptionType::kString, "\"constant_with_warmup\"", "LR schedule", "constant,constant_with_warmup,linear,cosine,cosine_with_warmup,cosine_with_restarts,polynomial,sine"},
    {"lr_warmup_steps", OptionType::kInt, "0", "LR warmup steps", nullptr},
    {"lr_end", OptionType::kFloat, "4e-7", "final LR of polynomial / sine", nullptr},
    {"lr_power", OptionType::kFloat, "0.8", "polynomial power", nullptr},
    {"lr_num_cycles", OptionType::kFloat, "1", "cosine_with_restarts cycles", nullptr},
    {"optimizer", OptionType::kString, "\"adamw_bf16\"", "optimizer", "adamw_bf16,torch-adamw,optimi-adamw,optimi-lion,torch-sgd,torch-adafactor"},
    {"optimizer_config", OptionType::kString, "null", "extra optimizer kwargs \"key=value,...\" (not supported yet unless empty)", nullptr},
    {"adam_beta1", OptionType::kFloat, "0.9", "Adam beta1", nullptr},
    {"adam_beta2", OptionType::kFloat, "0.999", "Adam beta2", nullptr},
    {"adam_weight_decay", OptionType::kFloat, "0.01", "decoupled weight decay", nullptr},
    {"adam_epsilon", OptionType::kFloat, "1e-8", "Adam epsilon", nullptr},
    {"max_grad_norm", OptionType::kFloat, "2.0", "gradient clip threshold (0: off)", nullptr},
    {"grad_clip_method", OptionType::kString, "\"value\"", "clip by value or by global norm", "value,norm"},
    {"train_batch_size", OptionType::kInt, "4", "images per step per GPU", nullptr},
    {"gradient_accumulation_steps", OptionType::kInt, "1", "micro-batches per optimizer step", nullptr},
    {"max_train_steps", OptionType::kInt, "null", "optimizer steps (overrides epochs; 0 = unset)", nullptr},
    {"num_train_epochs", OptionType::kInt, "1", "epochs when max_train_steps is unset", nullptr},
    {"checkpoint_step_interval", OptionType::kInt, "500", "save a checkpoint every N steps (alias checkpointing_steps)", nullptr},
    {"checkpoints_total_limit", OptionType::kInt, "5", "checkpoints kept (older ones deleted)", nullptr},
    {"resume_from_checkpoint", OptionType::kString, "\"latest\"", "latest, a checkpoint path, or none", nullptr},
    {"mixed_precision", OptionType::kString, "\"bf16\"", "compute precision", "no,bf16,fp16"},
    {"scheduled_sampling_max_step_offset", OptionType::kInt, "0", "scheduled sampling: roll samples out from up to this many timesteps above their training timestep with the model's own predictions (0: off)", nullptr},
    {"scheduled_sampling_probability", OptionType::kFloat, "0.0", "scheduled sampling: the share of samples rolled out (without a ramp)", nullptr},
    {"scheduled_sampling_prob_start", OptionType::kFloat, "0.0", "scheduled sampling: the share at the ramp's start (0: scheduled_sampling_probability)", nullptr},
    {"scheduled_sampling_prob_end", OptionType::kFloat, "0.5", "scheduled sampling: the share at the ramp's end (0: scheduled_sampling_probability)", nullptr},
    {"scheduled_sampling_ramp_steps", OptionType::kInt, "0", "scheduled sampling: steps from prob_start to prob_end (0: no ramp)", nullptr},
    {"scheduled_sampling_ramp_shape", OptionType::kString, "\"linear\"", "scheduled sampling: ramp shape", "linear,cosine"},
    {"scheduled_sampling_start_step", OptionType::kInt, "0", "scheduled sampling: the step the ramp starts at", nullptr},
    {"scheduled_sampling_strategy", OptionType::kString, "\"uniform\"", "scheduled sampling: how offsets are drawn", "uniform,biased_early,biased_late"},
    {"scheduled_sampling_sampler", OptionType::kString, "\"unipc\"", "scheduled sampling: the rollout sampler (every value takes the first-order DDIM/Euler step over one-timestep steps; README)", "unipc,unip,dpm,euler"},
    {"scheduled_sampling_order", OptionType::kInt, "2", "scheduled sampling: the sampler's order (see scheduled_sampling_sampler)", nullptr},
    {"base_model_precision", OptionType::kString, "\"no_change\"", "quantise the frozen UNet of a LoRA/DoRA: int8-quanto, int8-torchao (int8 weights), fp8-quanto, fp8-torchao (fp8 e4m3 weights, fp8 matmuls on Hopper); half the memory of bf16", nullptr},
    {"quantize_via", OptionType::kString, "\"accelerator\"", "where base_model_precision quantises the frozen network: accelerator (on the training device) or cpu (in host memory, then moved: a lower GPU memory peak, the same quantisation)", "accelerator,cpu"},
    {"quantized_model_cache", OptionType::kString, "\"\"", "dtune: a folder for the quantised UNet of base_model_precision: the first run writes it, later runs load it instead of the full-precision weights (empty: off)", nullptr},
    {"text_encoder_1_precision", OptionType::kString, "\"no_change\"", "quantise text encoder 1 (CLIP-L): same values as base_model_precision", nullptr},
    {"text_encoder_2_precision", OptionType::kString, "\"no_change\"", "quantise text encoder 2 (OpenCLIP bigG): same values as base_model_precision", nullptr},
    {"gradient_checkpointing", OptionType::kBool, "true", "recompute activations in backward", nullptr},
    {"gradient_checkpointing_interval", OptionType::kInt, "null", "with gradient_checkpointing: checkpoint every N-th ResNet/transformer block (null or 1: all; 2: every other, less recompute, more memory)", nullptr},
    {"seed", OptionType::kInt, "null", "random seed (None/0: time-based, -1: random)", nullptr},
    {"noise_offset", OptionType::kFloat, "0.1", "offset-noise strength (needs offset_noise)", nullptr},
    {"noise_offset_probability", OptionType::kFloat, "0.25", "probability of offset noise per step", nullptr},
    {"offset_noise", OptionType::kBool, "false", "enable offset noise", nullptr},
    {"input_perturbation", OptionType::kFloat, "0.0", "input perturbation strength", nullptr},
    {"snr_gamma", OptionType::kFloat, "null", "min-SNR gamma (5 is typical)", nullptr},
    {"snr_weight", OptionType::kFloat, "1.0", "multiplies the l2 loss while snr_gamma is unset (SimpleTuner applies it nowhere else)", nullptr},
    {"use_soft_min_snr", OptionType::kBool, "false", "accepted for SimpleTuner configs: it has not changed the loss there since 2024, nor here", nullptr},
    {"soft_min_snr_sigma_data", OptionType::kFloat, "null", "with use_soft_min_snr: no effect, as in SimpleTuner", nullptr},
    {"diff2flow_enabled", OptionType::kBool, "false", "Diff2Flow bridge for epsilon / v models (needed by diff2flow_loss)", nullptr},
    {"diff2flow_loss", OptionType::kBool, "false", "with diff2flow_enabled: train the prediction converted to a flow field toward noise - latents (plain MSE)", nullptr},
    {"loss_type", OptionType::kString, "\"l2\"", "training loss: l2, or the pseudo-Huber huber 2c(sqrt(d^2+c^2)-c) / smooth_l1 2(sqrt(d^2+c^2)-c)", "l2,huber,smooth_l1"},
    {"huber_schedule", OptionType::kString, "\"snr\"", "c per sample for huber / smooth_l1: snr (1-huber_c)/(1+sigma_t)^2+huber_c, exponential huber_c^(t/T), constant huber_c", "snr,exponential,constant"},
    {"huber_c", OptionType::kFloat, "0.1", "the pseudo-Huber c (see huber_schedule)", nullptr},
    {"timestep_bias_strategy", OptionType::kString, "null", "weight the timestep draws: earlier or later (timestep_bias_portion of them), range (timestep_bias_begin to _end), none", "earlier,later,range,none"},
    {"timestep_bias_multiplier", OptionType::kFloat, "1.0", "weight of the biased timesteps against 1 for the rest (> 0)", nullptr},
    {"timestep_bias_begin", OptionType::kInt, "0", "range strategy: first biased timestep", nullptr},
    {"timestep_bias_end", OptionType::kInt, "1000", "range strategy: one past the last biased timestep", nullptr},
    {"timestep_bias_portion", OptionType::kFloat, "0.25", "earlier / later: the fraction of timesteps biased", nullptr},
    {"disable_segmented_timestep_sampling", OptionType::kBool, "false", "draw every sample's timestep from all timesteps (default: one segment of [0, T) per sample when the batch is > 1)", nullptr},
    {"prediction_type", OptionType::kString, "null", "override the scheduler's prediction type (SDXL: epsilon, v_prediction, sample); Flux trains flow_matching only", "epsilon,v_prediction,sample,flow_matching"},
    {"flow_schedule_shift", OptionType::kFloat, "3.0", "flow matching: static shift s of the training sigmas, s*sigma/(1+(s-1)*sigma) (<= 0 or null: none)", nullptr},
    {"flow_schedule_auto_shift", OptionType::kBool, "false", "flow matching: the shift from the image's token count (exp(mu), scheduler_config.json's base/max_shift line); replaces flow_schedule_shift", nullptr},
    {"flow_sigmoid_scale", OptionType::kFloat, "1.0", "flow matching: logit-normal sigmas sigmoid(scale*N(0,1)) (the default schedule)", nullptr},
    {"flow_use_uniform_schedule", OptionType::kBool, "false", "flow matching: sigmas U(0,1), then shifted (wins over the Beta and fast schedules)", nullptr},
    {"flow_use_beta_schedule", OptionType::kBool, "false", "flow matching: sigmas Beta(flow_beta_schedule_alpha, flow_beta_schedule_beta), then shifted", nullptr},
    {"flow_beta_schedule_alpha", OptionType::kFloat, "2.0", "flow matching: the Beta schedule's alpha", nullptr},
    {"flow_beta_schedule_beta", OptionType::kFloat, "2.0", "flow matching: the Beta schedule's beta", nullptr},
    {"flux_fast_schedule", OptionType::kBool, "false", "Flux: sigmas 1 (7 in 10), 0.75, 0.5 or 0.25, never shifted ([schnell]'s schedule; uniform and Beta win over it)", nullptr},
    {"flux_guidance_mode", OptionType::kString, "\"constant\"", "Flux [dev]: the guidance embedded during training: constant (flux_guidance_value) or random-range (per sample, uniform in [flux_guidance_min, flux_guidance_max])", "constant,random-range"},
    {"flux_guidance_value", OptionType::kFloat, "1.0", "Flux [dev]: the constant training guidance (1 keeps the guidance distillation; [schnell] has no guidance input)", nullptr},
    {"flux_guidance_min", OptionType::kFloat, "0.0", "Flux [dev]: random-range's lower end", nullptr},
    {"flux_guidance_max", OptionType::kFloat, "4.0", "Flux [dev]: random-range's upper end", nullptr},
    {"flux_attention_masked_training", OptionType::kBool, "false", "Flux: leave T5's padding tokens out of the joint attention as keys, in training and validation", nullptr},
    {"flux_lora_target", OptionType::kString, "\"all\"", "Flux LoRA layers (SimpleTuner's lists): all (both streams' attention), mmdit (image attention), context (text attention), context+ffs, all+ffs, all+ffs+embedder, ai-toolkit, tiny and nano (single blocks 7 and 20 / 7); peft_lora_target_modules wins", "mmdit,context,context+ffs,all,all+ffs,all+ffs+embedder,ai-toolkit,tiny,nano"},
    {"fuse_qkv_projections", OptionType::kBool, "false", "Flux: each attention stream's q, k and v as one matmul over the stacked weights (the same products, no faster here; LoRA keeps its per-projection adapters, so its file loads in diffusers as usual)", nullptr},
    {"tokenizer_max_length", OptionType::kInt, "null", "ignored with a warning, as in SimpleTuner: Flux's T5 takes 512 tokens (model_flavour schnell: 256), SDXL's CLIP 77; the config records the length used", nullptr},
    {"disable_assistant_lora", OptionType::kBool, "false", "model_flavour schnell LoRA runs: train without SimpleTuner's assistant LoRA (dtune loads none and downloads nothing, so such runs must set it)", nullptr},
    {"caption_dropout_probability", OptionType::kFloat, "0.1", "probability of training on the empty caption", nullptr},
    {"use_ema", OptionType::kBool, "false", "exponential moving average of the trained weights", nullptr},
    {"ema_decay", OptionType::kFloat, "0.995", "EMA decay", nullptr},
    {"ema_device", OptionType::kString, "\"cpu\"", "where the float32 EMA weights live", "cpu,accelerator"},
    {"ema_cpu_only", OptionType::kBool, "false", "update the EMA on the CPU (dtune always does with ema_device cpu)", nullptr},
    {"ema_update_interval", OptionType::kInt, "null", "update the EMA every N steps (None: every step)", nullptr},
    {"ema_warmup_steps", OptionType::kInt, "0", "copy the weights into the EMA before this step, then use ema_decay", nullptr},
    {"ema_foreach_disable", OptionType::kBool, "false", "per-tensor EMA updates instead of foreach ops", nullptr},
    {"allow_dataset_oversubscription", OptionType::kBool, "false", "repeat small buckets to fill a batch", nullptr},
    {"disable_bucket_pruning", OptionType::kBool, "false", "keep aspect buckets with fewer samples than train_batch_size (by default they are pruned, as SimpleTuner does)", nullptr},
    {"resolution", OptionType::kFloat, "1024", "dataset fallback resolution", nullptr},
    {"resolution_type", OptionType::kString, "\"pixel_area\"", "dataset fallback resolution type", "pixel,area,pixel_area"},
    {"vae_cache_disable", OptionType::kBool, "false", "encode latents on the fly every step (no latent cache)", nullptr},
    {"vae_cache_ondemand", OptionType::kBool, "false", "encode missing latents when first used instead of at start", nullptr},
    {"random_flip", OptionType::kBool, "false", "mirror training images left-right at random (diffusers' key; a dataset entry may override it)", nullptr},
    {"vae_batch_size", OptionType::kInt, "4", "images per VAE call when building the latent cache", nullptr},
    {"compress_disk_cache", OptionType::kBool, "true", "zstd-compress cache entries (datasets' compress_cache wins)", nullptr},
    {"cache_dir_vae", OptionType::kString, "\"\"", "latent cache folder fallback (default <output_dir>/cache/vae/<family>/<id>)", nullptr},
    {"cache_dir_text", OptionType::kString, "\"\"", "cache_dir of text_embeds entries that set none (default <output_dir>/cache/text)", nullptr},
    {"dataloader_prefetch", OptionType::kBool, "false", "prepare dataloader_prefetch_qlen batches ahead (else 2)", nullptr},
    {"dataloader_prefetch_qlen", OptionType::kInt, "10", "batches prepared ahead with dataloader_prefetch", nullptr},
    {"instance_prompt", OptionType::kString, "null", "caption fallback for datasets (caption_strategy instanceprompt)", nullptr},
    {"caption_strategy", OptionType::kString, "\"filename\"", "dataset fallback: where captions come from", "filename,textfile,instanceprompt,parquet"},
    {"prepend_instance_prompt", OptionType::kBool, "false", "dataset fallback: put instance_prompt before every caption", nullptr},
    {"only_instance_prompt", OptionType::kBool, "false", "dataset fallback: train every image on instance_prompt alone", nullptr},
    {"skip_file_discovery", OptionType::kString, "\"\"", "dataset fallback: scans to skip, from vae aspect text metadata", nullptr},
    {"parquet_filename_column", OptionType::kString, "\"id\"", "dataset fallback for the parquet block's filename_column", nullptr},
    {"parquet_caption_column", OptionType::kString, "\"description\"", "dataset fallback for the parquet block's caption_column", nullptr},
    {"minimum_image_size", OptionType::kFloat, "null", "dataset fallback: skip smaller images", nullptr},
    {"maximum_image_size", OptionType::kFloat, "null", "dataset fallback: downsample larger images first", nullptr},
    {"target_downsample_size", OptionType::kFloat, "null", "dataset fallback: size to downsample to", nullptr},
    {"report_to", OptionType::kString, "\"none\"", "trackers, comma-separated (metrics.jsonl is always written): none, tensorboard (output_dir/logs/dtune), wandb (not available: TensorBoard logs instead), all", nullptr},
    {"webhook_config", OptionType::kAny, "null", "webhook JSON path or inline object", nullptr},
    {"validation_prompt", OptionType::kString, "\"\"", "validation prompt (shortname \"validation\" in file names)", nullptr},
    {"validation_step_interval", OptionType::kInt, "100", "validation every N steps (alias validation_steps)", nullptr},
    {"validation_epoch_interval", OptionType::kInt, "null", "also validate after every N completed epochs", nullptr},
    {"validation_resolution", OptionType::kString, "\"256\"", "validation image size(s)", nullptr},
    {"validation_guidance", OptionType::kFloat, "7.5", "validation CFG scale", nullptr},
    {"validation_guidance_rescale", OptionType::kFloat, "0.0", "validation CFG rescale", nullptr},
    {"validation_guidance_real", OptionType::kFloat, "1.0", "Flux validation: true CFG with validation_negative_prompt when > 1 (two transformer passes a step; validation_guidance stays the embedded guidance)", nullptr},
    {"validation_no_cfg_until_timestep", OptionType::kInt, "2", "Flux validation with validation_guidance_real > 1: true CFG from this sampler step on", nullptr},
    {"validation_num_inference_steps", OptionType::kInt, "30", "validation sampler steps", nullptr},
    {"validation_negative_prompt", OptionType::kString, "\"blurry, cropped, ugly\"", "validation negative prompt", nullptr},
    {"validation_seed", OptionType::kInt, "null", "validation seed", nullptr},
    {"validation_noise_scheduler", OptionType::kString, "null", "validation sampler", nullptr},
    {"validation_disable", OptionType::kBool, "false", "disable validation", nullptr},
    {"validation_disable_unconditional", OptionType::kBool, "false", "true: no validation image for the empty prompt (dtune renders none either way; SimpleTuner's extra unconditional image is not implemented)", nullptr},
    {"evaluation_type", OptionType::kString, "\"none\"", "score validation images: clip (CLIP score of each prompt's image, logged as clip/min, clip/max, clip/mean, clip/std) or none", "none,clip"},
    {"pretrained_evaluation_model_name_or_path", OptionType::kString, "\"openai/clip-vit-large-patch14-336\"", "the CLIP model for evaluation_type clip: a local CLIPModel folder, or a hub id already in the Hugging Face cache", nullptr},
    {"validation_preview", OptionType::kBool, "false", "send TAESD previews of validation sampling to raw webhooks as validation.image events (needs webhook_config)", nullptr},
    {"validation_preview_steps", OptionType::kInt, "1", "preview after the first sampler step and every N-th", nullptr},
    {"validation_preview_model", OptionType::kString, "\"\"", "dtune: a local diffusers AutoencoderTiny folder for validation_preview (default: madebyollin/taesdxl from the Hugging Face cache)", nullptr},
    {"num_validation_images", OptionType::kInt, "1", "validation images per prompt", nullptr},
    {"user_prompt_library", OptionType::kString, "null", "JSON file {shortname: prompt} of more validation prompts", nullptr},
    {"disable_benchmark", OptionType::kBool, "false", "skip the base model's validation images at step 0", nullptr},
    {"eval_steps_interval", OptionType::kInt, "null", "eval loss every N steps (default: validation_step_interval)", nullptr},
    {"num_eval_images", OptionType::kInt, "4", "eval images scored per eval", nullptr},
    {"eval_timesteps", OptionType::kInt, "28", "fixed timesteps per eval image", nullptr},
    {"eval_loss_disable", OptionType::kBool, "false", "skip eval loss on dataset_type eval datasets", nullptr},
    // dtune's own keys (not SimpleTuner's).
    {"deterministic", OptionType::kBool, "false", "dtune: deterministic algorithms (CPU runs are bit-reproducible)", nullptr},
    {"device", OptionType::kString, "\"auto\"", "dtune: cpu, cuda, cuda:N or auto", nullptr},
    {"metrics_interval", OptionType::kInt, "1", "dtune: write metrics.jsonl every N steps", nullptr},
    {"offload_optimizer_device", OptionType::kString, "null", "dtune: none, or cpu to keep the optimizer state and its update in host memory (default: accelerate's deepspeed_config.offload_optimizer_device via dtune launch, else none)", "none,cpu"},
    {"zero_stage", OptionType::kInt, "null", "dtune: ZeRO stage for multi-GPU runs, 0, 1, 2 or 3 (3: parameters sharded too; default: accelerate's deepspeed_config.zero_stage via dtune launch, else 0)", nullptr},
    {"offload_param_device", OptionType::kString, "null", "dtune: none, or cpu to keep each rank's ZeRO-3 parameter shards in pinned host memory, copied to the device before each gather (needs zero_stage 3, and offload_optimizer_device cpu for a full fine-tune; default: accelerate's deepspeed_config.offload_param_device via dtune launch, else none)", nullptr},
    {"fsdp_enable", OptionType::kBool, "false", "FSDP: true runs dtune's ZeRO stage 3 (parameters, gradients and optimizer state sharded by block)", nullptr},
    {"fsdp_version", OptionType::kInt, "2", "FSDP version: 1 and 2 both run dtune's ZeRO stage 3", nullptr},
    {"fsdp_cpu_offload", OptionType::kBool, "false", "FSDP: true keeps ZeRO stage 3's parameter shards and the optimizer state and update in host memory (the same as offload_param_device cpu plus offload_optimizer_device cpu; an explicit other value of either is refused)", nullptr},
    {"fsdp_reshard_after_forward", OptionType::kBool, "true", "ZeRO-3/FSDP: free a block's gathered parameters after its forward and gather them again for its backward (false: keep them until its backward: less communication, more memory)", nullptr},
    {"cuda_graph", OptionType::kString, "\"auto\"", "dtune: train each batch shape's whole step as one CUDA graph; auto = on CUDA whenever the run's options allow it (any optimizer and mixed_precision; any timestep bias and flow sigma schedule; not scheduled sampling), true = also warn when they do not, false = never", "auto,true,false"},
    {"export_single_file", OptionType::kBool, "false", "dtune: full fine-tunes also write one file: SDXL output_dir/sdxl_checkpoint.safetensors (UNet, VAE and text encoders, ldm keys); Flux output_dir/flux_transformer.safetensors (the transformer in Black Forest Labs' layout, as flux1-dev.safetensors)", nullptr},
    };
    return kSpecs;
}

// Options of older SimpleTuner releases that its current parser no longer knows; configs written for
// those releases still carry them, so they are accepted at their old default.
const std::vector<std::pair<const char*, const char*>> kRetired = {
    {"ignore_final_epochs", "false"}, {"validation_torch_compile", "false"}, {"lora_target_modules", "null"},
    {"max_grad_value", "null"}, {"disable_multiprocessing", "false"},
};
// clang-format on

// Keys that only label things dtune does not do (publishing to the Hugging Face hub, which needs
// push_to_hub, itself refused unless false; naming runs of trackers dtune lacks): any value is
// accepted and changes nothing.
const std::vector<std::string> kLabelsOnly = {"hub_model_id", "tracker_project_name", "tracker_run_name"};

// Keys SimpleTuner's config loader (cli_utils.py's legacy handlers) drops before parsing: dataset
// settings that belong in multidatabackend.json and the WebUI's bookkeeping.
const std::vector<std::string> kDroppedBySimpleTuner = {
    "aspect_ratio_bucketing", "aspect_ratio_bucket_min", "aspect_ratio_bucket_max", "repeats",
    "ez_model_type",          "__disabled_fields__",     "__active_tab__"};
// The values a numeric option may take, where a sign or a range means something. Checked when the
// value is typed (config.json, config.toml, the command line, a resolved file alike), so code that
// reads an option never sees one outside its range. `min_open`/`max_open`: the bound itself is
// refused. `note` says what the edge values mean.
struct OptionRange {
    const char* name;
    double min;
    double max;
    bool min_open;
    bool max_open;
    const char* note;
};
constexpr double kInf = std::numeric_limits<double>::infinity();
// SimpleTuner hands a positive seed to numpy, which takes 0 to 2**32 - 1; 0 and -1 ask for a fresh one.
constexpr double kMaxSeed = 4294967295.0;

// clang-format off
const std::vector<OptionRange> kRanges = {
    {"lora_rank", 1, kInf, false, false, ""},
    {"lora_alpha", 0, kInf, true, false, ""},
    {"lora_dropout", 0, 1, false, true, ""},
    {"learning_rate", 0, kInf, true, false, ""},
    {"lr_warmup_steps", 0, kInf, false, false, ""},
    {"lr_end", 0, kInf, false, false, ""},
    {"lr_power", 0, kInf, false, false, ""},
    {"lr_num_cycles", 0, kInf, true, false, ""},
    {"adam_beta1", 0, 1, false, true, ""},
    {"adam_beta2", 0, 1, false, true, ""},
    {"adam_weight_decay", 0, kInf, false, false, ""},
    {"adam_epsilon", 0, kInf, false, false, ""},
    {"max_grad_norm", 0, kInf, false, false, " (0: no clipping)"},
    {"train_batch_size", 1, kInf, false, false, ""},
    {"gradient_accumulation_steps", 1, kInf, false, false, ""},
    {"max_train_steps", 0, kInf, false, false, " (0 or null: train num_train_epochs epochs)"},
    {"num_train_epochs", 0, kInf, false, false, ""},
    {"checkpoint_step_interval", 0, kInf, false, false, " (0: only the final save)"},
    {"checkpoints_total_limit", 0, kInf, false, false, " (0: keep every checkpoint)"},
    {"gradient_checkpointing_interval", 1, kInf, false, false, ""},
    {"seed", -1, kMaxSeed, false, false, " (null, 0 or -1: a fresh seed, logged)"},
    {"noise_offset", 0, kInf, false, false, ""},
    {"noise_offset_probability", 0, 1, false, false, ""},
    {"input_perturbation", 0, kInf, false, false, ""},
    {"snr_gamma", 0, kInf, false, false, ""},
    {"snr_weight", 0, kInf, false, false, ""},
    {"huber_c", 0, kInf, true, false, " (huber_schedule exponential takes its logarithm)"},
    {"timestep_bias_portion", 0, 1, false, false, " (SimpleTuner: \"Timestep bias portion must be between 0.0 and 1.0.\")"},
    {"timestep_bias_begin", 0, kInf, false, false, ""},
    {"timestep_bias_end", 0, kInf, false, false, ""},
    {"caption_dropout_probability", 0, 1, false, false, ""},
    {"ema_decay", 0, 1, false, true, " (0.995 to 0.9999 are usual)"},
    {"ema_update_interval", 1, kInf, false, false, " (null: every step)"},
    {"ema_warmup_steps", 0, kInf, false, false, ""},
    {"resolution", 0, kInf, true, false, ""},  // and the range of its resolution_type, in validate()
    {"vae_batch_size", 1, kInf, false, false, ""},
    {"dataloader_prefetch_qlen", 1, kInf, false, false, ""},
    {"minimum_image_size", 0, kInf, false, false, ""},
    {"maximum_image_size", 0, kInf, true, false, ""},
    {"target_downsample_size", 0, kInf, true, false, ""},
    {"validation_step_interval", 0, kInf, false, false, " (0: no step-interval validation)"},
    {"validation_epoch_interval", 0, kInf, false, false, " (0 or null: none)"},
    {"validation_guidance", 0, kInf, false, false, ""},
    {"validation_guidance_rescale", 0, 1, false, false, ""},
    {"validation_guidance_real", 1, kInf, false, false, " (1: no true CFG)"},
    {"validation_no_cfg_until_timestep", 0, kInf, false, false, ""},
    {"flow_beta_schedule_alpha", 0, kInf, true, false, ""},
    {"flow_beta_schedule_beta", 0, kInf, true, false, ""},
    {"flux_guidance_value", 0, kInf, false, false, ""},
    {"flux_guidance_min", 0, kInf, false, false, ""},
    {"flux_guidance_max", 0, kInf, false, false, ""},
    {"tokenizer_max_length", 1, 1024, false, false, ""},
    {"validation_num_inference_steps", 1, kInf, false, false, ""},
    {"validation_preview_steps", 1, kInf, false, false, ""},
    {"validation_seed", 0, kMaxSeed, false, false, " (null: the training seed)"},
    {"num_validation_images", 1, kInf, false, false, ""},
    {"eval_steps_interval", 0, kInf, false, false, " (0: no eval loss by steps)"},
    {"num_eval_images", 1, kInf, false, false, ""},
    {"eval_timesteps", 1, kInf, false, false, ""},
    {"metrics_interval", 1, kInf, false, false, ""},
    {"zero_stage", 0, 3, false, false, ""},
    {"fsdp_version", 1, 2, false, false, ""},
};
// clang-format on

const OptionRange* find_range(const std::string& key) {
    for (const auto& r : kRanges)
        if (key == r.name) return &r;
    return nullptr;
}

// "at least 1", "0 to 4294967295", "> 0", "[0, 1)": the allowed values as a reader would say them.
std::string range_text(const OptionSpec& spec, const OptionRange* r) {
    const bool is_int = spec.type == OptionType::kInt;
    const auto num = [&](double v) { return is_int ? std::to_string(static_cast<int64_t>(v)) : str(v); };
    if (!r)
        return is_int ? str(std::numeric_limits<int64_t>::min(), " to ", std::numeric_limits<int64_t>::max())
                      : std::string("any number");
    std::string out;
    if (r->max == kInf)
        out = r->min_open ? str("greater than ", num(r->min)) : str("at least ", num(r->min));
    else if (is_int)
        out = str(num(r->min), " to ", num(r->max));
    else
        out = str(r->min_open ? "(" : "[", num(r->min), ", ", num(r->max), r->max_open ? ")" : "]");
    return out + r->note;
}

[[noreturn]] void fail_range(const OptionSpec& spec, const json& value, const std::string& source) {
    throw UsageError(str(source, ": option ", spec.name, " = ", value.dump(),
                         " is out of range; allowed: ", range_text(spec, find_range(spec.name))));
}

// `value` is typed already (coerce); null is always allowed (SimpleTuner's None).
void check_range(const OptionSpec& spec, const json& value, const std::string& source) {
    const OptionRange* r = find_range(spec.name);
    if (!r || !value.is_number()) return;
    const double v = value.get<double>();
    const bool low_ok = r->min_open ? v > r->min : v >= r->min;
    const bool high_ok = r->max_open ? v < r->max : v <= r->max;
    if (!(low_ok && high_ok)) fail_range(spec, value, source);
}

const std::map<std::string, std::string> kAliases = {
    {"checkpointing_steps", "checkpoint_step_interval"},
    {"validation_steps", "validation_step_interval"},
};

const OptionSpec* find_spec(const std::string& key) {
    for (const auto& s : specs())
        if (key == s.name) return &s;
    return nullptr;
}

const char* retired_default(const std::string& key) {
    for (const auto& [name, def] : kRetired)
        if (key == name) return def;
    return nullptr;
}

// "--learning_rate" -> "learning_rate"; aliases -> canonical names.
std::string canonical_key(std::string key) {
    while (!key.empty() && key.front() == '-') key.erase(key.begin());
    std::replace(key.begin(), key.end(), '-', '_');
    auto alias = kAliases.find(key);
    if (alias != kAliases.end()) return alias->second;
    // SimpleTuner's other spellings of an option (fused_qkv_projections -> fuse_qkv_projections).
    const SimpleTunerOption* option = find_simpletuner_option(key);
    return option ? std::string(option->name) : key;
}

std::string closest_key(const std::string& key) {
    std::string best;
    std::size_t best_d = std::string::npos;
    const auto consider = [&](const char* name) {
        const std::size_t d = edit_distance(key, name);
        if (d < best_d) best_d = d, best = name;
    };
    for (const auto& s : specs()) consider(s.name);
    for (const auto& o : simpletuner_options()) consider(o.name);
    return best;
}

std::string lower(std::string s) {
    for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return s;
}

// Python's spellings reach us from SimpleTuner configs and shells: None, True, False.
bool is_none_text(const std::string& text) {
    return text == "None" || text == "null" || text.empty();
}

// Whether `value` (as written: JSON or command-line text) equals SimpleTuner's default `d`. Text
// forms count ("None", "False", "64"); null also matches a default of "" or "none", which
// SimpleTuner treats as unset as well.
bool equals_default(const json& value, const json& d) {
    json v = value;
    if (v.is_string() && !d.is_string()) {
        const std::string text = v.get<std::string>();
        if (is_none_text(text)) {
            v = nullptr;
        } else if (lower(text) == "true" || lower(text) == "false") {
            v = lower(text) == "true";
        } else {
            json parsed = json::parse(text, nullptr, false);
            if (!parsed.is_discarded()) v = parsed;
        }
    }
    if (v.is_string() && d.is_string() && v.get<std::string>() == "None") v = nullptr;
    if (v == d) return true;
    return v.is_null() && d.is_string() && (d == "" || d == "none");
}

const char* type_name(OptionType t) {
    switch (t) {
        case OptionType::kString: return "a string";
        case OptionType::kInt: return "an integer";
        case OptionType::kFloat: return "a number";
        case OptionType::kBool: return "true or false";
        case OptionType::kAny: return "a value";
    }
    return "a value";
}

// Converts `value` to the option's type; strings are parsed (CLI and string-typed JSON values).
json coerce(const OptionSpec& spec, const json& value, const std::string& source) {
    const auto fail = [&]() -> json {
        throw UsageError(str(source, ": option ", spec.name, " = ", value.dump(), " is not ",
                             type_name(spec.type), "; write it as in the defaults (`dtune train --help`)"));
    };
    if (value.is_null() || spec.type == OptionType::kAny) return value;
    if (value.is_string() && spec.type != OptionType::kString) {
        const std::string text = value.get<std::string>();
        if (is_none_text(text)) return json(nullptr);
        if (spec.type == OptionType::kBool && (lower(text) == "true" || lower(text) == "false"))
            return json(lower(text) == "true");
        json parsed = json::parse(text, nullptr, false);
        if (parsed.is_discarded() || parsed.is_string()) return fail();
        return coerce(spec, parsed, source);
    }
    switch (spec.type) {
        case OptionType::kString:
            // Python's None for an option whose default is None (prediction_type, model_flavour...)
            // means unset, not a value named "None".
            if (value == "None" && std::string(spec.default_json) == "null") return json(nullptr);
            if (value.is_string()) return value;
            if (value.is_number() || value.is_boolean()) return json(value.dump());
            return fail();
        case OptionType::kInt:
            // Beyond int64 (99999999999999999999 parses as 1e20, 2**63 as an unsigned): out of
            // range, not a wrapped-around negative number.
            if (value.is_number_unsigned() &&
                value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
                fail_range(spec, value, source);
            if (value.is_number_integer()) return json(value.get<int64_t>());
            if (value.is_number_float()) {
                const double d = value.get<double>();
                if (std::floor(d) != d) return fail();
                if (!(d >= -9223372036854775808.0 && d < 9223372036854775808.0))
                    fail_range(spec, value, source);
                return json(static_cast<int64_t>(d));
            }
            return fail();
        case OptionType::kFloat:
            if (value.is_number()) return json(value.get<double>());
            return fail();
        case OptionType::kBool:
            if (value.is_boolean()) return value;
            if (value.is_number_integer() && (value == 0 || value == 1)) return json(value == 1);
            return fail();
        case OptionType::kAny: return value;
    }
    return fail();
}

// Every configuration problem of one run, so a config with eight mistakes takes one run to fix, not
// eight. A problem with model_family heads the list: the other checks depend on the family.
class ConfigProblems : public UsageError {
  public:
    explicit ConfigProblems(std::vector<std::string> items)
        : UsageError(format(items)), items_(std::move(items)) {}
    const std::vector<std::string>& items() const { return items_; }

  private:
    static std::string format(const std::vector<std::string>& items) {
        if (items.size() == 1) return items[0];
        std::string out = str(items.size(), " configuration problems (each needs a fix):");
        for (std::size_t i = 0; i < items.size(); ++i) out += str("\n  ", i + 1, ". ", items[i]);
        return out;
    }
    std::vector<std::string> items_;
};

class Problems {
  public:
    void run(const std::function<void()>& fn) {
        try {
            fn();
        } catch (const ConfigProblems& e) {
            items_.insert(items_.end(), e.items().begin(), e.items().end());
        } catch (const UsageError& e) {
            items_.emplace_back(e.what());
        }
    }
    void throw_if_any() {
        if (items_.empty()) return;
        std::stable_partition(items_.begin(), items_.end(), [](const std::string& m) {
            return m.find("model_family") != std::string::npos;
        });
        throw ConfigProblems(items_);
    }

  private:
    std::vector<std::string> items_;
};

bool contains(const std::vector<std::string>& names, const std::string& key) {
    return std::find(names.begin(), names.end(), key) != names.end();
}

// Python's truthiness of a config value as SimpleTuner's loader judges it.
bool truthy(const json& value) {
    if (value.is_boolean()) return value.get<bool>();
    if (value.is_number()) return value.get<double>() != 0;
    if (value.is_string()) {
        const std::string v = lower(value.get<std::string>());
        return !(v.empty() || v == "0" || v == "false" || v == "no" || v == "off" || v == "none");
    }
    return !value.is_null();
}

// Family-dependent values of shared keys (model_flavour, prediction_type, [schnell]'s needs).
void check_family_values(const TrainConfig& c, Problems& problems) {
    const std::string family = c.text("model_family");
    const std::string flavour = c.text("model_flavour");
    problems.run([&] {
        if (flavour.empty()) return;
        const bool flux_flavour = flavour == "dev" || flavour == "krea" || flavour == "schnell";
        if (family == "flux" && !flux_flavour)
            throw UsageError(str("option model_flavour = \"", flavour,
                                 "\" is not a Flux flavour; choose dev, krea or schnell (kontext, fluxbooru "
                                 "and libreflux are not supported by dtune)"));
        if (family == "sdxl" && flux_flavour)
            throw UsageError(str("option model_flavour = \"", flavour,
                                 "\" is a Flux flavour; for SDXL choose base-1.0, refiner-1.0, base-0.9 or "
                                 "refiner-0.9"));
    });
    problems.run([&] {
        const std::string prediction = c.text("prediction_type");
        if (prediction.empty()) return;
        if (family == "flux" && prediction != "flow_matching")
            throw UsageError(str("option prediction_type = \"", prediction,
                                 "\" does not apply to Flux, which trains flow matching (toward noise - "
                                 "latents); remove prediction_type or set it to flow_matching"));
        if (family == "sdxl" && prediction == "flow_matching")
            throw UsageError(
                "option prediction_type = \"flow_matching\" is for flow-matching models (model_family "
                "flux); SDXL trains epsilon, v_prediction or sample: remove prediction_type (the "
                "scheduler's is used) or choose one of those");
    });
    // SimpleTuner's Flux check_user_config: [schnell] trains on the fast schedule, and its LoRA runs
    // load an assistant LoRA from the hub unless told not to.
    problems.run([&] {
        if (family != "flux" || flavour != "schnell") return;
        if (!c.flag("flux_fast_schedule"))
            throw UsageError(
                "option model_flavour = \"schnell\" needs flux_fast_schedule (SimpleTuner: \"Schnell "
                "requires --flux_fast_schedule\"); set flux_fast_schedule true");
        if (c.text("model_type") == "lora" && !c.flag("disable_assistant_lora"))
            throw UsageError(
                "option model_flavour = \"schnell\" with model_type lora makes SimpleTuner load its "
                "assistant LoRA (ostris/FLUX.1-schnell-training-adapter), which dtune does not do; set "
                "disable_assistant_lora true to train without it");
    });
    // Keys only a flow-matching Flux run reads: harmless elsewhere (SimpleTuner ignores them too),
    // but a changed value is worth a word.
    if (family == "sdxl") {
        for (const auto& spec : specs()) {
            const std::string name = spec.name;
            const bool flux_only = name.rfind("flow_", 0) == 0 || name.rfind("flux_", 0) == 0 ||
                                   name == "fuse_qkv_projections" || name == "validation_guidance_real" ||
                                   name == "validation_no_cfg_until_timestep" ||
                                   name == "disable_assistant_lora";
            if (flux_only && c.raw(name) != json::parse(spec.default_json))
                log::warn() << "option " << name << " = " << c.raw(name).dump()
                            << " has no effect on SDXL (a Flux / flow-matching option)";
        }
    }
}

}  // namespace

bool option_only_labels(const std::string& name) {
    return contains(kLabelsOnly, name);
}

std::size_t edit_distance(const std::string& a, const std::string& b) {
    std::vector<std::size_t> row(b.size() + 1);
    for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (std::size_t i = 1; i <= a.size(); ++i) {
        std::size_t diag = row[0];
        row[0] = i;
        for (std::size_t j = 1; j <= b.size(); ++j) {
            const std::size_t up = row[j];
            row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
            diag = up;
        }
    }
    return row[b.size()];
}

const std::vector<OptionSpec>& option_specs() {
    return specs();
}

std::string options_help() {
    std::string out;
    for (const auto& s : specs()) {
        std::string line = str("  --", s.name, " (default ", s.default_json, ")");
        if (line.size() < 58) line.resize(58, ' ');
        out += line + " " + s.help + (s.choices ? str(" [", s.choices, "]") : "") + "\n";
    }
    return out;
}

TrainConfig::TrainConfig() : values_(json::object()) {
    for (const auto& s : specs()) values_[s.name] = json::parse(s.default_json);
}

// Legacy keys SimpleTuner translates or drops; false when `key` is none of them.
bool TrainConfig::set_legacy(const std::string& key, const json& value, const std::string& source) {
    if (key == "save_total_limit") {
        // SimpleTuner forwards it to checkpoints_total_limit (an empty value is dropped).
        if (!(value.is_string() && value.get<std::string>().empty()))
            set_value("checkpoints_total_limit", value, source);
        return true;
    }
    if (key == "vae_cache_preprocess") {
        // "Don't pre-process" became vae_cache_ondemand; a true value is today's default.
        if (!truthy(value)) set_value("vae_cache_ondemand", true, source);
        return true;
    }
    if (key == "use_gradient_checkpointing") {
        // SimpleTuner's SDXL and Kolors quickstarts write this name; its own parser has no such
        // option and refuses the file. The meaning is plain, so dtune reads it and says so.
        log::warn() << source
                    << ": \"use_gradient_checkpointing\" (from SimpleTuner's quickstart) is read as "
                    << "gradient_checkpointing; SimpleTuner itself does not know this name, so write "
                    << "\"gradient_checkpointing\" to keep the file usable by both";
        set_value("gradient_checkpointing", value, source);
        return true;
    }
    if (contains(kDroppedBySimpleTuner, key)) {
        if (key == "repeats")
            log::warn() << source << ": a top-level \"repeats\" is ignored (SimpleTuner ignores it too); "
                        << "set \"repeats\" per dataset in multidatabackend.json";
        return true;
    }
    return false;
}

void TrainConfig::set_value(const std::string& raw_key, json value, const std::string& source) {
    const std::string key = canonical_key(raw_key);
    // SimpleTuner's loader drops every key whose value is None before parsing, so the option keeps
    // its default; the same here for every key, implemented or not.
    if (value.is_null()) {
        if (const OptionSpec* spec = find_spec(key)) values_[key] = json::parse(spec->default_json);
        return;
    }
    if (set_legacy(key, value, source) || contains(kLabelsOnly, key)) return;
    if (const OptionSpec* spec = find_spec(key)) {
        json typed = coerce(*spec, value, source);
        check_range(*spec, typed, source);
        values_[key] = std::move(typed);
        return;
    }
    // A SimpleTuner option dtune does not implement: a value equal to SimpleTuner's default changes
    // nothing, so it is accepted (docs/simpletuner-options.md lists them).
    if (const SimpleTunerOption* option = find_simpletuner_option(key)) {
        if (is_simpletuner_default(*option, value)) return;
        throw UsageError(str(source, ": option ", key, " = ", value.dump(),
                             " is not implemented by dtune; remove it from the config or set it to "
                             "SimpleTuner's default ",
                             option->default_json,
                             " (docs/simpletuner-options.md lists what dtune implements)"));
    }
    if (const char* def = retired_default(key)) {
        if (equals_default(value, json::parse(def))) return;
        throw UsageError(str(source, ": option ", key, " (from an older SimpleTuner) = ", value.dump(),
                             " is not implemented by dtune; remove it from the config"));
    }
    throw UsageError(str(source, ": unknown option \"", raw_key, "\"; did you mean \"", closest_key(key),
                         "\"? (`dtune train --help` lists every option)"));
}

void TrainConfig::merge_json(const json& object, const std::string& source) {
    if (!object.is_object())
        throw UsageError(str(source, ": the configuration must be a JSON object of option: value pairs"));
    Problems problems;
    // "learning_rate" and "--learning_rate" (or an alias and its canonical name) in one file: which
    // one wins would depend on key order, so two different values are refused; the same value
    // twice is only worth a warning.
    std::map<std::string, std::string> spelling_of;  // canonical key -> the spelling seen first
    for (const auto& [key, value] : object.items()) {
        problems.run([&] {
            const std::string canonical = canonical_key(key);
            const auto [first, inserted] = spelling_of.emplace(canonical, key);
            if (!inserted) {
                const json& earlier = object.at(first->second);
                const OptionSpec* spec = find_spec(canonical);
                const bool same =
                    spec ? coerce(*spec, earlier, source) == coerce(*spec, value, source) : earlier == value;
                if (!same)
                    throw UsageError(str(source, ": option ", canonical, " is given twice, as \"",
                                         first->second, "\" = ", earlier.dump(), " and as \"", key,
                                         "\" = ", value.dump(), "; keep one of them"));
                log::warn() << source << ": option " << canonical << " is given twice, as \"" << first->second
                            << "\" and as \"" << key << "\", with the same value " << value.dump()
                            << "; keep one of them";
            }
            set_value(key, value, source);
        });
    }
    problems.throw_if_any();
}

void TrainConfig::set(const std::string& key, const std::string& value_text, const std::string& source) {
    const OptionSpec* spec = find_spec(canonical_key(key));
    if (spec && spec->type == OptionType::kString) return set_value(key, json(value_text), source);
    json parsed = json::parse(value_text, nullptr, false);
    set_value(key, parsed.is_discarded() ? json(value_text) : parsed, source);
}

void TrainConfig::apply_overrides(const std::vector<std::string>& words) {
    const std::string source = "command line";
    Problems problems;
    for (std::size_t i = 0; i < words.size(); ++i) problems.run([&] { apply_override(words, i, source); });
    problems.throw_if_any();
}

// One override starting at words[i]; advances i past the words it consumes.
void TrainConfig::apply_override(const std::vector<std::string>& words, std::size_t& i,
                                 const std::string& source) {
    std::string w = words[i];
    if (w == "--set") {
        if (i + 1 >= words.size())
            throw UsageError("command line: --set needs key=value, e.g. --set seed=42");
        w = words[++i];
        const auto eq = w.find('=');
        if (eq == std::string::npos)
            throw UsageError(str("command line: --set ", w, " is not key=value; write e.g. --set seed=42"));
        return set(w.substr(0, eq), w.substr(eq + 1), source);
    }
    if (w.rfind("--", 0) != 0)
        throw UsageError(str("command line: unexpected argument \"", w, "\"; options are --key value"));
    const auto eq = w.find('=');
    if (eq != std::string::npos) {
        set(w.substr(0, eq), w.substr(eq + 1), source);
    } else if (i + 1 < words.size() && words[i + 1].rfind("--", 0) != 0) {
        set(w, words[++i], source);
    } else {
        set(w, "true", source);  // a bare flag: --use_dora
    }
}

void TrainConfig::validate() const {
    Problems problems;  // each check on its own, so one run lists them all
    problems.run([&] {
        if (values_.at("model_family").is_null())
            throw UsageError(
                "model_family is required; set \"model_family\": \"sdxl\" (or \"flux\") in config.json");
    });
    for (const auto& s : specs()) {
        if (!s.choices || values_.at(s.name).is_null()) continue;
        problems.run([&] {
            const std::string v = values_.at(s.name).get<std::string>();
            const std::string choices = str(",", s.choices, ",");
            if (choices.find("," + v + ",") == std::string::npos)
                throw UsageError(
                    str("option ", s.name, " = \"", v, "\" is not supported; choose one of: ", s.choices));
        });
    }
    problems.run([&] {
        for (const std::string& tracker : report_to_list())
            if (tracker != "none" && tracker != "tensorboard" && tracker != "wandb" && tracker != "all")
                throw UsageError(str("option report_to = \"", text("report_to"), "\" names \"", tracker,
                                     "\"; choose from none, tensorboard, wandb, all (comma-separated)"));
    });
    for (const char* key : {"train_batch_size", "gradient_accumulation_steps"}) {
        problems.run([&] {
            if (integer(key) < 1)
                throw UsageError(str("option ", key, " = ", integer(key), " must be at least 1"));
        });
    }
    problems.run([&] {
        if (!is_null("optimizer_config") && !text("optimizer_config").empty())
            throw UsageError(
                "option optimizer_config is not implemented by dtune yet; remove it (use adam_* options)");
    });
    // max_train_steps 0 or null means "use num_train_epochs"; with neither there is nothing to train,
    // and a run would write an untrained model and report success.
    problems.run([&] {
        const auto steps = opt_integer("max_train_steps");
        if (steps && *steps < 0)
            throw UsageError(str("option max_train_steps = ", *steps,
                                 " must be >= 1 (or 0/null to train num_train_epochs epochs)"));
        if (!(steps && *steps > 0) && opt_integer("num_train_epochs").value_or(0) < 1)
            throw UsageError(
                str("option num_train_epochs = ", raw("num_train_epochs").dump(),
                    " with max_train_steps unset leaves nothing to train; set max_train_steps or "
                    "num_train_epochs to at least 1"));
    });
    for (const char* key : {"base_model_precision", "text_encoder_1_precision", "text_encoder_2_precision"})
        problems.run([&] { parse_quant_preset(text(key), key); });
    problems.run([&] {
        // SimpleTuner's rules: a quantised base is a frozen base, and quanto cannot carry DoRA.
        const std::string precision = text("base_model_precision");
        if (precision == "no_change") return;
        if (text("model_type") != "lora")
            throw UsageError(
                str("base_model_precision = \"", precision, "\" quantises a frozen base model, but ",
                    "model_type is \"", text("model_type"), "\": set model_type lora (a LoRA or DoRA ",
                    "on the quantised base) or base_model_precision no_change for a full fine-tune"));
        if (flag("use_dora") && precision.find("quanto") != std::string::npos)
            throw UsageError(
                str("use_dora cannot be combined with base_model_precision = \"", precision,
                    "\" (quanto presets do not support DoRA, as in SimpleTuner); use int8-torchao or ",
                    "fp8-torchao, or turn use_dora off"));
    });
    problems.run([&] {
        const double p = real("caption_dropout_probability");
        if (p < 0 || p > 1) throw UsageError(str("caption_dropout_probability = ", p, " must be in [0, 1]"));
    });
    check_family_values(*this, problems);
    // Single values are range-checked as they are set (kRanges); what is left needs two keys.
    problems.run([&] {
        const std::string problem = resolution_range_problem(real("resolution"), text("resolution_type"));
        if (!problem.empty())
            throw UsageError(str("option resolution = ", raw("resolution").dump(), " ", problem,
                                 " (config.json's dataset fallback, used by every dataset that sets none)"));
    });
    problems.throw_if_any();
}

TrainConfig TrainConfig::load(const std::filesystem::path& config_file,
                              const std::vector<std::string>& overrides) {
    TrainConfig config;
    if (!config_file.empty()) {
        const std::string ext = config_file.extension().string();
        if (ext == ".env")
            throw UsageError(str(config_file.string(), ": config.env is not supported; use config.json"));
        if (ext == ".toml") {
            DTUNE_CHECK_AS(DataError, std::filesystem::is_regular_file(config_file), config_file.string(),
                           ": no such file; check the --config path");
            const json parsed = read_toml_config(config_file);
            config.load_stages(parsed, config_file.string(), overrides);
            return config;
        }
        config.load_stages(parse_config_json(fs::read_file(config_file), config_file.string()),
                           config_file.string(), overrides);
        return config;
    }
    config.load_stages(json::object(), "", overrides);
    return config;
}

void TrainConfig::load_stages(const json& file_options, const std::string& source,
                              const std::vector<std::string>& overrides) {
    Problems problems;
    if (!source.empty()) problems.run([&] { merge_json(file_options, source); });
    problems.run([&] { apply_overrides(overrides); });
    problems.run([&] { finish(); });
    problems.throw_if_any();
}

void TrainConfig::finish() {
    // No model_family: the model folder's model_index.json names it (StableDiffusionXLPipeline,
    // FluxPipeline), so a diffusers folder trains without it.
    if (is_null("model_family") && !is_null("pretrained_model_name_or_path")) {
        const std::filesystem::path index =
            std::filesystem::path(values_["pretrained_model_name_or_path"].get<std::string>()) /
            "model_index.json";
        if (std::filesystem::is_regular_file(index)) {
            const json j = json::parse(fs::read_file(index), nullptr, /*allow_exceptions=*/false);
            const std::string_view name = j.is_object()
                                              ? family::family_of_pipeline_class(j.value("_class_name", ""))
                                              : std::string_view();
            if (!name.empty()) set_value("model_family", std::string(name), index.string());
        }
    }
    if (is_null("model_flavour") && values_["model_family"] == "sdxl") values_["model_flavour"] = "base-1.0";
    resolve_tokenizer_max_length();
    validate();
}

void TrainConfig::resolve_tokenizer_max_length() {
    // SimpleTuner's check_user_config: Flux and SDXL ignore tokenizer_max_length with a warning;
    // Flux then encodes 512 T5 tokens, 256 for model_flavour schnell. The resolved value is the
    // length the text cache is built with (its identity includes it).
    const std::string family = is_null("model_family") ? "" : text("model_family");
    if (family != "flux" && family != "sdxl") return;
    const std::optional<int64_t> given = opt_integer("tokenizer_max_length");
    if (family == "sdxl") {
        if (given)
            log::warn() << "tokenizer_max_length " << *given
                        << " is ignored, as SimpleTuner ignores it: SDXL's CLIP takes 77 tokens";
        values_["tokenizer_max_length"] = json(nullptr);
        return;
    }
    const int64_t used = text("model_flavour") == "schnell" ? 256 : 512;
    if (given && *given != used)
        log::warn() << "tokenizer_max_length " << *given
                    << " is ignored, as SimpleTuner ignores it: Flux's T5 takes " << used << " tokens"
                    << (used == 256 ? " for [schnell]" : "");
    values_["tokenizer_max_length"] = json(used);
}

std::vector<std::string> TrainConfig::report_to_list() const {
    std::vector<std::string> out;
    std::string item;
    for (const char ch : text("report_to") + ",") {
        if (ch != ',') {
            if (!std::isspace(static_cast<unsigned char>(ch))) item += ch;
            continue;
        }
        if (!item.empty()) out.push_back(lower(item));
        item.clear();
    }
    return out;
}

bool TrainConfig::is_null(const std::string& key) const {
    return raw(key).is_null();
}

const json& TrainConfig::raw(const std::string& key) const {
    auto it = values_.find(key);
    DTUNE_CHECK(it != values_.end(), "internal: TrainConfig has no option ", key);
    return *it;
}

std::string TrainConfig::text(const std::string& key) const {
    const json& v = raw(key);
    return v.is_null() ? std::string() : v.get<std::string>();
}

int64_t TrainConfig::integer(const std::string& key) const {
    const json& v = raw(key);
    DTUNE_CHECK_AS(UsageError, !v.is_null(), "option ", key, " must be set");
    return v.get<int64_t>();
}

double TrainConfig::real(const std::string& key) const {
    const json& v = raw(key);
    DTUNE_CHECK_AS(UsageError, !v.is_null(), "option ", key, " must be set");
    return v.get<double>();
}

bool TrainConfig::flag(const std::string& key) const {
    const json& v = raw(key);
    return !v.is_null() && v.get<bool>();
}

std::optional<int64_t> TrainConfig::opt_integer(const std::string& key) const {
    return is_null(key) ? std::nullopt : std::optional<int64_t>(integer(key));
}

std::optional<double> TrainConfig::opt_real(const std::string& key) const {
    return is_null(key) ? std::nullopt : std::optional<double>(real(key));
}

void TrainConfig::write_resolved(const std::filesystem::path& path) const {
    // The file documents the run and is shared with it (report.html shows it): webhook URLs,
    // tokens and passwords are left out (core/redact.h).
    fs::write_file_atomic(path, redact_json(values_).dump(2) + "\n");
}

TrainConfig TrainConfig::from_resolved(const json& resolved) {
    TrainConfig config;
    config.merge_json(resolved, "resolved configuration");
    return config;
}

}  // namespace dtune::train
