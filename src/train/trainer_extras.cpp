// The trainer's model-type and precision extras (see trainer.h): LoRA injection and adapter files,
// the EMA of the trainable parameters, fp16 loss scaling, and the final exports.
//
// Files, following SimpleTuner's layout (SIMPLETUNER.md §7):
//   checkpoint-N/pytorch_lora_weights.safetensors       LoRA (lora_format keys); resumed from
//   checkpoint-N/ema/pytorch_lora_weights.safetensors   LoRA + EMA, loadable like the above
//   checkpoint-N/<unet|transformer>/config.json        full: makes the folder a loadable component
//   checkpoint-N/<folder>_ema/...                       EMA shadows (full: a loadable network folder,
//                                                       LoRA: ema_model.safetensors) + ema_state.json
//   checkpoint-N/loss_scaler.json                       fp16: scale, clean-step counter, skipped steps
//   output_dir/pytorch_lora_weights.safetensors (+ ema/) or output_dir/pipeline/ (+ the optional
//   single file output_dir/sdxl_checkpoint.safetensors); a full fine-tune with EMA exports the EMA
//   weights, as SimpleTuner does.
#include <torch/nn/module.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "io/safetensors.h"
#include "models/common/weights.h"
#include "train/adapters.h"
#include "train/checkpoint.h"
#include "train/loss_scaler.h"
#include "train/trainer.h"

