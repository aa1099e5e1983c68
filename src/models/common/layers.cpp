// Layers with optional uninitialised construction (see layers.h).
#include "models/common/layers.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <cmath>

#include "core/error.h"
#include "models/common/quantize.h"

namespace dtune::models {
namespace {

thread_local std::optional<at::TensorOptions> g_target;

// A parameter tensor for a layer under construction and whether the caller must initialise it.
std::pair<at::Tensor, bool> allocate(at::IntArrayRef shape) {
    if (g_target) return {at::empty(shape, *g_target), false};
    return {at::empty(shape, at::TensorOptions().dtype(at::kFloat)), true};
}

// torch::nn's Linear/Conv init: kaiming-uniform weight (a = √5), bias U(-1/√fan_in, 1/√fan_in).
void init_weight_and_bias(at::Tensor& weight, at::Tensor& bias) {
    torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
    if (bias.defined()) {
        const auto fan_in = std::get<0>(torch::nn::init::_calculate_fan_in_and_fan_out(weight));
        const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
        torch::nn::init::uniform_(bias, -bound, bound);
    }
}

}  // namespace

UninitializedParameters::UninitializedParameters(c10::ScalarType dtype, c10::Device device)
    : previous_(g_target) {
    g_target = at::TensorOptions().dtype(dtype).device(device);
}

UninitializedParameters::~UninitializedParameters() {
    g_target = previous_;
}

std::optional<at::TensorOptions> UninitializedParameters::current() {
    return g_target;
}

LinearImpl::LinearImpl(const torch::nn::LinearOptions& o) : options(o) {
    auto [w, init] = allocate({o.out_features(), o.in_features()});
    weight = register_parameter("weight", w);
    if (o.bias()) bias = register_parameter("bias", allocate({o.out_features()}).first);
    if (init) init_weight_and_bias(weight, bias);
}

at::Tensor LinearImpl::forward(const at::Tensor& x) {
    if (weight_scale.defined()) return quantized_linear(x, weight, weight_scale, bias);
    return at::linear(x, weight, bias);
}

Conv2dImpl::Conv2dImpl(const torch::nn::Conv2dOptions& o) : options(o) {
    DTUNE_CHECK_AS(UsageError,
                   std::holds_alternative<torch::ExpandingArray<2>>(o.padding()) &&
                       std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode()),
                   "dtune's Conv2d supports numeric zero padding only (no 'same'/'valid' or reflect/"
                   "replicate/circular padding)");
    const auto& k = *o.kernel_size();
    auto [w, init] = allocate({o.out_channels(), o.in_channels() / o.groups(), k[0], k[1]});
    weight = register_parameter("weight", w);
    if (o.bias()) bias = register_parameter("bias", allocate({o.out_channels()}).first);
    if (init) init_weight_and_bias(weight, bias);
}

at::Tensor Conv2dImpl::forward(const at::Tensor& x) {
    const auto& padding = std::get<torch::ExpandingArray<2>>(options.padding());
    if (weight_scale.defined())
        return quantized_conv2d(x, weight, weight_scale, bias, *options.stride(), *padding,
                                *options.dilation(), options.groups());
    return at::conv2d(x, weight, bias, *options.stride(), *padding, *options.dilation(), options.groups());
}

at::Tensor Conv2dImpl::forward_without_bias(const at::Tensor& x) {
    const auto& padding = std::get<torch::ExpandingArray<2>>(options.padding());
    if (weight_scale.defined())
        return quantized_conv2d(x, weight, weight_scale, {}, *options.stride(), *padding, *options.dilation(),
                                options.groups());
    return at::conv2d(x, weight, {}, *options.stride(), *padding, *options.dilation(), options.groups());
}

EmbeddingImpl::EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim) {
    auto [w, init] = allocate({num_embeddings, embedding_dim});
    weight = register_parameter("weight", w);
    if (init) torch::nn::init::normal_(weight);
}

at::Tensor EmbeddingImpl::forward(const at::Tensor& ids) {
    return at::embedding(weight, ids);
}

at::Tensor dense_weight(const at::Tensor& weight, const at::Tensor& weight_scale, at::ScalarType dtype) {
    return weight_scale.defined() ? dequantize_weight(weight, weight_scale, dtype) : weight.to(dtype);
}

}  // namespace dtune::models
