// The training loop (see trainer.h).
#include "train/trainer.h"

#include <ATen/Context.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <set>

#include "core/dir_lock.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/fused_env.h"
#include "core/gpu_memory.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/redact.h"
#include "data/cache_codec.h"
#include "family/data_encoders.h"
#include "models/common/group_norm_act.h"
#include "models/common/lora_dropout.h"
#include "models/common/quantize.h"
#include "models/common/weights.h"
#include "train/adapters.h"
#include "train/checkpoint.h"
#include "train/data_parallel.h"
#include "train/dataset_source.h"
#include "train/fault_inject.h"
#include "train/graph_step.h"
#include "train/loss_scaler.h"
#include "train/lr_schedule.h"
#include "train/optimizer_offload.h"
#include "train/run_logs.h"
#include "train/signals.h"
#include "train/zero3_model.h"

namespace dtune::train {
namespace {

constexpr const char* kOptimizerState = "optimizer.safetensors";
constexpr const char* kTrainingState = "training_state.json";
constexpr const char* kResolvedConfig = "config.resolved.json";

uint64_t resolve_seed(const TrainConfig& config) {
    const auto seed = config.opt_integer("seed");
    if (seed && *seed > 0) return static_cast<uint64_t>(*seed);
    const uint64_t s = std::random_device{}() & 0x7fffffff;  // None, 0, -1: a fresh seed, logged
    log::info() << "seed not set: using " << s << " (set seed to reproduce this run)";
    return s;
}

std::filesystem::path vae_dir(const TrainConfig& config, const std::filesystem::path& model_dir) {
    const std::filesystem::path vae = config.text("pretrained_vae_model_name_or_path");
    if (!vae.empty() && std::filesystem::exists(vae / "config.json")) return vae;
    // The fallback is the model folder's vae/: say so when it lacks one (the path would otherwise
    // reach the VAE resolver, which takes "sdxl-base/vae" for a hub id).
    DTUNE_CHECK_AS(
        DataError, std::filesystem::is_directory(model_dir / "vae"), "the model folder ", model_dir.string(),
        " has no vae/ folder, and pretrained_vae_model_name_or_path \"", vae.string(),
        "\" is not a local VAE folder (dtune downloads nothing), so there is no VAE to use; copy a "
        "diffusers vae/ into the model folder or set pretrained_vae_model_name_or_path to a local "
        "VAE folder (e.g. a download of madebyollin/sdxl-vae-fp16-fix)");
    log::info() << "pretrained_vae_model_name_or_path " << vae.string()
                << " is not a local folder; using the model's own VAE " << (model_dir / "vae").string();
    return model_dir / "vae";
}

void log_fault_stop(const StepAgreement& agreed, int64_t step) {
    log::error() << "GPU fault reported by rank " << agreed.fault_rank << " (GPU " << agreed.fault_gpu
                 << " of its node): stopping at step " << step << " without a checkpoint; the last "
                 << "checkpoint is intact";
}

// 4 significant digits for the progress bar ("0.1234", "1e-04").
std::string format_metric(double v) {
    char b[32];
    std::snprintf(b, sizeof(b), "%.4g", v);
    return b;
}

// The family of the run: model_family, checked against the folder's model_index.json class.
const family::ModelFamily& family_for(const TrainConfig& config, const std::filesystem::path& model_dir) {
    const family::ModelFamily& named = family::family_named(config.text("model_family"));
    const family::ModelFamily* folder = family::family_of_model_folder(model_dir);
    DTUNE_CHECK_AS(UsageError, !folder || folder == &named, "model_family is ", named.name(), " but ",
                   (model_dir / "model_index.json").string(), " is a ", folder ? folder->name() : "",
                   " pipeline; set \"model_family\": \"", folder ? folder->name() : "",
                   "\" or point pretrained_model_name_or_path at a ", named.name(), " folder");
    return named;
}

// DTUNE_CHANNELS_LAST: the network's convolutions and activations in NHWC memory order on CUDA
// (Denoiser::set_channels_last; GroupNorm + SiLU then run as dtune's NHWC kernels, forward and
// backward, and cuDNN's convolutions need no layout transposes). Unset or "auto": on for adapter
// training (model_type lora) on CUDA where the kernels were built and DTUNE_FUSED_KERNELS allows
// them. Off by default for full fine-tunes: trained 4-D weights would take adamw_bf16's copied path
// (its in-place path and its state's element order assume NCHW weights), which measured slower.
// "1"/"on"/"true" or "0"/"off"/"false" decide.
bool channels_last_requested(const c10::Device& device, bool adapters_only) {
    const char* v = std::getenv("DTUNE_CHANNELS_LAST");
    const std::string value = v ? v : "auto";
    if (value == "auto" || value.empty())
        return adapters_only && device.is_cuda() && models::fused_inference_kernels_built() &&
               fused_kernels_allowed();
    const auto on = parse_fused_kernels_value(value);
    DTUNE_CHECK_AS(UsageError, on.has_value(), "DTUNE_CHANNELS_LAST='", value,
                   "' is not understood; use auto (or unset), 1 (on/true) or 0 (off/false)");
    return *on;
}

// DTUNE_LORA_CAST_FACTORS: LoRA factors cast to the compute dtype once per forward in one
// multi-tensor pass (LoRAAdapters::refresh_cast_factors), not per layer. Unset or 1: on; 0: off.
bool lora_cast_factors_requested() {
    const char* v = std::getenv("DTUNE_LORA_CAST_FACTORS");
    if (v == nullptr || *v == '\0') return true;
    const auto on = parse_fused_kernels_value(v);
    DTUNE_CHECK_AS(UsageError, on.has_value(), "DTUNE_LORA_CAST_FACTORS='", v,
                   "' is not understood; use 1 (on/true, the default) or 0 (off/false: each layer casts "
                   "its factors)");
    return *on;
}

// SimpleTuner's modelspec.architecture value for checkpoints.
const char* modelspec_architecture(const family::ModelFamily& family) {
    return std::string(family.name()) == "flux" ? "flux-1-dev" : "stable-diffusion-xl-v1-base";
}

}  // namespace

c10::Device parse_train_device(const std::string& name) {
    return parse_device(name);
}

// pretrained_model_name_or_path must be a local folder: model_dir_.
void Trainer::check_model_dir() {
    model_dir_ = config_.text("pretrained_model_name_or_path");
    DTUNE_CHECK_AS(UsageError, !model_dir_.empty(),
                   "pretrained_model_name_or_path is required; point it at a diffusers SDXL folder");
    // A missing model folder is a missing input file (exit 3), as for `dtune sample --model`.
    DTUNE_CHECK_AS(DataError, std::filesystem::is_directory(model_dir_), "pretrained_model_name_or_path \"",
                   model_dir_.string(), "\" is not a local folder",
                   model_dir_.is_relative() ? str(" (a relative path starts at the working directory ",
                                                  std::filesystem::current_path().string(),
                                                  ": run dtune from the folder that holds it, "
                                                  "or give an absolute path)")
                                            : std::string(),
                   "; dtune reads diffusers folders only (no hub downloads): download the model (e.g. "
                   "huggingface-cli download <repo> --local-dir DIR) and pass DIR, or try `dtune demo`'s "
                   "dtune-demo/model first");
}

// Everything before the data path: the output_dir lock, the data-parallel job, the device and the
// network (quantised in host memory with quantize_via cpu), with the family's training keys applied.
void Trainer::load_network() {
    const dist::DistEnv env = dist::read_dist_env();
    // Before any cache or checkpoint work: a second run on this output_dir stops here (exit 2).
    // Rank 0 holds the lock for the whole job; the other ranks, on this node or others, share it.
    if (env.is_main()) output_lock_ = fs::DirLock::acquire(config_.text("output_dir"), "output_dir");
    device_ = DataParallel::pick_device(config_.text("device"), env, cuda_device_count());
    init_data_parallel(env);
    models::ComponentLoadOptions load;
    load.device = device_;
    // bf16 weights for adamw_bf16, and for a LoRA's frozen base on CUDA under bf16 autocast (the
    // adapters are trained in float32 there, see init_extras).
    const bool lora_bf16_base = config_.text("model_type") == "lora" && device_.is_cuda() &&
                                config_.text("mixed_precision") == "bf16";
    load.dtype = config_.text("optimizer") == "adamw_bf16" || lora_bf16_base ? at::kBFloat16 : at::kFloat;
    // quantize_via cpu: a quantised base is loaded and quantised in host memory, then moved (init_common),
    // so the GPU never holds its full-precision weights.
    if (config_.text("quantize_via") == "cpu" &&
        parse_quant_preset(config_.text("base_model_precision"), "base_model_precision").active())
        load.device = c10::Device(c10::kCPU);
    family_ = &family_for(config_, model_dir_);
    const auto load_start = std::chrono::steady_clock::now();
    model_ = load_base_model(load, env.is_main());
    log::info() << "loaded the " << family_->network_name() << " of " << model_dir_.string() << " ("
                << family_->name() << ") on " << device_.str() << " in "
                << format_metric(
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count())
                << " s";
    objective_ = family_->training_objective(model_dir_);
    family_->apply_training_config(config_, *model_, objective_);  // the family's own keys (Flux: flux_*)
}

Trainer::Trainer(TrainConfig config) : config_(std::move(config)) {
    check_model_dir();
    DTUNE_CHECK_AS(UsageError, !config_.is_null("data_backend_config"),
                   "data_backend_config is required; point it at your multidatabackend.json");
    // Relative paths are taken from the working directory, as SimpleTuner does.
    DTUNE_CHECK_AS(DataError, std::filesystem::is_regular_file(config_.text("data_backend_config")),
                   "data_backend_config \"", config_.text("data_backend_config"),
                   "\" is not a readable file (relative paths start at the working directory ",
                   std::filesystem::current_path().string(), "); fix the path in config.json");
    fs::require_writable_dir(config_.text("output_dir"), "output_dir");
    const std::filesystem::path vae_folder = vae_dir(config_, model_dir_);  // before any model loads
    load_network();

    // The data path: the family's encoders as callables, buckets and caches from multidatabackend.json.
    family::DataEncoderOptions eo;
    eo.model_dir = model_dir_;
    eo.vae_override = vae_folder;
    eo.device = device_;
    eo.vae_dtype = device_.is_cuda() ? at::kBFloat16 : at::kFloat;  // SimpleTuner's vae_dtype default
    eo.text_encoder_precision = family::text_encoder_precision_from(config_);
    eo.max_sequence_length = config_.opt_integer("tokenizer_max_length").value_or(0);  // as resolved
    DatasetSourceOptions ds;
    ds.data_backend_config = config_.text("data_backend_config");
    ds.global = data_args_from_config(config_);
    ds.train_batch_size = static_cast<int>(config_.integer("train_batch_size"));
    ds.gradient_accumulation_steps = static_cast<int>(config_.integer("gradient_accumulation_steps"));
    ds.allow_dataset_oversubscription = config_.flag("allow_dataset_oversubscription");
    ds.disable_bucket_pruning = config_.flag("disable_bucket_pruning");
    ds.seed = resolve_seed(config_);
    ds.prefetch_batches = config_.flag("dataloader_prefetch")
                              ? static_cast<int>(config_.integer("dataloader_prefetch_qlen"))
                              : 2;
    ds.device = device_;
    ds.rank = dp_->rank();
    ds.world_size = dp_->world_size();
    ds.barrier = dp_->barrier_function();
    ds.should_stop = stop_requested;  // SIGINT/SIGTERM during the cache build stops it
    source_ = std::make_unique<DatasetBatchSource>(ds, family_->load_data_encoders(eo));
    const uint64_t resolved_seed = ds.seed;
    config_.set("seed", std::to_string(resolved_seed), "resolved seed");
    init_common();
}

Trainer::Trainer(TrainConfig config, std::unique_ptr<BatchSource> source) : config_(std::move(config)) {
    check_model_dir();
    fs::require_writable_dir(config_.text("output_dir"), "output_dir");
    load_network();
    source_ = std::move(source);
    config_.set("seed", std::to_string(resolve_seed(config_)), "resolved seed");
    init_common();
}

Trainer::Trainer(TrainConfig config, std::unique_ptr<family::Denoiser> model,
                 family::TrainingObjective objective, std::unique_ptr<BatchSource> source)
    : config_(std::move(config)),
      family_(&family::family_named(config_.text("model_family"))),
      model_(std::move(model)),
      objective_(std::move(objective)),
      source_(std::move(source)) {
    device_ = model_->module().parameters().front().device();
    config_.set("seed", std::to_string(resolve_seed(config_)), "resolved seed");
    init_common();
}

Trainer::~Trainer() = default;

namespace {

// What a quantised cache file was made from: the network folder's files (names, sizes, modification
// times) and the load dtype.
std::string weights_source(const std::filesystem::path& dir, c10::ScalarType dtype) {
    std::vector<std::string> parts;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
        if (!e.is_regular_file()) continue;
        const auto mtime = e.last_write_time().time_since_epoch().count();
        parts.push_back(str(e.path().filename().string(), " ", e.file_size(), " ", mtime));
    }
    std::sort(parts.begin(), parts.end());
    std::string joined =
        str(std::filesystem::weakly_canonical(dir).string(), " dtype=", dtype_name(dtype), "\n");
    for (const auto& p : parts) joined += p + "\n";
    return joined;
}

}  // namespace

