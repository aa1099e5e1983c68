// Linear, Conv2d and Embedding layers that can be built without initialising their weights, and
// the scope that asks for it.
//
// Why not torch::nn's: their constructors always allocate float32 on the CPU and run the random
// init, so loading a full SDXL (3.5 B parameters) would first fill ~14 GB of fp32 tensors with
// random numbers only to overwrite them. Inside an UninitializedParameters scope these layers
// allocate their parameters with at::empty directly in the scope's dtype and on its device and
// skip the init: on the CPU untouched pages cost no resident memory, and the loader then writes
// each tensor once, from the memory-mapped checkpoint. Outside a scope they behave exactly like
// torch::nn::Linear / Conv2d / Embedding (float32 CPU, the same init calls in the same order, so
// seeded random models are unchanged).
//
// Invariant: a module built inside a scope holds garbage until every parameter is loaded, so only
// strict loaders (missing keys are an error) open a scope. The small normalisation layers stay
// torch::nn's (float32 CPU, converted by the loader's module.to()).
//
// Same public members as torch::nn's layers (`weight`, `bias`, `options`), so adapter code and
// checkpoint names are unaffected.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/options/conv.h>
#include <torch/nn/options/embedding.h>
#include <torch/nn/options/linear.h>
#include <torch/nn/pimpl.h>

#include <optional>

namespace dtune::models {

// While alive, layers constructed on this thread allocate uninitialised parameters of `dtype` on
// `device`. Scopes nest; the innermost wins.
class UninitializedParameters {
  public:
    UninitializedParameters(c10::ScalarType dtype, c10::Device device);
    ~UninitializedParameters();
    UninitializedParameters(const UninitializedParameters&) = delete;
    UninitializedParameters& operator=(const UninitializedParameters&) = delete;

    // The innermost scope's target, nullopt outside any scope.
    static std::optional<at::TensorOptions> current();

  private:
    std::optional<at::TensorOptions> previous_;
};

class LinearImpl : public torch::nn::Module {
  public:
    LinearImpl(int64_t in_features, int64_t out_features)
        : LinearImpl(torch::nn::LinearOptions(in_features, out_features)) {}
    explicit LinearImpl(const torch::nn::LinearOptions& options);
    at::Tensor forward(const at::Tensor& x);  // [..., in] -> [..., out]

    torch::nn::LinearOptions options;
    at::Tensor weight;  // [out, in]
    at::Tensor bias;    // [out], undefined without bias
    // Defined once the layer is quantised (common/quantize.h): `weight` then holds int8 or
    // float8_e4m3fn values, frozen, and the weight is weight · weight_scale (float32 [out]).
    at::Tensor weight_scale;
    at::ScalarType dense_dtype = at::kFloat;  // the weight's dtype before quantisation
    // The dtype the layer computes in: the weight's, or dense_dtype when quantised.
    at::ScalarType dtype() const { return weight_scale.defined() ? dense_dtype : weight.scalar_type(); }
};
TORCH_MODULE(Linear);

// Zero padding given as numbers only (what the diffusion models use); other padding modes are a
// UsageError at construction.
class Conv2dImpl : public torch::nn::Module {
  public:
    explicit Conv2dImpl(const torch::nn::Conv2dOptions& options);
    at::Tensor forward(const at::Tensor& x);  // [B, in, H, W] -> [B, out, H', W']
    // The convolution alone, without adding `bias` (for callers that fold the bias into what follows).
    at::Tensor forward_without_bias(const at::Tensor& x);

    torch::nn::Conv2dOptions options;
    at::Tensor weight;        // [out, in / groups, kh, kw]
    at::Tensor bias;          // [out], undefined without bias
    at::Tensor weight_scale;  // as LinearImpl's (quantised layers only)
    at::ScalarType dense_dtype = at::kFloat;
    at::ScalarType dtype() const { return weight_scale.defined() ? dense_dtype : weight.scalar_type(); }
};
TORCH_MODULE(Conv2d);

// A plain lookup table (no padding_idx, max_norm or sparse gradients).
class EmbeddingImpl : public torch::nn::Module {
  public:
    EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim);
    at::Tensor forward(const at::Tensor& ids);  // [...] int64 -> [..., dim]

    at::Tensor weight;  // [num, dim]
};
TORCH_MODULE(Embedding);

// A layer's weight in `dtype` as a dense tensor: the weight itself (cast) when it is not quantised,
// else its dequantised values (a new tensor each call).
at::Tensor dense_weight(const at::Tensor& weight, const at::Tensor& weight_scale, at::ScalarType dtype);

}  // namespace dtune::models
