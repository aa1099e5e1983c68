// Quantised frozen weights (see quantize.h).
#include "models/common/quantize.h"

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <sstream>

#include "core/error.h"
#include "core/log.h"
#include "io/safetensors.h"
#include "models/common/layers.h"
#include "models/common/weights.h"

#ifdef DTUNE_WITH_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "models/common/cuda_launch.h"
#include "models/cuda/quantize_kernels.h"
#endif

namespace dtune::models {
namespace {

constexpr double kInt8Max = 127.0;
constexpr double kE4M3Max = 448.0;
constexpr double kFp8GemmMinMacs = 34359738368.0;  // 2^35

bool is_quantized_dtype(at::ScalarType t) {
    return t == at::kChar || t == at::kFloat8_e4m3fn;
}

// The dtype a frozen layer computes in: autocast's for x's device when it is on, else x's.
at::ScalarType compute_dtype(const at::Tensor& x) {
    const auto device = x.device().type();
    return at::autocast::is_autocast_enabled(device) ? at::autocast::get_autocast_dtype(device)
                                                     : x.scalar_type();
}

// The layout a dequantised weight keeps (a channels-last conv weight stays channels-last).
at::MemoryFormat layout_of(const at::Tensor& t) {
    return t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast) && !t.is_contiguous()
               ? at::MemoryFormat::ChannelsLast
               : at::MemoryFormat::Contiguous;
}

#ifdef DTUNE_WITH_CUDA_KERNELS
bool aligned16(const void* p) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// [rows, cols] with rows = size(0): the raw order of a contiguous or channels-last weight.
std::pair<int64_t, int64_t> row_shape(const at::Tensor& t) {
    const int64_t rows = t.size(0);
    return {rows, rows == 0 ? 0 : t.numel() / rows};
}

// Row-major [M, K] → per-row e4m3 values and float32 scales [M, 1] (CUDA kernels only), of x or,
// with `col_scale` ([K] float32), of x · col_scale per column.
std::pair<at::Tensor, at::Tensor> quantize_rows_fp8(const at::Tensor& x2, const at::Tensor& col_scale = {}) {
    const at::Tensor x = x2.contiguous();
    const at::Tensor cs = col_scale.defined() ? col_scale.contiguous() : at::Tensor();
    at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
    at::Tensor s = at::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
    const c10::cuda::CUDAGuard guard(x.device());
    check_launch(
        cuda::quantize_rows_fp8(x.const_data_ptr(), kernel_dtype(x.scalar_type(), "quantize_rows_fp8"),
                                cs.defined() ? cs.const_data_ptr<float>() : nullptr, x.size(0), x.size(1),
                                q.mutable_data_ptr(), s.mutable_data_ptr<float>(), current_stream_of(x)),
        "quantized_linear", "fp8 row quantisation");
    return {q, s};
}

// The smallest GEMM (M·K·N multiply-adds) that runs in fp8: below it the row quantisation and the
// weight transpose cost more than the fp8 tensor cores save, and the weight is dequantised instead
// (measured on an H200 with SDXL's shapes: docs/BENCHMARKS.md). DTUNE_FP8_GEMM_MIN_MACS overrides
// it (0: every eligible GEMM in fp8), for measurements.
double fp8_gemm_min_macs() {
    static const double value = [] {
        const char* env = std::getenv("DTUNE_FP8_GEMM_MIN_MACS");
        return env && *env ? std::strtod(env, nullptr) : kFp8GemmMinMacs;
    }();
    return value;
}

// fp8 GEMMs for a Linear with an fp8 weight `data` [out, in] and M rows of activations: bf16
// compute (_scaled_mm's row-wise scaling writes bf16), every dimension a multiple of 16, and big
// enough to pay.
bool use_fp8_gemm(int64_t m, const at::Tensor& data, const c10::Device& device, at::ScalarType dtype) {
    if (data.scalar_type() != at::kFloat8_e4m3fn || !device.is_cuda() || dtype != at::kBFloat16) return false;
    if (m % 16 != 0 || data.size(0) % 16 != 0 || data.size(1) % 16 != 0) return false;
    if (static_cast<double>(m) * static_cast<double>(data.size(0)) * static_cast<double>(data.size(1)) <
        fp8_gemm_min_macs())
        return false;
    return fp8_gemm_available(device);
}
#endif

#ifdef DTUNE_WITH_CUDA_KERNELS
constexpr int64_t kGemvMaxRows = 8;  // quantize_kernels.h: quantized_gemv

// x [M <= 8, in] · Wᵀ (+ b) straight from the quantised bytes (AdaLN's modulation: one token per
// sample), where the kernel applies; undefined otherwise.
at::Tensor quantized_gemv(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale,
                          const at::Tensor& b, at::ScalarType dtype) {
    const bool kernel_dtype_ok = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
    if (!x.is_cuda() || x.size(0) > kGemvMaxRows || !kernel_dtype_ok || data.size(1) % 16 != 0 ||
        !data.is_contiguous())
        return {};
    const at::Tensor xc = x.contiguous(), s = scale.contiguous(),
                     bc = b.defined() ? b.contiguous() : at::Tensor();
    if (!aligned16(xc.const_data_ptr()) || !aligned16(data.const_data_ptr())) return {};
    at::Tensor y = at::empty({x.size(0), data.size(0)}, xc.options());
    const c10::cuda::CUDAGuard guard(x.device());
    check_launch(
        cuda::quantized_gemv(
            xc.const_data_ptr(), x.size(0), x.size(1), data.const_data_ptr(),
            data.scalar_type() == at::kChar ? cuda::QuantStorage::kInt8 : cuda::QuantStorage::kFloat8E4M3,
            s.const_data_ptr<float>(), bc.defined() ? bc.const_data_ptr() : nullptr, data.size(0),
            y.mutable_data_ptr(), kernel_dtype(dtype, "quantized_gemv"), current_stream_of(x)),
        "quantized_linear", "quantised GEMV");
    return y;
}
#endif

// y [N, out] = x2 [N, in] · Wᵀ (+ bias) without autograd.
at::Tensor linear_forward(const at::Tensor& x2, const at::Tensor& data, const at::Tensor& scale,
                          const at::Tensor& bias, at::ScalarType dtype) {
    const at::Tensor x = x2.to(dtype);
    const at::Tensor b = bias.defined() ? bias.to(dtype) : at::Tensor();
#ifdef DTUNE_WITH_CUDA_KERNELS
    if (at::Tensor y = quantized_gemv(x, data, scale, b, dtype); y.defined()) return y;
    if (use_fp8_gemm(x.size(0), data, x.device(), dtype)) {
        auto [xq, xs] = quantize_rows_fp8(x);
        return at::_scaled_mm(xq, data.t(), xs, scale.view({1, -1}),
                              b.defined() ? std::optional(b) : std::nullopt, std::nullopt, dtype,
                              /*use_fast_accum=*/false);
    }
#endif
    const at::Tensor w = dequantize_weight(data, scale, dtype);
    return b.defined() ? at::addmm(b, x, w.t()) : at::mm(x, w.t());
}

struct Frozen {
    at::Tensor data, scale, bias;
};

// dX [M, in] = g [M, out] · W for W = data · scale. With fp8 GEMMs: the weight's per-row scales
// fold into g's columns before g is quantised per row, so the fp8 weight is used as stored
// (transposed to the column-major operand _scaled_mm wants, a one-byte copy).
at::Tensor linear_input_grad(const at::Tensor& g2, const at::Tensor& data, const at::Tensor& scale,
                             at::ScalarType dtype) {
    const at::Tensor g = g2.to(dtype);
#ifdef DTUNE_WITH_CUDA_KERNELS
    if (use_fp8_gemm(g.size(0), data, g.device(), dtype)) {
        auto [gq, gs] = quantize_rows_fp8(g, scale);
        const at::Tensor wt = transposed_quantized_weight(data);  // [in, out]
        const at::Tensor ones = at::ones({1, data.size(1)}, scale.options());
        return at::_scaled_mm(gq, wt.t(), gs, ones, std::nullopt, std::nullopt, dtype,
                              /*use_fast_accum=*/false);
    }
#endif
    return at::mm(g, dequantize_weight(data, scale, dtype));
}

// Differentiable in x only: saves nothing dense (the quantised weight is re-read in backward).
struct QuantizedLinearFunction : public torch::autograd::Function<QuantizedLinearFunction> {
    static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const Frozen& w) {
        const at::ScalarType ct = compute_dtype(x);
        const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
        const at::Tensor y = linear_forward(x.reshape({-1, x.size(-1)}), w.data, w.scale, w.bias, ct);
        ctx->saved_data["data"] = w.data;
        ctx->saved_data["scale"] = w.scale;
        ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
        ctx->saved_data["x_sizes"] = x.sizes().vec();
        auto sizes = x.sizes().vec();
        sizes.back() = w.data.size(0);
        return y.view(sizes);
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const at::Tensor data = ctx->saved_data["data"].toTensor(),
                         scale = ctx->saved_data["scale"].toTensor();
        const at::Tensor g = grads[0].reshape({-1, data.size(0)});
        const at::Tensor dx = linear_input_grad(g, data, scale, g.scalar_type());
        const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
        return {dx.to(x_dtype).view(ctx->saved_data["x_sizes"].toIntVector()), at::Tensor()};
    }
};