std::unique_ptr<family::Denoiser> Trainer::load_base_model(const models::ComponentLoadOptions& load,
                                                           bool main_process) {
    const std::filesystem::path dir = model_dir_ / family_->denoiser_folder();
    const QuantPreset preset =
        parse_quant_preset(config_.text("base_model_precision"), "base_model_precision");
    const std::string cache = config_.text("quantized_model_cache");
    if (!preset.active() && !cache.empty())
        log::warn() << "quantized_model_cache " << cache
                    << " has no effect: base_model_precision is no_change (nothing is quantised)";
    if (!preset.active() || cache.empty()) return family_->load_denoiser(dir, load);
    const std::string source = weights_source(dir, load.dtype);
    const std::filesystem::path file =
        std::filesystem::path(cache) / str(family_->denoiser_folder(), "-", preset.name, "-",
                                           data::sha256_hex(source).substr(0, 16), ".safetensors");
    const auto start = std::chrono::steady_clock::now();
    if (models::quantized_file_matches(file, preset, source)) {
        auto model = family_->load_quantized_denoiser(dir, file, load);
        base_quantized_ = true;
        log::info() << "loaded the quantised " << family_->network_name() << " (" << preset.name << ") from "
                    << file.string() << " in "
                    << format_metric(
                           std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count())
                    << " s (quantized_model_cache)";
        return model;
    }
    model_ = family_->load_denoiser(dir, load);
    quantize_base_model();
    if (main_process) {
        models::save_quantized(model_->module(), file, preset, source);
        log::info() << "wrote the quantised " << family_->network_name() << " to " << file.string()
                    << " (quantized_model_cache: later runs load it instead of " << dir.string() << ")";
    }
    return std::move(model_);
}

