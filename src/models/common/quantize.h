// Quantised frozen weights: SimpleTuner's `base_model_precision` / `text_encoder_N_precision`
// presets for the Linear and Conv2d layers of a frozen model (a LoRA/DoRA base, a text encoder, a
// sampling model).
//
// Storage: one scale per output channel (dim 0), symmetric, no zero point, as quanto's qint8 and
// qfloat8 weights:
// - int8: q = round(w / s) clamped to [-127, 127], s = max|w| / 127;
// - fp8 (e4m3fn): q = fp8(w / s), s = max|w| / 448 (448 is e4m3fn's largest finite value).
// The layer's `weight` holds q (int8 or float8_e4m3fn, same shape) and `weight_scale` holds s
// (float32, [out]); weight = q · s. An all-zero row gets s = 1.
//
// Compute: the weight is dequantised one layer at a time, just before its GEMM or convolution, into
// a transient tensor in the compute dtype, and dequantised again in backward (nothing dequantised is
// saved for backward, so the model never holds a dense copy). On CUDA that is one kernel
// (models/cuda/quantize_kernels.cu). fp8 weights on a GPU with fp8 tensor cores (compute capability
// 8.9 and up) run their Linear as fp8 GEMMs instead (bf16 compute, dimensions multiples of 16):
// forward, the activation is quantised per row to e4m3 on the fly and at::_scaled_mm multiplies
// with both row scales (torchao's dynamic-activation recipe with per-row scales); backward, the
// output gradient times the weight's scales is quantised per row the same way and multiplied with
// the stored fp8 weight (torchao's row-wise float8 training recipe: e4m3 throughout).
//
// Gradients flow to the layer's input only: a quantised weight and its bias are frozen.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "core/quant_preset.h"

namespace dtune::models {

// QuantFormat, QuantPreset and parse_quant_preset: core/quant_preset.h.

struct QuantizedWeight {
    at::Tensor data;   // int8 or float8_e4m3fn, shaped like the weight
    at::Tensor scale;  // float32 [out]
};

// Quantises a dense weight (any float dtype, dim 0 = output channels) on its own device.
QuantizedWeight quantize_weight(const at::Tensor& weight, QuantFormat format);

// q · s in `dtype` (computed in float32, rounded once), shaped like `data`.
at::Tensor dequantize_weight(const at::Tensor& data, const at::Tensor& scale, at::ScalarType dtype);

// x·Wᵀ + bias for W = data · scale, differentiable in x. Computes in the autocast dtype when
// autocast is on for x's device, else in x's dtype; `bias` must not require grad.
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale,
                            const at::Tensor& bias);
// The same without autograd (for callers with their own backward), computing in `dtype`:
// x2 is [N, in]; the fp8 GEMM is used where it applies.
at::Tensor quantized_linear_no_grad(const at::Tensor& x2, const at::Tensor& data, const at::Tensor& scale,
                                    const at::Tensor& bias, at::ScalarType dtype);
// Its input gradient: g2 [N, out] · W -> [N, in] in `dtype` (the fp8 GEMM where it applies).
at::Tensor quantized_linear_input_grad(const at::Tensor& g2, const at::Tensor& data, const at::Tensor& scale,
                                       at::ScalarType dtype);

// dataᵀ as a new contiguous [in, out] tensor of the same one-byte dtype: the operand layout the fp8
// input-gradient GEMM reads. On CUDA a tiled kernel where both sizes are multiples of 16 (ATen's
// copy of a transposed fp8 view is an element-wise, uncoalesced pass: 37 ms of a Flux LoRA step on
// an H200); elsewhere ATen's copy.
at::Tensor transposed_quantized_weight(const at::Tensor& data);

// conv2d(x, W) + bias for W = data · scale, differentiable in x (zero padding).
at::Tensor quantized_conv2d(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale,
                            const at::Tensor& bias, at::IntArrayRef stride, at::IntArrayRef padding,
                            at::IntArrayRef dilation, int64_t groups);

// True when fp8 Linear forwards on `device` run as fp8 GEMMs (CUDA, compute capability >= 8.9,
// built with CUDA).
bool fp8_gemm_available(const c10::Device& device);

struct QuantizeReport {
    int64_t layers = 0;        // layers quantised
    int64_t skipped = 0;       // Linear/Conv2d layers the preset leaves dense
    int64_t bytes_before = 0;  // the quantised layers' weights before
    int64_t bytes_after = 0;   // ... and after (data + scales)
};

// Quantises every Linear and Conv2d weight under `module` that `preset` covers (see QuantPreset),
// in place, one layer at a time on the weights' device (the dense weight of a layer is freed as soon
// as its quantised copy exists). Weights become frozen buffers; biases are frozen. Layers already
// quantised are left alone. A preset that is not active returns an empty report.
QuantizeReport quantize_module(torch::nn::Module& module, const QuantPreset& preset);

// A quantised model on disk (quantized_model_cache): every tensor of `module` as it is in memory
// (quantised weights as stored, their scales, the other tensors dense) in one safetensors file,
// written atomically; its metadata names the preset and `source` (what the weights came from).
void save_quantized(const torch::nn::Module& module, const std::filesystem::path& file,
                    const QuantPreset& preset, const std::string& source);
// True when `file` exists and save_quantized wrote it for `preset` and `source` (its header is
// read, not its tensors; a damaged file fails later, in load_quantized, naming itself).
bool quantized_file_matches(const std::filesystem::path& file, const QuantPreset& preset,
                            const std::string& source);
// Loads a save_quantized file into a module just built with the same architecture (its tensors may
// be uninitialised): each Linear/Conv2d the file holds quantised gets its stored values and scales,
// every other tensor its dense values (strict: missing, unexpected or misshapen tensors are a
// DataError naming the file). `dense_dtype` is the quantised layers' compute dtype.
QuantizeReport load_quantized(torch::nn::Module& module, const std::filesystem::path& file,
                              c10::Device device, at::ScalarType dense_dtype);

// "int8-quanto: 794 layers, 4.78 GiB -> 2.40 GiB" for logs.
std::string describe(const QuantizeReport& report, const QuantPreset& preset);

}  // namespace dtune::models