struct ConvGeometry {
    std::vector<int64_t> stride, padding, dilation;
    int64_t groups = 1;
};

struct QuantizedConv2dFunction : public torch::autograd::Function<QuantizedConv2dFunction> {
    static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const Frozen& w,
                              const ConvGeometry& geo) {
        const at::ScalarType ct = compute_dtype(x);
        const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
        const at::Tensor dense = dequantize_weight(w.data, w.scale, ct);
        const at::Tensor y = at::conv2d(x.to(ct), dense, w.bias.defined() ? w.bias.to(ct) : at::Tensor(),
                                        geo.stride, geo.padding, geo.dilation, geo.groups);
        ctx->saved_data["data"] = w.data;
        ctx->saved_data["scale"] = w.scale;
        ctx->saved_data["stride"] = geo.stride;
        ctx->saved_data["padding"] = geo.padding;
        ctx->saved_data["dilation"] = geo.dilation;
        ctx->saved_data["groups"] = geo.groups;
        ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
        ctx->saved_data["x_sizes"] = x.sizes().vec();
        return y;
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        auto& d = ctx->saved_data;
        const at::Tensor data = d["data"].toTensor(), scale = d["scale"].toTensor();
        const at::Tensor& g = grads[0];
        const auto stride = d["stride"].toIntVector(), padding = d["padding"].toIntVector(),
                   dilation = d["dilation"].toIntVector();
        const auto x_sizes = d["x_sizes"].toIntVector();
        const at::Tensor dense = dequantize_weight(data, scale, g.scalar_type());
        // The input gradient is the transposed convolution of g; output_padding restores the input
        // size that the forward's floor division dropped.
        std::vector<int64_t> output_padding(2);
        for (int i = 0; i < 2; ++i) {
            const int64_t k = dilation[i] * (data.size(2 + i) - 1) + 1;
            output_padding[i] = x_sizes[2 + i] - ((g.size(2 + i) - 1) * stride[i] - 2 * padding[i] + k);
        }
        const at::Tensor dx = at::conv_transpose2d(g, dense, {}, stride, padding, output_padding,
                                                   d["groups"].toInt(), dilation);
        return {dx.to(static_cast<at::ScalarType>(d["x_dtype"].toInt())), at::Tensor(), at::Tensor()};
    }
};

