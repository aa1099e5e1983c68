// The training loop (see trainer.h).
#include "train/trainer.h"

#include <ATen/Context.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <random>

#include "core/dtype.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/gpu_memory.h"
#include "core/log.h"
#include "core/progress.h"
#include "models/common/weights.h"
#include "models/vae/autoencoder_kl.h"
#include "train/checkpoint.h"
#include "train/lr_schedule.h"
#include "train/signals.h"

namespace dtune::train {
namespace {

constexpr const char* kUNetWeights = "unet/diffusion_pytorch_model.safetensors";
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
    log::info() << "pretrained_vae_model_name_or_path " << vae.string()
                << " is not a local folder; using the model's own VAE " << (model_dir / "vae").string();
    return model_dir / "vae";
}

// 4 significant digits for the progress bar ("0.1234", "1e-04").
std::string format_metric(double v) {
    char b[32];
    std::snprintf(b, sizeof(b), "%.4g", v);
    return b;
}

}  // namespace

c10::Device parse_train_device(const std::string& name) {
    return parse_device(name);
}

Trainer::Trainer(TrainConfig config) : config_(std::move(config)) {
    DTUNE_CHECK_AS(
        UsageError, config_.text("model_type") == "full", "model_type ", config_.text("model_type"),
        " is not trained by dtune yet (LoRA adapters are landing); set model_type to full for now");
    model_dir_ = config_.text("pretrained_model_name_or_path");
    DTUNE_CHECK_AS(UsageError, !model_dir_.empty() && std::filesystem::is_directory(model_dir_),
                   "pretrained_model_name_or_path \"", model_dir_.string(),
                   "\" is not a local folder; dtune reads diffusers folders only (no hub downloads)");
    DTUNE_CHECK_AS(UsageError, !config_.is_null("data_backend_config"),
                   "data_backend_config is required; point it at your multidatabackend.json");
    device_ = parse_train_device(config_.text("device"));
    models::ComponentLoadOptions load;
    load.device = device_;
    load.dtype = config_.text("optimizer") == "adamw_bf16" ? at::kBFloat16 : at::kFloat;
    unet_ = models::load_unet(model_dir_ / "unet", load);
    const auto sched_json =
        nlohmann::json::parse(fs::read_file(model_dir_ / "scheduler" / "scheduler_config.json"));
    schedule_.emplace(
        diffusion::NoiseScheduleConfig::from_json(sched_json, (model_dir_ / "scheduler").string()));

    models::ComponentLoadOptions vae_load;
    vae_load.device = device_;  // fp32: SDXL's VAE overflows in fp16 and encode cost is small
    auto vae = models::load_autoencoder_kl(vae_dir(config_, model_dir_), vae_load);
    vae->eval();
    LatentEncoder encode = [vae](const at::Tensor& images, at::Generator& gen) mutable {
        at::NoGradGuard no_grad;
        const auto posterior = vae->encode(images.to(at::kFloat));  // [B, C, h, w] each
        const at::Tensor eps = at::randn(posterior.mean.sizes(), gen, at::kFloat).to(posterior.mean.device());
        return vae->scale_latents(posterior.mean + posterior.std * eps);
    };
    const auto& uc = unet_->config();
    const int64_t pooled_dim = uc.projection_class_embeddings_input_dim - 6 * uc.addition_time_embed_dim;
    log::warn()
        << "the SDXL text encoders are not in dtune yet: captions are embedded by a seeded placeholder, "
           "so this run exercises the trainer but the model will not learn to follow prompts";
    auto embedder = std::make_shared<HashedTextEmbedder>(77, uc.cross_attention_dim.at(0), pooled_dim);
    ImageFolderOptions io;
    io.data_backend_config = config_.text("data_backend_config");
    io.output_dir = config_.text("output_dir");
    io.resolution = config_.real("resolution");
    io.resolution_type = config_.text("resolution_type");
    io.batch_size = static_cast<int>(config_.integer("train_batch_size"));
    io.seed = resolve_seed(config_);
    io.device = device_;
    source_ = make_image_folder_source(io, encode, embedder);
    config_.set("seed", std::to_string(io.seed), "resolved seed");
    init_common();
}