void Trainer::quantize_base_model() {
    const QuantPreset preset =
        parse_quant_preset(config_.text("base_model_precision"), "base_model_precision");
    if (!preset.active() || base_quantized_) return;
    base_quantized_ = true;
    const auto start = std::chrono::steady_clock::now();
    const models::QuantizeReport report = models::quantize_module(model_->module(), preset);
    log::info() << "quantised the " << family_->network_name() << " on "
                << model_->module().parameters().front().device().str() << " ("
                << models::describe(report, preset) << ") in "
                << format_metric(
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count())
                << " s";
}

void Trainer::init_data_parallel(const dist::DistEnv& env) {
    const char* timeout = std::getenv("DTUNE_COLLECTIVE_TIMEOUT_S");
    const auto seconds = std::chrono::seconds(timeout && *timeout ? std::atoi(timeout) : 600);
    dp_ = std::make_unique<DataParallel>(env, device_, resolve_zero_stage(config_), seconds);
    rank_ = dp_->rank();
}

int Trainer::local_rank() const {
    return dp_->local_rank();
}

int Trainer::world_size() const {
    return dp_->world_size();
}

void Trainer::init_common() {
    if (!dp_) init_data_parallel(dist::read_dist_env());
    output_dir_ = config_.text("output_dir");
    std::filesystem::create_directories(output_dir_);
    dp_->check_shared_output_dir(output_dir_);
    step_options_.rank = dp_->rank();
    step_options_.world_size = dp_->world_size();
    if (config_.flag("deterministic")) {
        // cuBLAS is deterministic only with a fixed workspace, and torch refuses a matmul under
        // deterministic algorithms unless this names one (a value the user set is kept).
        if (device_.is_cuda()) setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
        at::globalContext().setDeterministicAlgorithms(true, false);
    }
    const uint64_t seed = static_cast<uint64_t>(config_.integer("seed"));
    generator_ = at::detail::createCPUGenerator(seed);
    // adamw_bf16 draws its rounding noise where its update runs: a generator of the weights' device,
    // or the CPU's when the optimizer is offloaded there.
    offload_optimizer_ = resolve_offload_optimizer(config_);
    if (device_.is_cuda() && !offload_optimizer_) {
        optimizer_generator_ = at::globalContext().defaultGenerator(device_).clone();
        optimizer_generator_->set_current_seed(seed ^ 0x9e3779b97f4a7c15ULL);
    } else {
        optimizer_generator_ = at::detail::createCPUGenerator(seed ^ 0x9e3779b97f4a7c15ULL);
    }
    model_->module().train();
    quantize_base_model();
    if (model_->module().parameters().front().device() != device_) {  // quantize_via cpu
        model_->module().to(device_);
        log::info() << "moved the quantised " << family_->network_name() << " to " << device_.str()
                    << " (quantize_via cpu)";
    }
    const bool adapters_only = config_.text("model_type") == "lora";
    const bool channels_last = channels_last_requested(device_, adapters_only);
    lora_cast_factors_ = lora_cast_factors_requested();
    // DTUNE_LORA_DROPOUT_KERNELS and DTUNE_FUSED_RESNET_TRAINING are read on first use: a bad value
    // stops the run here, not in the first forward or backward pass.
    (void)models::lora_dropout_kernels_mode();
    (void)models::fused_resnet_training_enabled();
    // Trained 4-D weights in NHWC order: the sharded and data-parallel paths flatten parameters and
    // gradients as contiguous NCHW (ZeRO's sync, the gradient all-reduce), so one rank only.
    DTUNE_CHECK_AS(UsageError, !channels_last || adapters_only || dp_->world_size() == 1,
                   "DTUNE_CHANNELS_LAST=1 with a full fine-tune runs on one GPU only (", dp_->world_size(),
                   " ranks here); unset it (NCHW is the default for full fine-tunes)");
    if (channels_last) {
        if (model_->set_channels_last(true))
            log::info() << family_->network_name() << ": channels-last (NHWC) convolutions and GroupNorm "
                        << "(DTUNE_CHANNELS_LAST=0 keeps NCHW)";
        else if (std::getenv("DTUNE_CHANNELS_LAST"))
            log::info() << family_->network_name()
                        << " has no channels-last mode; DTUNE_CHANNELS_LAST ignored";
    }
    const bool checkpointing = config_.flag("gradient_checkpointing");
    const auto interval = config_.opt_integer("gradient_checkpointing_interval");
    DTUNE_CHECK_AS(UsageError, !interval || *interval >= 1,
                   "gradient_checkpointing_interval must be 1 or more (", *interval,
                   " given); use null or 1 to checkpoint every block");
    if (interval && *interval > 1 && !checkpointing)
        log::warn() << "gradient_checkpointing_interval " << *interval
                    << " has no effect: gradient_checkpointing is false";
    const auto [taken, units] = model_->set_gradient_checkpointing(checkpointing, interval.value_or(1));
    if (checkpointing && interval && *interval > 1) {
        log::info() << "gradient checkpointing: " << taken << " of " << units
                    << " ResNet/transformer blocks (gradient_checkpointing_interval " << *interval << ")";
    }

    auto& s = step_options_;
    s.noise.offset_noise = config_.flag("offset_noise");
    s.noise.noise_offset = config_.real("noise_offset");
    s.noise.noise_offset_probability = config_.real("noise_offset_probability");
    s.noise.input_perturbation = config_.real("input_perturbation");
    s.loss.snr_gamma = config_.opt_real("snr_gamma");
    s.loss.snr_weight = config_.real("snr_weight");
    s.loss.loss_type = diffusion::parse_loss_type(config_.text("loss_type"));
    s.loss.huber_schedule = diffusion::parse_huber_schedule(config_.text("huber_schedule"));
    s.loss.huber_c = config_.real("huber_c");
    if (config_.flag("use_soft_min_snr"))
        log::warn() << "use_soft_min_snr changes nothing: SimpleTuner has not applied it to the loss since "
                       "2024 (its min-SNR weights are min(SNR, snr_gamma) / SNR either way), and dtune "
                       "trains as it does";
    auto& bias = s.timesteps.bias;
    bias.strategy = config_.is_null("timestep_bias_strategy")
                        ? diffusion::TimestepBiasStrategy::kNone
                        : diffusion::parse_timestep_bias_strategy(config_.text("timestep_bias_strategy"));
    bias.multiplier = config_.real("timestep_bias_multiplier");
    bias.begin = config_.integer("timestep_bias_begin");
    bias.end = config_.integer("timestep_bias_end");
    bias.portion = config_.real("timestep_bias_portion");
    s.timesteps.disable_segmented_timestep_sampling = config_.flag("disable_segmented_timestep_sampling");
    // A bad bias (multiplier <= 0, a range past the schedule) fails now, not at the first step.
    if (!objective_.flow_matching()) {
        const diffusion::NoiseSchedule& schedule = objective_.ddpm("timestep_bias_strategy");
        diffusion::timestep_weights(bias, schedule.num_train_timesteps());
        s.prediction =
            config_.is_null("prediction_type")
                ? schedule.config().prediction_type
                : diffusion::parse_prediction_type(config_.text("prediction_type"), "prediction_type");
    }
    s.caption_dropout_probability = config_.real("caption_dropout_probability");
    auto& ss = s.scheduled_sampling;
    ss.max_step_offset = config_.integer("scheduled_sampling_max_step_offset");
    ss.probability = config_.real("scheduled_sampling_probability");
    ss.prob_start = config_.real("scheduled_sampling_prob_start");
    ss.prob_end = config_.real("scheduled_sampling_prob_end");
    ss.ramp_steps = config_.integer("scheduled_sampling_ramp_steps");
    ss.start_step = config_.integer("scheduled_sampling_start_step");
    ss.cosine_ramp = config_.text("scheduled_sampling_ramp_shape") == "cosine";
    ss.strategy = diffusion::parse_rollout_strategy(config_.text("scheduled_sampling_strategy"));
    DTUNE_CHECK_AS(UsageError, ss.max_step_offset >= 0 && config_.integer("scheduled_sampling_order") >= 1,
                   "scheduled_sampling_max_step_offset must be >= 0 and scheduled_sampling_order >= 1");
    if (ss.active()) {
        const bool ddpm = s.prediction == diffusion::PredictionType::kEpsilon ||
                          s.prediction == diffusion::PredictionType::kVPrediction;
        if (!ddpm)
            log::warn()
                << "scheduled sampling rolls out epsilon and v-prediction models only (as SimpleTuner): "
                   "it changes nothing for this prediction type";
        else
            log::info()
                << "scheduled sampling: up to " << ss.max_step_offset
                << " timesteps rolled out with the model's own predictions (first-order DDIM/Euler steps; "
                   "probability now "
                << diffusion::rollout_probability(ss, 0) << ")";
    }
    s.clip_by_value = config_.text("grad_clip_method") != "norm";
    const bool d2f = config_.flag("diff2flow_loss");
    const bool d2f_model = s.prediction == diffusion::PredictionType::kEpsilon ||
                           s.prediction == diffusion::PredictionType::kVPrediction;
    s.diff2flow_loss = d2f && config_.flag("diff2flow_enabled") && d2f_model;
    if (d2f && !s.diff2flow_loss)
        log::warn() << "diff2flow_loss has no effect "
                    << (d2f_model ? "without diff2flow_enabled"
                                  : "for this prediction type (epsilon or v_prediction only)")
                    << ", as in SimpleTuner; the usual loss trains";
    if (s.diff2flow_loss && source_->has_regularisation_data())
        log::warn()
            << "diff2flow_loss: regularisation batches train toward the flow target like any other, as in "
               "SimpleTuner (the base model's prediction is not used)";
    const std::string mp = config_.text("mixed_precision");
    // On the CPU autocast is not used: bf16/fp16 there run in float32 (fp16 keeps its loss scaler).
    s.compute_dtype = !device_.is_cuda() ? at::kFloat
                      : mp == "bf16"     ? at::kBFloat16
                      : mp == "fp16"     ? at::kHalf
                                         : at::kFloat;
    empty_prompt_ = source_->empty_prompt();
    for (auto& [name, t] : empty_prompt_) t = t.to(device_);

    const int64_t accum = config_.integer("gradient_accumulation_steps");
    const auto max_steps = config_.opt_integer("max_train_steps");
    total_steps_ = max_steps && *max_steps > 0 ? *max_steps
                                               : config_.integer("num_train_epochs") *
                                                     ((source_->batches_per_epoch() + accum - 1) / accum);
    for (const auto& item : model_->module().named_parameters())
        trainable_.push_back({item.key(), item.value()});
    init_extras();  // LoRA injection (trainable adapters), fp16 loss scaler
    if (is_main_process()) config_.write_resolved(output_dir_ / kResolvedConfig);
}