void check_frozen_bias(const at::Tensor& bias) {
    DTUNE_CHECK_AS(UsageError, !bias.defined() || !bias.requires_grad(),
                   "a quantised layer's bias cannot be trained (base_model_precision quantises a frozen base "
                   "model: train a LoRA, or set base_model_precision no_change)");
}

template <typename Layer>
void quantize_layer(Layer& layer, QuantFormat format, QuantizeReport& report) {
    const at::Tensor dense = layer.weight;
    report.bytes_before += dense.numel() * static_cast<int64_t>(dense.element_size());
    QuantizedWeight q = quantize_weight(dense.detach(), format);
    report.bytes_after += q.data.numel() * static_cast<int64_t>(q.data.element_size()) +
                          q.scale.numel() * static_cast<int64_t>(q.scale.element_size());
    // The parameter keeps its name and identity (adapters hold it) and takes the quantised values,
    // frozen; the dense storage is released here. The scales become a buffer beside it.
    layer.dense_dtype = dense.scalar_type();
    layer.weight.set_requires_grad(false);
    layer.weight.set_data(q.data);
    layer.weight_scale = layer.register_buffer("weight_scale", q.scale);
    if (layer.bias.defined()) layer.bias.set_requires_grad(false);
    ++report.layers;
}

std::string gib(int64_t bytes) {
    std::ostringstream os;
    os.setf(std::ios::fixed);
    os.precision(2);
    const double mib = static_cast<double>(bytes) / (1024.0 * 1024.0);
    if (mib < 1024.0) {
        os << mib << " MiB";
    } else {
        os << mib / 1024.0 << " GiB";
    }
    return os.str();
}

}  // namespace