namespace dtune::train {
namespace {

// EMA files under "<denoiser folder>_ema/" (unet_ema for SDXL, transformer_ema for Flux).
std::string ema_file(const family::ModelFamily& family, const char* name) {
    return str(family.denoiser_folder(), "_ema/", name);
}
constexpr const char* kLossScalerState = "loss_scaler.json";

std::optional<std::filesystem::path> local_vae(const TrainConfig& config) {
    const std::filesystem::path vae = config.text("pretrained_vae_model_name_or_path");
    if (!vae.empty() && std::filesystem::is_regular_file(vae / "config.json")) return vae;
    return std::nullopt;
}

}  // namespace

void Trainer::init_extras() {
    if (model_dir_.empty()) {  // the constructor with a given model: exports still need the base folder
        const std::filesystem::path base = config_.text("pretrained_model_name_or_path");
        if (!base.empty() && std::filesystem::is_regular_file(base / "model_index.json")) model_dir_ = base;
    }
    const bool lora = config_.text("model_type") == "lora";
    if (lora) {
        lora_ = std::make_unique<LoRATraining>(model_->module(), config_, *family_);
        // Adapters are created in the base weights' dtype; on a bf16 base they train in float32
        // (unless adamw_bf16 asks for bf16 weights), as diffusers' and SimpleTuner's scripts do.
        if (config_.text("optimizer") != "adamw_bf16") {
            at::NoGradGuard no_grad;
            for (auto& [name, tensor] : lora_->trainable())
                if (tensor.scalar_type() != at::kFloat) tensor.set_data(tensor.to(at::kFloat));
        }
        std::vector<NamedTensor> params;
        for (auto& [name, tensor] : lora_->trainable()) params.push_back({name, tensor});
        set_trainable_parameters(std::move(params));
    }
    DTUNE_CHECK_AS(
        UsageError, !lora || !config_.flag("export_single_file"),
        "export_single_file writes the fully fine-tuned model as one file and needs model_type full; "
        "for a LoRA use pytorch_lora_weights.safetensors (lora_format comfyui for ComfyUI)");
    if (config_.text("mixed_precision") == "fp16") {
        scaler_ = std::make_unique<LossScaler>(LossScalerOptions{}, device_);
        if (!device_.is_cuda())
            log::info() << "mixed_precision fp16 on the CPU: no autocast (float32 compute); the dynamic loss "
                           "scaler still runs";
    }
}

void Trainer::set_loss_scaler_options(const LossScalerOptions& options) {
    if (scaler_) scaler_ = std::make_unique<LossScaler>(options, device_);
}

void Trainer::read_back_loss_scale(PendingStep& p, const std::vector<double>& v) {
    DTUNE_CHECK(v.size() >= p.regularisation.size() + 5, "internal: step ", p.report.step,
                " was queued without its loss-scaler values");
    const double found_inf = v[v.size() - 3], scale = v[v.size() - 2];
    const auto skipped = static_cast<int64_t>(v[v.size() - 1]);
    p.row_fields["loss_scale"] = scale;  // the scale this step's loss was multiplied by
    p.row_fields["skipped_steps"] = skipped;
    if (found_inf != 0 && is_main_process())
        log::info() << "step " << p.report.step << ": fp16 gradients overflowed at loss scale " << scale
                    << "; its optimizer step was skipped (" << skipped << " so far) and the scale lowered to "
                    << scale * scaler_->options().backoff_factor;
}

void Trainer::start_ema() {
    if (!config_.flag("use_ema")) return;
    io::TensorList params;
    for (const auto& p : trainable_) params.emplace_back(p.name, p.tensor);
    ema_ = std::make_unique<EMAModel>(std::move(params), ema_options_from(config_));
    log::info() << "EMA of " << trainable_.size() << " trainable tensors (decay " << config_.real("ema_decay")
                << ", on " << config_.text("ema_device") << ")";
}

EMAWeightsGuard Trainer::use_ema_weights() {
    return ema_ ? EMAWeightsGuard(*ema_) : EMAWeightsGuard();
}

void Trainer::save_extras(CheckpointContents& c) {
    if (lora_) {
        c.file_writers[kLoRAWeightsFile] = [this](const std::filesystem::path& file) { lora_->save(file); };
        if (ema_)
            c.file_writers[std::string("ema/") + kLoRAWeightsFile] =
                [this](const std::filesystem::path& file) {
                    EMAWeightsGuard swap = use_ema_weights();
                    lora_->save(file);
                };
    } else if (!model_dir_.empty()) {
        const std::string folder = family_->denoiser_folder();
        c.json_files[folder + "/config.json"] =
            nlohmann::json::parse(fs::read_file(model_dir_ / folder / "config.json"));
    }
    if (ema_) {
        c.tensor_files[ema_file(*family_, lora_ ? "ema_model.safetensors"
                                                : "diffusion_pytorch_model.safetensors")] = ema_->shadows();
        if (!lora_ && !model_dir_.empty())
            c.json_files[ema_file(*family_, "config.json")] =
                c.json_files[std::string(family_->denoiser_folder()) + "/config.json"];
        c.json_files[ema_file(*family_, "ema_state.json")] = ema_->state();
    }
    if (scaler_) c.json_files[kLossScalerState] = scaler_->state();
}

bool Trainer::load_lora_weights(const LoadedCheckpoint& ckpt) {
    if (!lora_) return false;
    const auto file = ckpt.dir / kLoRAWeightsFile;
    DTUNE_CHECK_AS(DataError, std::filesystem::is_regular_file(file), "checkpoint ", ckpt.dir.string(),
                   " has no ", kLoRAWeightsFile,
                   "; it was written by a model_type full run. Resume it with "
                   "model_type full, or start the LoRA in a new output_dir");
    lora_->load_exact(file);
    return true;
}

namespace {

// Runs `load` on the JSON file `rel` of the checkpoint; the JSON library's type errors (a field of
// the wrong type) become a DataError naming the file.
template <typename Load>
void load_json_state(const LoadedCheckpoint& ckpt, const std::string& rel, Load load) {
    try {
        load(ckpt.json_files.at(rel));
    } catch (const nlohmann::json::exception& e) {
        throw DataError(str((ckpt.dir / rel).string(), " is malformed (", e.what(),
                            "): ", ckpt.json_files.at(rel).dump().substr(0, 300),
                            "; the file is damaged: restore it or resume from an earlier checkpoint"));
    }
}

}  // namespace

void Trainer::load_extras(const LoadedCheckpoint& ckpt) {
    if (ema_) {
        const auto shadows = ckpt.tensor_files.find(
            ema_file(*family_, lora_ ? "ema_model.safetensors" : "diffusion_pytorch_model.safetensors"));
        const std::string ema_state = ema_file(*family_, "ema_state.json");
        if (shadows != ckpt.tensor_files.end() && ckpt.json_files.count(ema_state)) {
            load_json_state(ckpt, ema_state, [&](const nlohmann::json& state) {
                ema_->load(shadows->second, state, ckpt.dir.string());
            });
        } else {
            log::warn() << "checkpoint " << ckpt.dir.string() << " has no EMA state (use_ema was off): the "
                        << "EMA starts from the resumed weights";
            start_ema();
        }
    }
    if (scaler_) {
        if (ckpt.json_files.count(kLossScalerState))
            load_json_state(ckpt, kLossScalerState,
                            [&](const nlohmann::json& state) { scaler_->load_state(state); });
        else
            log::warn() << "checkpoint " << ckpt.dir.string()
                        << " has no loss-scaler state: fp16 loss scaling "
                        << "starts again from scale " << scaler_->scale();
    }
}

void Trainer::write_model_outputs() {
    if (!is_main_process()) return;
    if (lora_) {
        lora_->save(output_dir_ / kLoRAWeightsFile);
        if (ema_) {
            EMAWeightsGuard swap = use_ema_weights();
            lora_->save(output_dir_ / "ema" / kLoRAWeightsFile);
        }
        return;
    }
    EMAWeightsGuard swap = use_ema_weights();  // SimpleTuner exports a full fine-tune's EMA weights
    if (model_dir_.empty()) {
        // No base pipeline to complete the folder (a Trainer built around a bare network).
        const auto dir = output_dir_ / "pipeline" / family_->denoiser_folder();
        std::filesystem::create_directories(dir);
        io::save_safetensors(dir / "diffusion_pytorch_model.safetensors",
                             models::state_dict(model_->module()));
        log::warn() << "no base model folder: wrote only " << dir.string();
        return;
    }
    family_->export_pipeline(model_dir_, model_->module(), output_dir_ / "pipeline", local_vae(config_));
    if (config_.flag("export_single_file"))
        family_->export_single_file(model_dir_, model_->module(), output_dir_ / family_->single_file_name(),
                                    local_vae(config_));
}

}  // namespace dtune::train
