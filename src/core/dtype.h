// dtype and device policy: names users type ("bf16", "float32", "cuda:1") to libtorch types,
// and what --mixed_precision means for the weights and the compute.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <string>
#include <string_view>

namespace dtune {

// SimpleTuner's --mixed_precision: "bf16", "fp16" or "no" (full fp32).
enum class MixedPrecision { kNo, kBF16, kFP16 };

// Accepts "no", "fp32", "bf16", "fp16" (case-insensitive). UsageError names the value otherwise.
MixedPrecision parse_mixed_precision(std::string_view text);
std::string to_string(MixedPrecision mp);
// The dtype matmuls and convolutions run in.
c10::ScalarType compute_dtype(MixedPrecision mp);
// Trainable parameters keep fp32 master copies unless the optimizer does stochastic rounding.
c10::ScalarType master_dtype(MixedPrecision mp, bool stochastic_rounding);

// "float32"/"fp32"/"f32", "bfloat16"/"bf16", "float16"/"fp16"/"half", "float64", "int64", ...
c10::ScalarType parse_dtype(std::string_view text);
// Short name used in logs and file metadata: "fp32", "bf16", "fp16", ...
std::string dtype_name(c10::ScalarType dtype);

// "cpu", "cuda", "cuda:1", "auto" (CUDA when available, else CPU).
c10::Device parse_device(std::string_view text);
bool cuda_available();
int cuda_device_count();

}  // namespace dtune