Trainer::Trainer(TrainConfig config, models::UNet2DConditionModel unet, diffusion::NoiseSchedule schedule,
                 std::unique_ptr<BatchSource> source)
    : config_(std::move(config)),
      unet_(std::move(unet)),
      schedule_(std::move(schedule)),
      source_(std::move(source)) {
    device_ = unet_->parameters().front().device();
    config_.set("seed", std::to_string(resolve_seed(config_)), "resolved seed");
    init_common();
}

Trainer::~Trainer() = default;

void Trainer::init_common() {
    output_dir_ = config_.text("output_dir");
    std::filesystem::create_directories(output_dir_);
    if (config_.flag("deterministic")) at::globalContext().setDeterministicAlgorithms(true, false);
    const uint64_t seed = static_cast<uint64_t>(config_.integer("seed"));
    generator_ = at::detail::createCPUGenerator(seed);
    optimizer_generator_ = at::detail::createCPUGenerator(seed ^ 0x9e3779b97f4a7c15ULL);
    unet_->train();
    unet_->set_gradient_checkpointing(config_.flag("gradient_checkpointing"));

    auto& s = step_options_;
    s.noise.offset_noise = config_.flag("offset_noise");
    s.noise.noise_offset = config_.real("noise_offset");
    s.noise.noise_offset_probability = config_.real("noise_offset_probability");
    s.noise.input_perturbation = config_.real("input_perturbation");
    s.loss.snr_gamma = config_.opt_real("snr_gamma");
    s.prediction = config_.is_null("prediction_type")
                       ? schedule_->config().prediction_type
                       : diffusion::parse_prediction_type(config_.text("prediction_type"), "prediction_type");
    s.caption_dropout_probability = config_.real("caption_dropout_probability");
    const std::string mp = config_.text("mixed_precision");
    DTUNE_CHECK_AS(UsageError, mp != "fp16",
                   "mixed_precision fp16 needs loss scaling, which dtune does not have ",
                   "yet; use bf16 or no");
    s.compute_dtype = mp == "bf16" && device_.is_cuda() ? at::kBFloat16 : at::kFloat;
    empty_prompt_ = source_->empty_prompt();
    empty_prompt_.prompt = empty_prompt_.prompt.to(device_);
    empty_prompt_.pooled = empty_prompt_.pooled.to(device_);

    const int64_t accum = config_.integer("gradient_accumulation_steps");
    const auto max_steps = config_.opt_integer("max_train_steps");
    total_steps_ = max_steps && *max_steps > 0 ? *max_steps
                                               : config_.integer("num_train_epochs") *
                                                     ((source_->batches_per_epoch() + accum - 1) / accum);
    for (const auto& item : unet_->named_parameters()) trainable_.push_back({item.key(), item.value()});
    config_.write_resolved(output_dir_ / kResolvedConfig);
}

void Trainer::set_trainable_parameters(std::vector<NamedTensor> params) {
    for (auto& p : unet_->parameters()) p.set_requires_grad(false);
    for (auto& p : params) p.tensor.set_requires_grad(true);
    trainable_ = std::move(params);
}

void Trainer::add_callback(std::shared_ptr<TrainCallback> callback) {
    callbacks_.push_back(std::move(callback));
}

void Trainer::build_optimizer() {
    ParamGroup group;
    for (const auto& p : trainable_) {
        group.names.push_back(p.name);
        group.params.push_back(p.tensor);
    }
    group.lr = config_.real("learning_rate");
    group.weight_decay = config_.real("adam_weight_decay");
    const std::string name = config_.text("optimizer");
    const double b1 = config_.real("adam_beta1"), b2 = config_.real("adam_beta2");
    std::vector<ParamGroup> groups{std::move(group)};
    if (name == "adamw_bf16") {
        for (const auto& p : trainable_)
            DTUNE_CHECK_AS(UsageError, p.tensor.scalar_type() == at::kBFloat16,
                           "optimizer adamw_bf16 needs bf16 ", "weights but ", p.name, " is ",
                           dtype_name(p.tensor.scalar_type()),
                           "; choose optimizer torch-adamw for fp32 weights");
        AdamWBF16Options o;
        o.beta1 = b1, o.beta2 = b2;
        optimizer_ = std::make_unique<AdamWBF16>(std::move(groups), *optimizer_generator_, o);
    } else if (name == "torch-adamw" || name == "optimi-adamw") {
        AdamWOptions o;
        o.beta1 = b1, o.beta2 = b2, o.eps = config_.real("adam_epsilon");
        o.fused = !config_.flag("deterministic");  // the per-tensor loop has a fixed op order
        optimizer_ = std::make_unique<AdamW>(std::move(groups), o);
    } else if (name == "optimi-lion") {
        optimizer_ = std::make_unique<Lion>(std::move(groups), LionOptions{b1, b2});
    } else if (name == "torch-sgd") {
        optimizer_ = std::make_unique<SGD>(std::move(groups));
    } else {
        optimizer_ = std::make_unique<Adafactor>(std::move(groups));
    }
}

