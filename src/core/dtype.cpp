// dtype/device policy implementation.
#include "core/dtype.h"

#include <ATen/Context.h>
#include <c10/core/DeviceType.h>

#include <algorithm>
#include <cctype>

#include "core/error.h"

namespace dtune {
namespace {

std::string lower(std::string_view text) {
    std::string out(text);
    std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
    return out;
}

}  // namespace

MixedPrecision parse_mixed_precision(std::string_view text) {
    const std::string t = lower(text);
    if (t == "no" || t == "fp32" || t == "none") return MixedPrecision::kNo;
    if (t == "bf16") return MixedPrecision::kBF16;
    if (t == "fp16") return MixedPrecision::kFP16;
    throw UsageError(str("mixed_precision '", text, "' is not one of bf16, fp16, no; ",
                         "use bf16 on Ampere or newer GPUs, no for full fp32"));
}

std::string to_string(MixedPrecision mp) {
    switch (mp) {
        case MixedPrecision::kNo: return "no";
        case MixedPrecision::kBF16: return "bf16";
        case MixedPrecision::kFP16: return "fp16";
    }
    return "?";
}

c10::ScalarType compute_dtype(MixedPrecision mp) {
    switch (mp) {
        case MixedPrecision::kBF16: return c10::kBFloat16;
        case MixedPrecision::kFP16: return c10::kHalf;
        case MixedPrecision::kNo: break;
    }
    return c10::kFloat;
}

c10::ScalarType master_dtype(MixedPrecision mp, bool stochastic_rounding) {
    if (stochastic_rounding && mp == MixedPrecision::kBF16) return c10::kBFloat16;
    return c10::kFloat;
}

c10::ScalarType parse_dtype(std::string_view text) {
    const std::string t = lower(text);
    if (t == "float32" || t == "fp32" || t == "f32" || t == "float") return c10::kFloat;
    if (t == "bfloat16" || t == "bf16") return c10::kBFloat16;
    if (t == "float16" || t == "fp16" || t == "f16" || t == "half") return c10::kHalf;
    if (t == "float64" || t == "fp64" || t == "f64" || t == "double") return c10::kDouble;
    if (t == "int64" || t == "i64" || t == "long") return c10::kLong;
    if (t == "int32" || t == "i32" || t == "int") return c10::kInt;
    if (t == "uint8" || t == "u8") return c10::kByte;
    if (t == "bool") return c10::kBool;
    throw UsageError(
        str("dtype '", text, "' is not known; use one of fp32, bf16, fp16, fp64, int64, int32, uint8, bool"));
}

std::string dtype_name(c10::ScalarType dtype) {
    switch (dtype) {
        case c10::kFloat: return "fp32";
        case c10::kBFloat16: return "bf16";
        case c10::kHalf: return "fp16";
        case c10::kDouble: return "fp64";
        case c10::kLong: return "int64";
        case c10::kInt: return "int32";
        case c10::kShort: return "int16";
        case c10::kChar: return "int8";
        case c10::kByte: return "uint8";
        case c10::kBool: return "bool";
        case c10::ScalarType::Float8_e4m3fn: return "f8_e4m3";
        case c10::ScalarType::Float8_e5m2: return "f8_e5m2";
        default: return c10::toString(dtype);
    }
}

bool cuda_available() {
    return at::hasCUDA() && cuda_device_count() > 0;
}

int cuda_device_count() {
    if (!at::hasCUDA()) return 0;
    return static_cast<int>(at::getNumGPUs());
}

c10::Device parse_device(std::string_view text) {
    const std::string t = lower(text);
    if (t == "auto") return cuda_available() ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
    if (t == "cpu") return c10::Device(c10::kCPU);
    if (t == "cuda" || t.rfind("cuda:", 0) == 0) {
        DTUNE_CHECK_AS(UsageError, cuda_available(), "device '", text,
                       "' asked for CUDA but this build or machine has no CUDA device; use --device cpu");
        if (t == "cuda") return c10::Device(c10::kCUDA, 0);
        // Parsed here rather than by c10::Device, whose 8-bit index wraps large numbers around.
        const std::string digits = t.substr(5);
        const bool numeric =
            !digits.empty() && digits.size() <= 3 &&
            std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c); });
        const int index = numeric ? std::stoi(digits) : -1;
        DTUNE_CHECK_AS(UsageError, numeric && index < cuda_device_count(), "device '", text,
                       "' does not exist: this machine has ", cuda_device_count(),
                       " CUDA device(s), cuda:0 to cuda:", cuda_device_count() - 1);
        return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
    }
    throw UsageError(str("device '", text, "' is not understood; use cpu, cuda, cuda:<index> or auto"));
}

}  // namespace dtune
