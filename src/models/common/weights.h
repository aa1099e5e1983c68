// Loading and saving torch::nn module weights by name.
//
// Module trees mirror diffusers' naming, so a checkpoint key like
// "down_blocks.1.attentions.0.proj_in.weight" is the module's own parameter name and loading is
// a name-for-name copy. Loading is strict by default: missing or unexpected keys, or a shape
// mismatch, throw DataError listing (up to 20 of) them; so does a tensor holding a NaN or an
// infinity (such weights only ever produce NaN outputs, e.g. a black image). Tensors are converted to the
// requested dtype/device straight from the memory-mapped file into the module's tensors (one copy), and the
// file's pages are released from this process as soon as a tensor is copied (the page cache keeps
// them), so peak resident memory is the model plus one tensor, not the model plus the file.
// Modules built inside an UninitializedParameters scope (layers.h) already have their large
// parameters in the target dtype/device, so nothing is converted twice.
#pragma once

#include <torch/nn/module.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "io/safetensors.h"

namespace dtune::models {

struct LoadOptions {
    // Only keys starting with `prefix` are considered; the prefix is stripped before matching
    // (e.g. "model.diffusion_model." for a single-file checkpoint's UNet).
    std::string prefix;
    // Maps a checkpoint key (after the prefix is stripped) to the module's name; empty = identity.
    // Returning "" drops the key.
    std::function<std::string(const std::string&)> rename;
    bool strict = true;                    // missing/unexpected keys are an error
    std::optional<c10::ScalarType> dtype;  // convert floating tensors; nullopt keeps the module's
    std::optional<c10::Device> device;
};

struct LoadReport {
    std::vector<std::string> missing;     // in the module, not in the checkpoint
    std::vector<std::string> unexpected;  // in the checkpoint, not in the module
    std::size_t loaded = 0;
};

// Copies parameters and buffers from `source` into `module`. `what` names the component in errors
// ("UNet from /models/sdxl/unet").
LoadReport load_weights(torch::nn::Module& module, const io::WeightSource& source, const LoadOptions& options,
                        const std::string& what);

// The same from tensors already in memory (e.g. a single-file checkpoint's component after its key
// dialect was mapped, see io/ldm_keys.h). `from` names their origin in errors. When the tensors
// are views of `backing`'s files, their pages are released after each copy (as above).
LoadReport load_weights(torch::nn::Module& module, const io::TensorList& tensors, const LoadOptions& options,
                        const std::string& what, const std::string& from,
                        const io::WeightSource* backing = nullptr);

// The index of the first floating tensor of `tensors` that holds a NaN or an infinity, or -1: one
// isfinite reduction per tensor on its own device and a single read-back for all of them.
int64_t first_non_finite(const std::vector<at::Tensor>& tensors);

// All parameters and buffers by their full names, for saving.
io::TensorList state_dict(const torch::nn::Module& module);

}  // namespace dtune::models