void Trainer::set_trainable_parameters(std::vector<NamedTensor> params) {
    for (auto& p : model_->module().parameters()) p.set_requires_grad(false);
    for (auto& p : params) p.tensor.set_requires_grad(true);
    trainable_ = std::move(params);
}

void Trainer::add_callback(std::shared_ptr<TrainCallback> callback) {
    callbacks_.push_back(std::move(callback));
}

void Trainer::build_optimizer() {
    ParamGroup group;
    for (std::size_t i = 0; i < trainable_.size() && !dp_->sharded_parameters(); ++i) {
        const auto& p = trainable_[i];
        if (!dp_->updates(i)) continue;  // ZeRO-1: another rank keeps this one's state
        group.names.push_back(p.name);
        group.params.push_back(p.tensor);
    }
    for (const auto& s : dp_->zero3_slices()) {  // ZeRO-3: this rank's slices of the parameters
        group.names.push_back(s.name);
        group.params.push_back(s.value);
    }
    group.lr = config_.real("learning_rate");
    group.weight_decay = config_.real("adam_weight_decay");
    const std::string name = config_.text("optimizer");
    std::vector<ParamGroup> groups{std::move(group)};
    if (offload_optimizer_) {
        auto offloaded = std::make_unique<CpuOffloadOptimizer>(
            std::move(groups), [&](std::vector<ParamGroup> host) { return make_optimizer(std::move(host)); });
        log::info() << "optimizer " << name
                    << ": state and update in host memory (offload_optimizer_device cpu; "
                    << offloaded->host_copy_bytes() / (1 << 20) << " MiB of weight copies)";
        optimizer_ = std::move(offloaded);
    } else {
        optimizer_ = make_optimizer(std::move(groups));
    }
}

std::unique_ptr<Optimizer> Trainer::make_optimizer(std::vector<ParamGroup> groups) const {
    const std::string name = config_.text("optimizer");
    const double b1 = config_.real("adam_beta1"), b2 = config_.real("adam_beta2");
    if (name == "adamw_bf16") {
        for (const auto& p : trainable_)
            DTUNE_CHECK_AS(UsageError, p.tensor.scalar_type() == at::kBFloat16,
                           "optimizer adamw_bf16 needs bf16 ", "weights but ", p.name, " is ",
                           dtype_name(p.tensor.scalar_type()),
                           "; choose optimizer torch-adamw for fp32 weights");
        AdamWBF16Options o;
        o.beta1 = b1, o.beta2 = b2;
        return std::make_unique<AdamWBF16>(std::move(groups), *optimizer_generator_, o);
    } else if (name == "torch-adamw" || name == "optimi-adamw") {
        AdamWOptions o;
        o.beta1 = b1, o.beta2 = b2, o.eps = config_.real("adam_epsilon");
        o.fused = !config_.flag("deterministic");  // the per-tensor loop has a fixed op order
        return std::make_unique<AdamW>(std::move(groups), o);
    } else if (name == "optimi-lion") {
        return std::make_unique<Lion>(std::move(groups), LionOptions{b1, b2});
    } else if (name == "torch-sgd") {
        return std::make_unique<SGD>(std::move(groups));
    }
    return std::make_unique<Adafactor>(std::move(groups));
}

