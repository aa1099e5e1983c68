// Training checkpoints: `<output_dir>/checkpoint-<step>/` with the trained weights, optimizer state,
// RNG states, the batch source's state, the resolved config and a manifest (SIMPLETUNER.md §7.1).
//
// Invariants: a checkpoint is written into `checkpoint-<step>-tmp`, renamed into place, and only then
// gets its `.guard` file (content "complete", written atomically): a directory without a guard, or
// missing a file its manifest lists, is incomplete and never resumed from. Deleting a checkpoint
// removes its guard first (then the rest), so a deletion cut short leaves an incomplete directory,
// never a "complete" one without its weights. Rotation deletes the oldest complete checkpoints
// beyond the limit, and incomplete ones older than the newest complete (and stale -tmp folders).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"

namespace dtune::train {

namespace stdfs = std::filesystem;

struct CheckpointContents {
    int64_t global_step = 0;
    // Relative path (inside the checkpoint) -> tensors: the trained weights, e.g.
    // "unet/diffusion_pytorch_model.safetensors", and "optimizer.safetensors".
    std::map<std::string, io::TensorList> tensor_files;
    // Relative path -> JSON: "training_state.json" (step, epoch, batch source), the resolved config.
    std::map<std::string, nlohmann::json> json_files;
    // Relative path -> a function that writes that file (formats with their own keys and metadata,
    // e.g. "pytorch_lora_weights.safetensors"); listed in the manifest like the others.
    std::map<std::string, std::function<void(const stdfs::path&)>> file_writers;
    // RNG states as uint8 tensors ("cpu", "cuda:0", ...), saved as random_states.safetensors.
    std::map<std::string, at::Tensor> rng_states;
    nlohmann::json metadata;  // model_family, model_type, ... for the manifest
    // Data parallelism: called with the temporary directory once this process's files are in it
    // and before the manifest is written; it returns when the other ranks have written their own
    // files (`shard_files`, relative paths), which the manifest then lists.
    std::function<void(const stdfs::path& tmp_dir)> write_shards;
    std::vector<std::string> shard_files;
};

struct LoadedCheckpoint {
    stdfs::path dir;
    int64_t global_step = 0;
    std::map<std::string, io::TensorList> tensor_files;  // every *.safetensors listed in the manifest
    std::map<std::string, nlohmann::json> json_files;    // every *.json listed in the manifest
    std::map<std::string, at::Tensor> rng_states;
};

// `<output_dir>/checkpoint-<step>-tmp`: where a checkpoint is assembled before it is renamed.
stdfs::path checkpoint_tmp_dir(const stdfs::path& output_dir, int64_t global_step);

// Writes the checkpoint (replacing an existing one of the same step) and returns its directory.
stdfs::path save_checkpoint(const stdfs::path& output_dir, const CheckpointContents& contents);

// "" when `dir` is a complete checkpoint, else why not (no guard, a listed file missing, ...).
std::string checkpoint_problem(const stdfs::path& dir);

// Checkpoint directories `checkpoint-<N>` of output_dir (no -tmp), by step ascending.
std::vector<std::pair<int64_t, stdfs::path>> list_checkpoints(const stdfs::path& output_dir);

// resume_from_checkpoint: "latest" -> the newest complete checkpoint (incomplete newer ones are
// skipped with a warning saying why), nullopt if there is none; "" / "none" -> nullopt; a path -> it
// if complete, else a warning and the newest complete checkpoint older than it, else UsageError.
std::optional<stdfs::path> resolve_resume_checkpoint(const stdfs::path& output_dir, const std::string& spec);

// Loads every file the manifest lists. Since the manifest also lists each .safetensors file's
// tensor names, a tensor missing from a file is a DataError naming the file and the tensor.
LoadedCheckpoint load_checkpoint(const stdfs::path& dir);

// A field of a checkpoint's JSON file `file` (training_state.json, ...), or a DataError naming the
// file and the field (missing, or not an integer) instead of the JSON library's bare type error.
const nlohmann::json& json_field(const nlohmann::json& j, const std::string& field, const stdfs::path& file);
int64_t json_integer(const nlohmann::json& j, const std::string& field, const stdfs::path& file);

// A saved tensor about to replace the model's `model` in a resume: DataError naming `file` and
// `name` unless its shape and dtype are the model's (a different shape would broadcast into the
// weight, a different dtype would round it: neither resumes the run that was saved).
void check_resumed_tensor(const stdfs::path& file, const std::string& name, const at::Tensor& saved,
                          const at::Tensor& model);

// Keeps the newest `limit` complete checkpoints (limit <= 0: keep all), and deletes leftovers of
// interrupted saves and removals: incomplete checkpoints older than the newest complete one and
// `checkpoint-<N>-tmp` folders. Every removal deletes the guard first. Rank 0 only, after a save.
void rotate_checkpoints(const stdfs::path& output_dir, int64_t limit);

// The CPU generator's state as a tensor and back (CUDA generators when present: "cuda:N").
std::map<std::string, at::Tensor> capture_rng_states(const at::Generator& cpu_generator);
void restore_rng_states(const std::map<std::string, at::Tensor>& states, at::Generator& cpu_generator);

}  // namespace dtune::train