void Trainer::resume() {
    const auto dir = resolve_resume_checkpoint(output_dir_, config_.text("resume_from_checkpoint"));
    if (!dir) return;
    const LoadedCheckpoint ckpt = load_checkpoint(*dir);
    const auto& weights = ckpt.tensor_files.at(kUNetWeights);
    std::map<std::string, at::Tensor> by_name(weights.begin(), weights.end());
    at::NoGradGuard no_grad;
    for (auto& p : trainable_) {
        auto it = by_name.find(p.name);
        DTUNE_CHECK_AS(DataError, it != by_name.end(), "checkpoint ", dir->string(), " has no weight ",
                       p.name, "; it was written by a different model or model_type");
        p.tensor.copy_(it->second);
    }
    TensorMap opt;
    for (const auto& [k, v] : ckpt.tensor_files.at(kOptimizerState)) opt[k] = v.to(device_);
    optimizer_->load_state_dict(opt);
    const auto& state = ckpt.json_files.at(kTrainingState);
    source_->load_state(state.at("batch_source"));
    global_step_ = state.at("global_step").get<int64_t>();
    restore_rng_states(ckpt.rng_states, *generator_);
    if (auto it = ckpt.rng_states.find("optimizer"); it != ckpt.rng_states.end())
        optimizer_generator_->set_state(it->second);
    resumed_from_ = *dir;
    log::info() << "resumed from " << dir->string() << " at step " << global_step_;
}

double Trainer::train_one_step(double& grad_norm) {
    const int64_t accum = config_.integer("gradient_accumulation_steps");
    double loss_sum = 0;
    for (int64_t micro = 0; micro < accum; ++micro) {
        TrainBatch batch = source_->next(*generator_);
        apply_caption_dropout(batch, empty_prompt_, step_options_.caption_dropout_probability, *generator_);
        MicroStep m = micro_step(*unet_, batch, *schedule_, step_options_, global_step_, *generator_);
        const double value = m.loss.item<double>();
        if (!std::isfinite(value)) {
            std::string files;
            for (const auto& p : batch.paths) files += (files.empty() ? "" : ", ") + p;
            throw Error(str("the loss is ", value, " at step ", global_step_ + 1, " (batch: ", files,
                            "); lower learning_rate, set max_grad_norm, use mixed_precision bf16 or no, ",
                            "or check those images; resume from the last checkpoint"));
        }
        (m.loss / static_cast<double>(accum)).backward();
        loss_sum += value;
    }
    std::vector<at::Tensor> params;
    for (const auto& p : trainable_) params.push_back(p.tensor);
    double sq = 0;
    for (const auto& p : params)
        if (p.grad().defined()) sq += p.grad().to(at::kFloat).pow(2).sum().item<double>();
    grad_norm = std::sqrt(sq);
    const double max_grad = config_.real("max_grad_norm");
    if (max_grad > 0) {
        if (config_.text("grad_clip_method") == "norm")
            clip_grad_norm(params, max_grad);
        else
            clip_grad_value(params, max_grad);
    }
    return loss_sum / static_cast<double>(accum);
}