void Trainer::resume() {
    const auto dir = resolve_resume_checkpoint(output_dir_, config_.text("resume_from_checkpoint"));
    if (!dir) return;
    const LoadedCheckpoint ckpt = load_checkpoint(*dir);
    if (!load_lora_weights(ckpt)) load_full_weights(ckpt);
    load_extras(ckpt);  // EMA shadows, loss scaler
    load_optimizer_state(ckpt);
    const auto it_state = ckpt.json_files.find(kTrainingState);
    DTUNE_CHECK_AS(DataError, it_state != ckpt.json_files.end(), "checkpoint ", dir->string(), " has no ",
                   kTrainingState, "; resume from another checkpoint");
    const auto& state = it_state->second;
    const auto state_file = *dir / kTrainingState;
    const auto& batch_state = json_field(state, "batch_source", state_file);
    try {
        source_->load_state(batch_state);
    } catch (const nlohmann::json::exception& e) {
        throw DataError(str(state_file.string(), ": field \"batch_source\" is malformed (", e.what(),
                            "): ", batch_state.dump().substr(0, 300),
                            "; the file is damaged: restore it or resume from an earlier checkpoint"));
    }
    global_step_ = json_integer(state, "global_step", state_file);
    // Each rank's own RNG states when the checkpoint has them (same world size), else rank 0's:
    // the step's generator is the same on every rank by design, so only the optimizer's
    // stochastic-rounding stream under ZeRO differs (see README, multi-GPU).
    std::map<std::string, at::Tensor> rng = ckpt.rng_states;
    if (auto it = ckpt.tensor_files.find(rank_rng_file(rank_)); rank_ > 0 && it != ckpt.tensor_files.end())
        rng = std::map<std::string, at::Tensor>(it->second.begin(), it->second.end());
    restore_rng_states(rng, *generator_);
    if (auto it = rng.find("optimizer"); it != rng.end()) {
        try {
            optimizer_generator_->set_state(it->second);
        } catch (const c10::Error&) {
            // A CPU generator's state (offloaded optimizer) does not fit a GPU generator or back.
            log::warn()
                << "the checkpoint's optimizer random state is for another device (was "
                << "offload_optimizer_device changed?); adamw_bf16's rounding stream restarts from the seed";
        }
    }
    resumed_from_ = *dir;
    log::info() << "resumed from " << dir->string() << " at step " << global_step_;
}

StepScalars Trainer::train_one_step() {
    const int64_t accum = config_.integer("gradient_accumulation_steps");
    if (!arm_gather_fault_injection())  // ZeRO-3: at the step's 3rd all-gather instead (trainer_zero3.cpp)
        inject_step_error(dp_->rank(), global_step_ + 1);  // DTUNE_INJECT_STEP_ERROR (tests)
    StepScalars out;
    // LoRA: this forward's dropout seed; regularisation batches train toward the base model's
    // prediction (step.h). The graphed step runs the same hooks.
    const StepHooks hooks = step_hooks();
    for (int64_t micro = 0; micro < accum; ++micro) {
        TrainBatch batch = next_batch(micro);
        apply_caption_dropout(*family_, batch, empty_prompt_, step_options_.caption_dropout_probability,
                              *generator_, dp_->rank(), dp_->world_size());
        dp_->before_forward();  // ZeRO-3: the root unit's weights
        MicroStep m = micro_step(*model_, batch, objective_, step_options_, global_step_, *generator_, hooks);
        if (micro == accum - 1) dp_->arm_reduction();  // reduce during the last backward
        const at::Tensor loss = m.loss / static_cast<double>(accum);
        (scaler_ ? scaler_->scale_loss(loss) : loss).backward();
        dp_->after_backward();  // ZeRO-3: this micro-step's gradients reduce-scattered into the shards
        // Not read here: the loss stays on the device and comes back with the step (readback.h),
        // checked for NaN/inf then, naming this micro-batch's files.
        out.add_micro_batch(m.loss, batch.regularisation, batch.paths);
        step_ended_on_regularisation_ = batch.regularisation;
    }
    dp_->reduce_gradients();  // average over the ranks once, after the last micro-step
    std::vector<at::Tensor> params;
    for (const auto& p : trainable_) params.push_back(p.tensor);
    params = dp_->gradient_holders(params);  // ZeRO-3: this rank's slices hold the gradients
    if (scaler_) {
        scaler_->unscale(params);  // fp16: gradients / scale and the inf/NaN flag, on the device
        // ZeRO-2/3: each rank checked its own shard; whether any overflowed is agreed on the host.
        if (dp_->zero_stage() >= 2) scaler_->set_overflowed(dp_->gradients_overflowed(scaler_->overflowed()));
        // An optimizer that cannot skip on the device: the flag is read here (a wait for the device).
        step_overflowed_ = !scaler_skips_on_device_ && scaler_->overflowed();
    }
    // One multi-tensor norm (not one per parameter), read back with the loss; the same clip as
    // the graphed step's (clip_gradients), with the norm over every shard under ZeRO-2.
    out.grad_norm = clip_gradients(
        params, config_.real("max_grad_norm"), step_options_.clip_by_value,
        [this](const std::vector<at::Tensor>& p, double max_norm) {
            return dp_->clip_grad_norm_async(p, max_norm);
        },
        optimizer_.get());
    if (out.grad_norm.defined()) out.grad_norm = out.grad_norm.detach();
    return out;
}

TrainBatch Trainer::next_batch(int64_t micro) {
    try {
        return source_->next(*generator_);
    } catch (const DataError&) {
        failed_fetch_micro_ = micro;
        throw;
    }
}

void Trainer::save_after_fetch_error() noexcept {
    if (failed_fetch_micro_ < 0 || !is_main_process()) return;
    const int64_t step = global_step_ + 1;
    const auto skip = [&](const std::string& why) {
        log::warn() << "no checkpoint saved after the data error at step " << step << ": " << why;
    };
    try {
        if (global_step_ == start_step_) return;  // nothing trained since the start or the resume
        // Gradients of earlier micro-batches and the sampler position are mid-step then.
        if (failed_fetch_micro_ > 0)
            return skip(str("it came at micro-batch ", failed_fetch_micro_ + 1,
                            " of the gradient accumulation; the last checkpoint is intact"));
        if (dp_->world_size() > 1)
            return skip("the other ranks are not at a point where they can save with this one");
        for (const auto& p : trainable_)
            if (!at::isfinite(p.tensor).all().item<bool>())
                return skip(str("weight ", p.name, " is not finite; the last checkpoint is intact"));
        save("the next batch could not be read");
        log::info() << "fix the data and run the same command again to continue from step " << global_step_;
    } catch (const std::exception& e) {
        skip(str("saving failed too: ", e.what()));
    }
}