QuantizedWeight quantize_weight(const at::Tensor& weight, QuantFormat format) {
    DTUNE_CHECK_AS(UsageError, format != QuantFormat::kNone, "quantize_weight: no format given");
    DTUNE_CHECK_AS(UsageError, weight.dim() >= 2 && at::isFloatingType(weight.scalar_type()),
                   "quantize_weight: a floating weight with an output-channel dim is required, got ",
                   weight.sizes(), " ", weight.scalar_type());
    const at::NoGradGuard no_grad;
    const at::MemoryFormat format_in = layout_of(weight);
    const at::Tensor w = weight.to(at::kFloat);
    std::vector<int64_t> view(static_cast<size_t>(weight.dim()), 1);
    view[0] = -1;
    const at::Tensor amax = w.abs().amax(
        std::vector<int64_t>(weight.dim() == 2 ? std::vector<int64_t>{1} : std::vector<int64_t>{1, 2, 3}));
    const double qmax = format == QuantFormat::kInt8 ? kInt8Max : kE4M3Max;
    // An all-zero row keeps scale 1 (its values quantise to 0 either way).
    // amax / qmax as a tensor division: CUDA divides by a scalar as a multiply by its reciprocal,
    // which would give other scales on the GPU than on the CPU (and than quanto's).
    const at::Tensor scale =
        at::where(amax > 0, amax / at::full_like(amax, qmax), at::ones_like(amax)).contiguous();
    const at::Tensor scaled = w / scale.view(view);
    at::Tensor data = format == QuantFormat::kInt8 ? scaled.round().clamp(-128, 127).to(at::kChar)
                                                   : scaled.clamp(-kE4M3Max, kE4M3Max).to(at::kFloat8_e4m3fn);
    return {data.contiguous(format_in), scale};
}

at::Tensor dequantize_weight(const at::Tensor& data, const at::Tensor& scale, at::ScalarType dtype) {
    DTUNE_CHECK_AS(UsageError, is_quantized_dtype(data.scalar_type()) && scale.scalar_type() == at::kFloat,
                   "dequantize_weight: int8/float8_e4m3fn data with float32 scales expected, got ",
                   data.scalar_type(), " and ", scale.scalar_type());
#ifdef DTUNE_WITH_CUDA_KERNELS
    const auto [rows, cols] = row_shape(data);
    const bool kernel_dtype_ok = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
    if (data.is_cuda() && rows <= 65535 && kernel_dtype_ok) {
        const at::MemoryFormat format = layout_of(data);
        const at::Tensor q = data.contiguous(format), s = scale.contiguous();
        at::Tensor out = at::empty_like(q, q.options().dtype(dtype), format);
        const c10::cuda::CUDAGuard guard(q.device());
        check_launch(cuda::dequantize_rows(q.const_data_ptr(),
                                           q.scalar_type() == at::kChar ? cuda::QuantStorage::kInt8
                                                                        : cuda::QuantStorage::kFloat8E4M3,
                                           s.const_data_ptr<float>(), rows, cols, out.mutable_data_ptr(),
                                           kernel_dtype(dtype, "dequantize_weight"), current_stream_of(q)),
                     "dequantize_weight", "dequantise");
        return out;
    }
#endif
    std::vector<int64_t> view(static_cast<size_t>(data.dim()), 1);
    view[0] = -1;
    return data.to(at::kFloat).mul_(scale.view(view)).to(dtype);
}

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale,
                            const at::Tensor& bias) {
    check_frozen_bias(bias);
    return QuantizedLinearFunction::apply(x, Frozen{data, scale, bias});
}