void Trainer::save(const std::string& why) {
    CheckpointContents c;
    c.global_step = global_step_;
    io::TensorList weights;
    for (const auto& p : trainable_) weights.emplace_back(p.name, p.tensor.detach());
    c.tensor_files[kUNetWeights] = std::move(weights);
    io::TensorList opt;
    for (const auto& [k, v] : optimizer_->state_dict()) opt.emplace_back(k, v);
    c.tensor_files[kOptimizerState] = std::move(opt);
    c.json_files[kTrainingState] = {{"global_step", global_step_},
                                    {"epoch", source_->epoch()},
                                    {"lr_schedule_step", global_step_},
                                    {"batch_source", source_->state()}};
    c.json_files[kResolvedConfig] = config_.resolved();
    c.rng_states = capture_rng_states(*generator_);
    c.rng_states["optimizer"] = optimizer_generator_->get_state();
    c.metadata = {{"model_family", config_.text("model_family")},
                  {"model_type", config_.text("model_type")},
                  {"model_flavour", config_.text("model_flavour")},
                  {"modelspec_architecture", "stable-diffusion-xl-v1-base"}};
    const auto dir = save_checkpoint(output_dir_, c);
    log::info() << "saved " << dir.string() << " (" << why << ")";
    rotate_checkpoints(output_dir_, config_.integer("checkpoints_total_limit"));
    for (auto& cb : callbacks_) cb->on_checkpoint(*this, dir);
}

void Trainer::append_metrics(const StepReport& r) {
    if (!is_main_process()) return;
    nlohmann::json row{{"step", r.step},
                       {"epoch", r.epoch},
                       {"loss", r.loss},
                       {"lr", r.lr},
                       {"grad_norm", r.grad_norm},
                       {"img_per_s", r.img_per_s},
                       {"samples_seen", r.samples_seen}};
    if (r.gpu_memory_gib) row["gpu_memory_gib"] = *r.gpu_memory_gib;
    std::ofstream out(output_dir_ / "metrics.jsonl", std::ios::app);
    out << row.dump() << "\n";
}

void Trainer::write_final_outputs() {
    // The trained UNet as a diffusers component folder (the full pipeline export comes later).
    const auto unet_dir = output_dir_ / "pipeline" / "unet";
    std::filesystem::create_directories(unet_dir);
    io::save_safetensors(unet_dir / "diffusion_pytorch_model.safetensors", models::state_dict(*unet_));
    if (!model_dir_.empty())
        fs::write_file_atomic(unet_dir / "config.json", fs::read_file(model_dir_ / "unet" / "config.json"));
}

TrainResult Trainer::run() {
    try {
        return run_loop();
    } catch (const std::exception& e) {
        for (auto& cb : callbacks_) cb->on_error(*this, e);
        throw;
    }
}

TrainResult Trainer::run_loop() {
    build_optimizer();
    resume();
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
    const int64_t images_per_step =
        config_.integer("train_batch_size") * config_.integer("gradient_accumulation_steps");
    for (auto& cb : callbacks_) cb->on_train_start(*this);
    ProgressOptions progress_options{"training", "step"};
    progress_options.quiet = !is_main_process();
    Progress progress(total_steps_, progress_options);
    progress.update(global_step_);
    TrainResult result;
    result.resumed_from = resumed_from_;
    while (global_step_ < total_steps_) {
        if (stop_requested()) {
            save("stop requested");
            result.outcome = TrainOutcome::kInterrupted;
            break;
        }
        const auto t0 = std::chrono::steady_clock::now();
        double grad_norm = 0;
        const double lr = schedule.lr(global_step_);
        const double loss = train_one_step(grad_norm);
        optimizer_->set_lr(lr);
        optimizer_->step();
        optimizer_->zero_grad();
        ++global_step_;
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        result.last_loss = loss;
        StepReport report;
        report.step = global_step_;
        report.epoch = source_->epoch();
        report.loss = loss;
        report.lr = lr;
        report.grad_norm = grad_norm;
        report.img_per_s = static_cast<double>(images_per_step) / dt;
        report.samples_seen = global_step_ * images_per_step;
        report.step_seconds = dt;
        report.gpu_memory_gib = peak_gpu_memory_gib(device_);
        if (global_step_ % std::max<int64_t>(1, config_.integer("metrics_interval")) == 0)
            append_metrics(report);
        for (auto& cb : callbacks_) cb->on_step_end(*this, report);
        progress.set_postfix(str("loss ", format_metric(loss), " lr ", format_metric(lr), " ",
                                 format_rate(report.img_per_s, "img")));
        progress.update();
        if (interval > 0 && global_step_ % interval == 0 && global_step_ < total_steps_) save("interval");
    }
    progress.finish();
    if (result.outcome == TrainOutcome::kCompleted) {
        save("end of training");
        write_final_outputs();
    }
    result.global_step = global_step_;
    for (auto& cb : callbacks_) cb->on_train_end(*this, result);
    return result;
}

}  // namespace dtune::train