void Trainer::save(const std::string& why) {
    // Every step's row is on disk before the checkpoint a resume cuts the log back to, and a
    // non-finite loss stops the run before its weights are saved.
    read_back_steps(global_step_);
    dp_->flush_parameters();  // ZeRO-1/2 with the sync deferred to the next forward
    // ZeRO-3: rank 0 writes the whole weights (a LoRA's checkpoint holds its replicated adapters only)
    const std::shared_ptr<void> whole = lora_ ? nullptr : whole_weights();
    const bool zero = dp_->zero_stage() >= 1;
    const int world = dp_->world_size();
    // This rank's own files: its RNG states (ranks >= 1; rank 0's are random_states.safetensors)
    // and, with ZeRO-1, its optimizer shard.
    auto rng_states = [&] {
        auto states = capture_rng_states(*generator_);
        states["optimizer"] = optimizer_generator_->get_state();
        return states;
    };
    auto write_own = [&](const std::filesystem::path& tmp) {
        if (rank_ > 0) {
            io::TensorList rng;
            for (const auto& [k, v] : rng_states()) rng.emplace_back(k, v);
            io::save_safetensors(tmp / rank_rng_file(rank_), rng);
        }
        if (zero) {
            io::TensorList opt;
            TensorMap state = optimizer_->state_dict();
            // ZeRO-3: slices keyed "<parameter>@<first element>.<state>" (zero3_model.h)
            if (dp_->sharded_parameters()) state = sliced_state_for_save(state, dp_->zero3_slices());
            for (const auto& [k, v] : state) opt.emplace_back(k, v);
            io::save_safetensors(tmp / optimizer_shard_file(rank_, world), opt);
        }
        inject_save_error(rank_, global_step_);  // DTUNE_INJECT_SAVE_ERROR (tests): a save cut short
    };
    if (!is_main_process()) {  // rank 0 writes the checkpoint; this rank adds its shard files
        dp_->write_shards(checkpoint_tmp_dir(output_dir_, global_step_), write_own);
        for (auto& cb : callbacks_)
            cb->on_checkpoint(*this, output_dir_ / ("checkpoint-" + std::to_string(global_step_)));
        return;
    }
    CheckpointContents c;
    c.global_step = global_step_;
    if (!lora_) {
        io::TensorList weights;
        for (const auto& p : trainable_) weights.emplace_back(p.name, p.tensor.detach());
        c.tensor_files[weights_file()] = std::move(weights);
    }
    if (!zero) {
        io::TensorList opt;
        for (const auto& [k, v] : optimizer_->state_dict()) opt.emplace_back(k, v);
        c.tensor_files[kOptimizerState] = std::move(opt);
    }
    c.json_files[kTrainingState] = {{"global_step", global_step_},      {"epoch", source_->epoch()},
                                    {"lr_schedule_step", global_step_}, {"world_size", world},
                                    {"zero_stage", dp_->zero_stage()},  {"batch_source", source_->state()}};
    c.json_files[kResolvedConfig] = redact_json(config_.resolved());  // no webhook secrets on disk
    c.rng_states = rng_states();
    c.write_shards = [&](const std::filesystem::path& tmp) { dp_->write_shards(tmp, write_own); };
    for (int r = 1; r < world; ++r) c.shard_files.push_back(rank_rng_file(r));
    for (int r = 0; zero && r < world; ++r) c.shard_files.push_back(optimizer_shard_file(r, world));
    c.metadata = {{"model_family", config_.text("model_family")},
                  {"model_type", config_.text("model_type")},
                  {"model_flavour", config_.text("model_flavour")},
                  {"modelspec_architecture", modelspec_architecture(*family_)}};
    save_extras(c);  // LoRA file, EMA, loss scaler
    const auto dir = save_checkpoint(output_dir_, c);
    log::info() << "saved " << dir.string() << " (" << why << ")";
    rotate_checkpoints(output_dir_, config_.integer("checkpoints_total_limit"));
    for (auto& cb : callbacks_) cb->on_checkpoint(*this, dir);
}

void Trainer::load_full_weights(const LoadedCheckpoint& ckpt) {
    const std::string weights = weights_file();
    const auto it_w = ckpt.tensor_files.find(weights);
    DTUNE_CHECK_AS(DataError, it_w != ckpt.tensor_files.end(), "checkpoint ", ckpt.dir.string(), " has no ",
                   weights, "; it was written by a different model_type or model_family");
    const auto file = ckpt.dir / weights;
    std::map<std::string, at::Tensor> by_name(it_w->second.begin(), it_w->second.end());
    if (dp_->sharded_parameters()) return load_sharded_weights(file, by_name);  // trainer_zero3.cpp
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> copied;
    for (auto& p : trainable_) {
        auto it = by_name.find(p.name);
        DTUNE_CHECK_AS(DataError, it != by_name.end(), "checkpoint ", ckpt.dir.string(), " has no weight ",
                       p.name, "; it was written by a different model or model_type");
        check_resumed_tensor(file, p.name, it->second, p.tensor);
        p.tensor.copy_(it->second);
        copied.push_back(p.tensor);
    }
    if (const int64_t bad = models::first_non_finite(copied); bad >= 0)
        throw DataError(str(file.string(), ": tensor '", trainable_[static_cast<std::size_t>(bad)].name,
                            "' holds NaN or infinite values (the run had diverged when it was saved, or the "
                            "file is damaged); resume from an earlier checkpoint"));
}

void Trainer::load_optimizer_state(const LoadedCheckpoint& ckpt) {
    // The whole state (optimizer.safetensors) or ZeRO-1 shards written by any number of ranks:
    // entries are keyed by parameter name, so this rank keeps those of the parameters it updates.
    std::set<std::string> all, mine;
    for (const auto& p : trainable_) all.insert(p.name);
    for (const auto& g : optimizer_->param_groups()) mine.insert(g.names.begin(), g.names.end());
    TensorMap opt;
    bool found = false;
    for (const auto& [rel, tensors] : ckpt.tensor_files) {
        if (rel != kOptimizerState && !is_optimizer_shard_file(rel)) continue;
        found = true;
        for (const auto& [k, v] : tensors) {
            const auto dot = k.rfind('.');
            std::string name = dot == std::string::npos ? k : k.substr(0, dot);
            if (const auto at = name.rfind('@'); at != std::string::npos) name.resize(at);  // ZeRO-3 slice
            // Unknown names go through, so that load_state_dict reports them.
            if (mine.count(name) || !all.count(name)) opt[k] = v.to(device_);
        }
    }
    DTUNE_CHECK_AS(DataError, found, "checkpoint ", ckpt.dir.string(),
                   " has no optimizer state (optimizer.safetensors or optimizer-shard-*); resume from ",
                   "another checkpoint");
    // ZeRO-3 shards hold slices ("<parameter>@<begin>.<state>"): whole per-parameter state first,
    // then this rank's slices of it when it runs ZeRO-3 itself (any world size either way).
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const auto& p : trainable_) shapes[p.name] = p.tensor.sizes().vec();
    opt = merge_sliced_state(opt, shapes);
    if (dp_->sharded_parameters()) opt = state_for_slices(opt, dp_->zero3_slices());
    optimizer_->load_state_dict(opt);
}

void Trainer::append_metrics(const StepReport& r, const nlohmann::json& fields) {
    if (!is_main_process()) return;
    nlohmann::json row{{"step", r.step},
                       {"epoch", r.epoch},
                       {"loss", r.loss},
                       {"lr", r.lr},
                       {"grad_norm", r.grad_norm},
                       {"img_per_s", r.img_per_s},
                       {"samples_seen", r.samples_seen}};
    if (r.gpu_memory_gib) row["gpu_memory_gib"] = *r.gpu_memory_gib;
    if (r.regularisation_loss) row["regularisation_loss"] = *r.regularisation_loss;
    if (r.regularisation_step) row["regularisation_grad_norm"] = r.grad_norm;
    row.update(fields);  // taken at the step: the CUDA graph counters
    if (!metrics_log_) metrics_log_ = std::make_unique<RunLog>(output_dir_ / "metrics.jsonl");
    metrics_log_->append(row);
}

void Trainer::append_metrics_row(int64_t step, const nlohmann::json& fields) {
    if (!is_main_process()) return;
    read_back_steps(global_step_);  // the steps' own rows first, where they were written before
    nlohmann::json row{{"step", step}};
    row.update(fields);
    if (!metrics_log_) metrics_log_ = std::make_unique<RunLog>(output_dir_ / "metrics.jsonl");
    metrics_log_->append(row);
}

void Trainer::write_final_outputs() {
    if (!is_main_process()) return;
    write_model_outputs();  // LoRA file(s) or the pipeline folder (trainer_extras.cpp)
}

