// LoRA / DoRA training for `model_type lora`: the adapter settings from the config, injection into the
// UNet, init_lora, the per-forward dropout seed, and the adapter file written into checkpoints and
// output_dir.
//
// Config keys (SimpleTuner's names, SIMPLETUNER.md §6): lora_rank, lora_alpha (None = rank),
// lora_dropout, lora_init_type (default | gaussian), use_dora, lora_format (diffusers | comfyui),
// init_lora (a diffusers, PEFT or kohya/ComfyUI file), peft_lora_target_modules (a JSON list of
// module-name suffixes, the same list as JSON text, or a path to a JSON file holding it; default
// SDXL's to_k, to_q, to_v, to_out.0; Conv2d names such as conv1 or proj_in give LoCon-style adapters).
//
// Invariants: only the adapter tensors are trainable (the base UNet is frozen); the adapter file
// round-trips bit-exactly (a resumed run continues from exactly the saved factors, with the layers'
// alphas as this run set them); dropout draws one seed per forward (trainer's generator, or the
// device's with CUDA graphs), and only when lora_dropout > 0.
#pragma once

#include <ATen/core/Generator.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "models/adapters/lora.h"
#include "models/adapters/lora_io.h"
#include "train/config.h"

namespace torch::nn {
class Module;
}

namespace dtune::family {
class ModelFamily;
}

namespace dtune::train {

// The file name diffusers' load_lora_weights(dir) looks for; also SimpleTuner's checkpoint file.
inline constexpr const char* kLoRAWeightsFile = "pytorch_lora_weights.safetensors";

// peft_lora_target_modules: null -> `defaults` (the family's); a JSON array of strings; a string holding a
// JSON array; or a path to a JSON file holding one. UsageError naming the value and the accepted forms.
std::vector<std::string> parse_lora_targets(const nlohmann::json& value,
                                            const std::vector<std::string>& defaults);

// The adapter settings of a config (see the file comment).
models::LoRAConfig lora_config_from(const TrainConfig& config, const family::ModelFamily& family);

class LoRATraining {
  public:
    // Injects adapters into `model` (freezing its own parameters; the targets default to the
    // family's) and loads init_lora when set.
    LoRATraining(torch::nn::Module& model, const TrainConfig& config, const family::ModelFamily& family);

    // The trainable adapter tensors under PEFT's names ("<module>.lora_A.weight", ...).
    io::TensorList trainable() const { return adapters_.named_parameters(); }
    // Before each training forward: a fresh dropout seed (no draw without dropout), masks for the
    // global batch of which this rank keeps its rows (see LoRALayer::set_dropout_seed). The seed is
    // drawn from `generator` (the trainer's CPU generator, the same state on every rank), or with
    // `on_device` from the adapters' device's default generator with no host work (the CUDA-graph
    // step: StepOptions::device_rng), so a captured step draws a new seed on every replay.
    // With cast_factors_to(dtype) set, it also refreshes the factors' copies in that dtype
    // (LoRAAdapters::refresh_cast_factors).
    void begin_forward(at::Generator& generator, bool on_device, int rank = 0, int world_size = 1);
    // The compute dtype whose copies of the factors each training forward refreshes and reads
    // (nullopt: none; each layer casts). The trainer sets it where the factors are whole and current
    // at the start of every forward (not under ZeRO-3, nor ZeRO-1/2's sync deferred into the forward).
    void cast_factors_to(std::optional<at::ScalarType> dtype) { cast_dtype_ = dtype; }
    // After the step's backward: no later forward (validation, eval loss) reads the copies.
    void end_step() { adapters_.clear_cast_factors(); }

    // Writes the adapters in the configured lora_format, in their own dtype (lossless).
    void save(const std::filesystem::path& file) const;
    // Loads a file written by save() (resume): the factors exactly, the alphas kept as injected.
    void load_exact(const std::filesystem::path& file);

    models::LoRAAdapters& adapters() { return adapters_; }
    const models::LoRAAdapters& adapters() const { return adapters_; }
    models::LoRAFormat format() const { return format_; }

  private:
    models::LoRAAdapters adapters_;
    models::LoRAFormat format_;
    bool dropout_ = false;
    std::optional<at::ScalarType> cast_dtype_;
    std::string prefix_;  // the diffusers component the file's keys name ("unet", "transformer")
};

}  // namespace dtune::train