at::Tensor quantized_linear_no_grad(const at::Tensor& x2, const at::Tensor& data, const at::Tensor& scale,
                                    const at::Tensor& bias, at::ScalarType dtype) {
    return linear_forward(x2, data, scale, bias, dtype);
}

at::Tensor quantized_linear_input_grad(const at::Tensor& g2, const at::Tensor& data, const at::Tensor& scale,
                                       at::ScalarType dtype) {
    return linear_input_grad(g2, data, scale, dtype);
}

at::Tensor quantized_conv2d(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale,
                            const at::Tensor& bias, at::IntArrayRef stride, at::IntArrayRef padding,
                            at::IntArrayRef dilation, int64_t groups) {
    check_frozen_bias(bias);
    return QuantizedConv2dFunction::apply(x, Frozen{data, scale, bias},
                                          ConvGeometry{stride.vec(), padding.vec(), dilation.vec(), groups});
}

at::Tensor transposed_quantized_weight(const at::Tensor& data) {
    DTUNE_CHECK_AS(UsageError, data.dim() == 2 && data.element_size() == 1,
                   "transposed_quantized_weight: a 2-D one-byte weight expected, got ", data.sizes(), " ",
                   data.scalar_type());
#ifdef DTUNE_WITH_CUDA_KERNELS
    const at::Tensor d = data.contiguous();
    const int64_t rows = d.size(0), cols = d.size(1);
    at::Tensor out = at::empty({cols, rows}, d.options());
    if (d.is_cuda() && rows % 16 == 0 && cols % 16 == 0 && aligned16(d.const_data_ptr()) &&
        aligned16(out.const_data_ptr()) && rows / 64 < 65535) {
        const c10::cuda::CUDAGuard guard(d.device());
        check_launch(cuda::transpose_bytes(d.const_data_ptr(), rows, cols, out.mutable_data_ptr(),
                                           current_stream_of(d)),
                     "transposed_quantized_weight", "byte transpose");
        return out;
    }
#endif
    return data.t().contiguous();
}

bool fp8_gemm_available(const c10::Device& device) {
#ifdef DTUNE_WITH_CUDA_KERNELS
    if (!device.is_cuda()) return false;
    const auto* props =
        at::cuda::getDeviceProperties(device.has_index() ? device.index() : at::cuda::current_device());
    return props->major > 8 || (props->major == 8 && props->minor >= 9);
#else
    (void)device;
    return false;
#endif
}

QuantizeReport quantize_module(torch::nn::Module& module, const QuantPreset& preset) {
    QuantizeReport report;
    if (!preset.active()) return report;
    const auto visit = [&](torch::nn::Module& m) {
        if (auto* linear = m.as<LinearImpl>()) {
            if (linear->weight_scale.defined()) return;
            const bool fits = !preset.dims_multiple_of_16 ||
                              (linear->weight.size(0) % 16 == 0 && linear->weight.size(1) % 16 == 0);
            if (fits) {
                quantize_layer(*linear, preset.format, report);
            } else {
                ++report.skipped;
            }
        } else if (auto* conv = m.as<Conv2dImpl>()) {
            if (conv->weight_scale.defined()) return;
            if (preset.convolutions) {
                quantize_layer(*conv, preset.format, report);
            } else {
                ++report.skipped;
            }
        }
    };
    // The root itself (which may live on the stack), then every descendant.
    visit(module);
    for (const auto& m : module.modules(/*include_self=*/false)) visit(*m);
    return report;
}