void Trainer::queue_step(StepScalars scalars, StepReport report, bool writes_row) {
    PendingStep p;
    p.report = std::move(report);
    p.writes_row = writes_row;
    if (writes_row && is_main_process()) add_graph_fields(p.row_fields);  // the counters at this step
    const auto micro = static_cast<int64_t>(scalars.losses.size());
    const at::Tensor packed = pack_step_scalars(scalars);  // [losses..., grad_norm, mean loss]
    p.regularisation = std::move(scalars.regularisation);
    p.batches = std::move(scalars.batches);
    if (dp_->world_size() > 1) {
        // The stop/fault requests and the loss summed over the ranks: issued now, read with the rest.
        DataParallel::PendingAgreement agreement =
            dp_->agree_async(packed.narrow(0, micro + 1, 1), stop_requested(), gpu_fault_request());
        std::vector<at::Tensor> parts{packed, agreement.flags};
        if (scaler_values_.defined()) parts.push_back(std::move(scaler_values_));  // last: fp16 (update())
        p.values = DeferredRead(std::move(parts), std::move(agreement.reduce));
    } else {
        std::vector<at::Tensor> parts{packed};
        if (scaler_values_.defined()) parts.push_back(std::move(scaler_values_));
        p.values = DeferredRead(std::move(parts));
    }
    scaler_values_ = at::Tensor();
    pending_steps_.push_back(std::move(p));
    read_back_steps(global_step_ - readback_.lag);
}

void Trainer::read_back_steps(int64_t step, bool wait) {
    while (!pending_steps_.empty() && pending_steps_.front().report.step <= step) {
        if (!wait && !pending_steps_.front().values.ready()) return;
        PendingStep p = std::move(pending_steps_.front());
        pending_steps_.pop_front();  // first: a step that fails here is not read again
        read_back_step(p);
    }
}

void Trainer::read_back_step(PendingStep& p) {
    const std::vector<double>& v = p.values.wait();
    const std::size_t micro = p.regularisation.size();
    StepReport& r = p.report;
    const std::string late = r.step < global_step_ ? str(", read back at step ", global_step_) : "";
    for (std::size_t i = 0; i < micro; ++i)
        if (!std::isfinite(v[i])) {
            loss_failed_ = true;
            throw Error(str("the loss is ", v[i], " at step ", r.step, late, " (batch: ", p.batches[i],
                            "); lower learning_rate, set max_grad_norm, use mixed_precision bf16 or no, ",
                            "or check those images; resume from the last checkpoint"));
        }
    double regularisation_sum = 0;
    int64_t regularisation_batches = 0;
    for (std::size_t i = 0; i < micro; ++i)
        if (p.regularisation[i]) {
            regularisation_sum += v[i];
            ++regularisation_batches;
        }
    if (regularisation_batches > 0)
        r.regularisation_loss = regularisation_sum / static_cast<double>(regularisation_batches);
    r.grad_norm = v[micro];
    r.loss = v[micro + 1];
    if (dp_->world_size() > 1) {
        const StepAgreement agreed = dp_->read_agreement(v.data() + micro + 2);
        agreements_[r.step] = agreed;
        r.loss = agreed.mean_loss;
        if (!std::isfinite(r.loss)) {
            loss_failed_ = true;
            throw Error(
                str("the loss averaged over the ranks is ", r.loss, " at step ", r.step, late,
                    ": another rank's loss is not finite (its log names the batch); lower ",
                    "learning_rate, set max_grad_norm or check the data; resume from the last checkpoint"));
        }
    }
    if (scaler_) read_back_loss_scale(p, v);  // trainer_extras.cpp
    if (p.writes_row) append_metrics(r, p.row_fields);
    last_read_ = r;
    for (auto& cb : callbacks_) cb->on_step_metrics(*this, r);
}

void Trainer::read_back_after_error() noexcept {
    if (loss_failed_) {  // the steps after a non-finite loss trained on its gradients: no rows
        pending_steps_.clear();
        return;
    }
    try {
        // One process waits for its own copies; with several ranks only what has arrived is
        // written (a step's agreement may never complete once a rank has failed).
        read_back_steps(global_step_, dp_->world_size() == 1);
    } catch (const std::exception& e) {
        log::warn() << "the metrics of the last steps were not read back: " << e.what();
    }
    pending_steps_.clear();
}

TrainResult Trainer::run() {
    try {
        return run_loop();
    } catch (const std::exception& e) {
        read_back_after_error();  // the rows of the steps that completed
        save_after_fetch_error();
        if (metrics_log_) metrics_log_->finish_quietly();
        dp_->report_failure(e);  // first: the other ranks stop now, not at the collective timeout
        for (auto& cb : callbacks_) cb->on_error(*this, e);
        throw;
    }
}

TrainResult Trainer::run_loop() {
    attach_data_parallel();  // rank 0's weights everywhere; reducer; ZeRO partition or ZeRO-3 shards
    build_optimizer();
    if (scaler_) scaler_skips_on_device_ = optimizer_->skip_step_on_overflow(scaler_->found_inf());
    start_ema();
    resume();
    check_output_space();
    start_step_ = global_step_;
    // Rows of steps after the resumed one (or all, when starting afresh) are written again.
    if (is_main_process()) cut_log_after_step(output_dir_ / "metrics.jsonl", global_step_);
    init_graph();  // cuda_graph (trainer_graph.cpp)
    LRScheduleOptions lr_options;
    lr_options.type = parse_lr_schedule(config_.text("lr_scheduler"), config_.integer("lr_warmup_steps"));
    lr_options.base_lr = config_.real("learning_rate");
    lr_options.warmup_steps = config_.integer("lr_warmup_steps");
    lr_options.training_steps = total_steps_;
    lr_options.num_cycles = config_.real("lr_num_cycles");
    lr_options.lr_end = config_.real("lr_end");
    lr_options.power = config_.real("lr_power");
    const LRSchedule schedule(lr_options);
    const int64_t interval = config_.integer("checkpoint_step_interval");
    const int64_t images_per_step = config_.integer("train_batch_size") *
                                    config_.integer("gradient_accumulation_steps") * dp_->world_size();
    for (auto& cb : callbacks_) cb->on_train_start(*this);
    // metrics.jsonl's gpu_memory_gib is the steps' peak (validation's included); loading, the caches'
    // encoders and quantisation peak before it, said here once.
    if (const auto setup_peak = peak_gpu_memory_gib(device_)) {
        log::info() << "GPU memory before the first step: peak " << format_metric(*setup_peak)
                    << " GiB while loading and caching; metrics.jsonl reports the training peak from here";
        reset_peak_gpu_memory(device_);
    }
    ProgressOptions progress_options{"training", "step"};
    progress_options.quiet = !is_main_process();
    Progress progress(total_steps_, progress_options);
    progress.update(global_step_);
    TrainResult result;
    result.resumed_from = resumed_from_;
    // Every rank leaves the loop at the same step: decisions come from the ranks' agreement.
    StepAgreement agreed = dp_->agree(0.0, stop_requested(), gpu_fault_request());
    // Throughput over the steps since the last metrics row: with CUDA graphs the host runs ahead
    // and the step that reads the loss back waits for the queued ones, so one step's time alone
    // says nothing; the sum over the window is the time the steps took.
    double window_seconds = 0;
    int64_t window_steps = 0;
    // The read-back at the end of a step waits for an earlier step's GPU work (lag steps behind):
    // that wait is step time too, counted into the next step's time so that the steps' times add
    // up to the wall time (without it a 2-GPU run's rows claimed 22.9 img/s while its steps took
    // 150 ms of GPU time for 2 images). Saves, validation and callbacks stay out.
    double readback_wait = 0;
    while (global_step_ < total_steps_) {
        // One process: a request made since the last step counts now (no peers to agree with).
        if (dp_->world_size() == 1)
            agreed = dp_->agree(agreed.mean_loss, stop_requested(), gpu_fault_request());
        if (agreed.fault()) {
            log_fault_stop(agreed, global_step_);
            result.outcome = TrainOutcome::kGpuFault;
            result.fault_rank = agreed.fault_rank;
            result.fault_gpu = agreed.fault_gpu;
            break;
        }
        if (agreed.stop) {
            // Stopped before this run trained a step (e.g. during the cache build): the last
            // checkpoint, if any, already holds this state.
            if (global_step_ > start_step_)
                save("stop requested");
            else
                log::info() << "stop requested before the first step of this run: no checkpoint to save";
            result.outcome = TrainOutcome::kInterrupted;
            break;
        }
        const auto t0 = std::chrono::steady_clock::now();
        const double lr = schedule.lr(global_step_);
        StepScalars scalars;
        {
            // The factors' compute-dtype copies serve this step's forwards only (LoRATraining).
            struct EndStep {
                LoRATraining* lora;
                ~EndStep() {
                    if (lora) lora->end_step();
                }
            } end_step{lora_.get()};
            scalars = graph_ ? train_graphed_step(lr) : train_one_step();
        }
        if (!graph_) {
            optimizer_->set_lr(lr);
            // fp16 overflow: fused AdamW skips on the device; other optimizers are not called.
            if (!step_overflowed_) optimizer_->step();
            optimizer_->zero_grad();
        }
        dp_->after_step();  // ZeRO-1: weights from their owners; every gradient dropped
        ++global_step_;
        // fp16: back off or grow on the device; the step's scale and skip come with its read-back.
        if (scaler_) scaler_values_ = scaler_->update();
        if (ema_) ema_->step(global_step_);
        const double dt =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() + readback_wait;
        StepReport report;  // loss and grad_norm come with the read-back (queue_step)
        report.step = global_step_;
        report.epoch = source_->epoch();
        report.loss = std::numeric_limits<double>::quiet_NaN();
        report.lr = lr;
        report.grad_norm = std::numeric_limits<double>::quiet_NaN();
        window_seconds += dt;
        ++window_steps;
        report.img_per_s = static_cast<double>(images_per_step * window_steps) / window_seconds;
        report.samples_seen = global_step_ * images_per_step;
        report.step_seconds = dt;
        report.gpu_memory_gib = peak_gpu_memory_gib(device_);
        report.regularisation_step = step_ended_on_regularisation_;
        const bool writes_row = global_step_ % std::max<int64_t>(1, config_.integer("metrics_interval")) == 0;
        if (writes_row) {
            window_seconds = 0;
            window_steps = 0;
        }
        // Queued for the host; the steps `lag` behind are read back now (rows, on_step_metrics).
        const auto wait_start = std::chrono::steady_clock::now();
        queue_step(std::move(scalars), report, writes_row);
        readback_wait = std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count();
        if (dp_->world_size() > 1) {  // the agreement every rank reads at this step: lag steps old
            const auto it = agreements_.find(global_step_ - readback_.lag);
            if (it != agreements_.end()) agreed = it->second;
            agreements_.erase(agreements_.begin(), agreements_.upper_bound(global_step_ - readback_.lag));
        }
        const StepReport now = last_read_ && last_read_->step == global_step_ ? *last_read_ : report;
        for (auto& cb : callbacks_) cb->on_step_end(*this, now);
        if (last_read_)
            progress.set_postfix(str("loss ", format_metric(last_read_->loss), " lr ",
                                     format_metric(last_read_->lr), " ",
                                     format_rate(report.img_per_s, "img")));
        progress.update();
        if (interval > 0 && global_step_ % interval == 0 && global_step_ < total_steps_) save("interval");
    }
    progress.finish();
    if (result.outcome == TrainOutcome::kGpuFault) {
        try {  // the rows of the steps before the stop (the GPU may not answer)
            read_back_steps(global_step_);
        } catch (const std::exception& e) {
            log::warn() << "the metrics of the last steps before the GPU fault were not read back: "
                        << e.what();
            pending_steps_.clear();
        }
    }
    if (result.outcome == TrainOutcome::kCompleted) {
        // ZeRO-3: the whole weights stay in the model from here on (final save, exports, the last
        // validation); a no-op otherwise. A LoRA's outputs are its adapters: its base stays sharded
        // (the last validation and eval loss gather it themselves).
        if (!lora_) dp_->gather_weights();
        // Optional (tests, debugging): every rank must hold exactly rank 0's weights.
        if (std::getenv("DTUNE_CHECK_RANK_WEIGHTS")) dp_->check_identical({}, 0.0);
        save("end of training");
        write_final_outputs();
    }
    read_back_steps(global_step_);  // (saving did it; nothing is left unless the stop came first)
    result.global_step = global_step_;
    if (last_read_) result.last_loss = last_read_->loss;
    for (auto& cb : callbacks_) cb->on_train_end(*this, result);
    // After on_train_end: the final validation's rows are in. Rows held while the disk was full
    // are written now, or DataError.
    if (metrics_log_) metrics_log_->finish();
    return result;
}

int64_t Trainer::trainable_bytes() const {
    int64_t bytes = 0;
    for (const auto& p : trainable_)
        bytes += p.tensor.numel() * static_cast<int64_t>(p.tensor.element_size());
    return bytes;
}

int64_t Trainer::estimated_checkpoint_bytes() const {
    const int64_t weights = trainable_bytes();
    int64_t elements = 0;
    for (const auto& p : trainable_) elements += p.tensor.numel();
    const std::string optimizer = config_.text("optimizer");
    const auto tensors = static_cast<int64_t>(trainable_.size());
    int64_t state = 0, entries = 0;  // entries: state tensors per parameter
    if (optimizer == "torch-adamw" || optimizer == "optimi-adamw") {
        state = 2 * weights + 4 * tensors;  // exp_avg and exp_avg_sq in the parameters' dtype, a float step
        entries = 3;
    } else if (optimizer == "adamw_bf16") {
        state = 3 * 2 * elements + 16 * tensors;  // m, v and the shift in bf16; float64 step and decay
        entries = 5;
    } else if (optimizer == "optimi-lion") {
        state = weights;  // exp_avg
        entries = 1;
    }
    const bool ema = config_.flag("use_ema");
    // About 130 bytes of safetensors header per tensor: it matters only for LoRAs' many small ones.
    const int64_t headers = 130 * tensors * (1 + entries + (ema ? 1 : 0));
    return weights + state + (ema ? weights : 0) + headers;
}

void Trainer::check_output_space() const {
    if (!is_main_process()) return;
    const int64_t checkpoint = estimated_checkpoint_bytes();
    const int64_t weights = trainable_bytes();  // the final export writes the trained weights once more
    const double gb = 1e9;
    std::error_code ec;
    const auto space = std::filesystem::space(output_dir_, ec);
    const int64_t keep = config_.integer("checkpoints_total_limit");
    log::info() << "checkpoints of this run: about " << format_metric(static_cast<double>(checkpoint) / gb)
                << " GB each (checkpoints_total_limit " << keep << ")"
                << (ec ? ""
                       : str("; ", format_metric(static_cast<double>(space.available) / gb), " GB free in '",
                             output_dir_.string(), "'"));
    if (ec) return;
    const auto free = static_cast<int64_t>(space.available);
    if (free < checkpoint + weights)
        log::warn()
            << "output_dir '" << output_dir_.string() << "' has " << format_metric(free / gb)
            << " GB free, less than one checkpoint of this run (about " << format_metric(checkpoint / gb)
            << " GB: weights, optimizer state" << (config_.flag("use_ema") ? ", EMA" : "")
            << ") plus the final weights (" << format_metric(weights / gb)
            << " GB): the first checkpoint will fail with a full disk (the previous one stays intact). "
            << "Free space there, or point output_dir at a larger file system";
}

}  // namespace dtune::train