namespace {

constexpr const char* kPresetKey = "dtune_quantized";
constexpr const char* kSourceKey = "dtune_quantized_source";

// Every Linear and Conv2d under `module` by its full name.
template <typename Fn>
void for_each_layer(torch::nn::Module& module, Fn&& fn) {
    for (const auto& item : module.named_modules("", /*include_self=*/false)) {
        if (auto* linear = item.value()->as<LinearImpl>())
            fn(item.key(), linear->weight, linear->weight_scale, linear->dense_dtype, *linear);
        else if (auto* conv = item.value()->as<Conv2dImpl>())
            fn(item.key(), conv->weight, conv->weight_scale, conv->dense_dtype, *conv);
    }
}

}  // namespace

void save_quantized(const torch::nn::Module& module, const std::filesystem::path& file,
                    const QuantPreset& preset, const std::string& source) {
    std::filesystem::create_directories(file.parent_path());
    io::save_safetensors(file, state_dict(module), {{kPresetKey, preset.name}, {kSourceKey, source}});
}

bool quantized_file_matches(const std::filesystem::path& file, const QuantPreset& preset,
                            const std::string& source) {
    if (!std::filesystem::is_regular_file(file)) return false;
    try {
        const io::SafetensorsFile f(file);
        const auto& m = f.metadata();
        const auto p = m.find(kPresetKey), s = m.find(kSourceKey);
        return p != m.end() && s != m.end() && p->second == preset.name && s->second == source;
    } catch (const std::exception& e) {
        log::warn() << "quantized_model_cache: " << file.string() << " cannot be read (" << e.what()
                    << "); quantising again and replacing it";
        return false;
    }
}

QuantizeReport load_quantized(torch::nn::Module& module, const std::filesystem::path& file,
                              c10::Device device, at::ScalarType dense_dtype) {
    const io::WeightSource source = io::WeightSource::open(file);
    const std::vector<std::string> keys = source.keys();  // sorted
    const auto has = [&](const std::string& k) { return std::binary_search(keys.begin(), keys.end(), k); };
    QuantizeReport report;
    const at::NoGradGuard no_grad;
    for_each_layer(module, [&](const std::string& name, at::Tensor& weight, at::Tensor& scale,
                               at::ScalarType& dense, torch::nn::Module& layer) {
        const std::string key = name + ".weight";
        if (!has(name + ".weight_scale") || !has(key)) return;
        const at::ScalarType stored = io::to_torch_dtype(source.info(key).dtype);
        DTUNE_CHECK_AS(DataError, is_quantized_dtype(stored), file.string(), ": ", key, " is ", stored,
                       " beside a weight_scale; a quantised weight is int8 or float8_e4m3fn. Delete the file "
                       "(quantized_model_cache) to quantise again");
        dense = dense_dtype;
        for (auto& p : layer.named_parameters(/*recurse=*/false))
            if (p.key() == "bias")
                p.value().set_requires_grad(false);  // frozen, as quantize_module leaves it
        weight.set_requires_grad(false);
        weight.set_data(at::empty(weight.sizes(), weight.options().dtype(stored).device(device)));
        scale = layer.register_buffer(
            "weight_scale", at::empty({weight.size(0)}, at::TensorOptions(device).dtype(at::kFloat)));
        ++report.layers;
        report.bytes_after +=
            weight.numel() * static_cast<int64_t>(weight.element_size()) + weight.size(0) * 4;
        report.bytes_before += weight.numel() * static_cast<int64_t>(c10::elementSize(dense_dtype));
    });
    // No dtype or device: the tensors are copied into the module's own (quantised ones included),
    // which the caller built where they belong (a conversion afterwards would cast the int8 weights).
    const LoadOptions options;
    load_weights(module, source, options, str("quantised model ", file.string()));
    return report;
}

std::string describe(const QuantizeReport& report, const QuantPreset& preset) {
    std::ostringstream os;
    os << preset.name << ": " << report.layers << " layers quantised, weights " << gib(report.bytes_before)
       << " -> " << gib(report.bytes_after);
    if (report.skipped > 0) os << " (" << report.skipped << " Linear/Conv2d layers left dense by the preset)";
    return os.str();
}

}  // namespace dtune::models
