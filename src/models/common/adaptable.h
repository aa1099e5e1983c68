// Linear and Conv2d layers that can carry an adapter (LoRA, DoRA, ...).
//
// AdaptableLinear / AdaptableConv2d are our Linear / Conv2d (layers.h: torch::nn's, plus
// uninitialised construction for loading) with the same parameters (`weight`, `bias`) and one extra hook:
// when an adapter is attached, forward() returns adapter->forward(x, base_out) instead of base_out. The model
// code builds these types wherever a layer may be targeted by an adapter, so injection needs no change to the
// blocks' forward code and checkpoint keys stay diffusers' names. Without an adapter the forward is exactly
// the base layer's.
//
// The adapter's own modules and parameters are registered on the host layer by the adapter code
// (so `to_q.lora_A.weight` appears in the model's named_parameters, moves with .to() and follows
// train()/eval()); the host only keeps the adapter object alive and calls it.
#pragma once

#include <memory>

#include "models/common/layers.h"

namespace dtune::models {

class LayerAdapter {
  public:
    virtual ~LayerAdapter() = default;
    // x: the layer's input; base_out: the base layer's output for x (bias included).
    virtual at::Tensor forward(const at::Tensor& x, const at::Tensor& base_out) = 0;
    // True when forward_whole(x) should compute the whole layer (base and adapter together) for this
    // call instead of forward(x, base_out): a fused path that needs the base's inputs.
    virtual bool takes_whole_forward(const at::Tensor& /*x*/) const { return false; }
    virtual at::Tensor forward_whole(const at::Tensor& x);
};

class AdaptableLinearImpl : public LinearImpl {
  public:
    using LinearImpl::LinearImpl;
    at::Tensor forward(const at::Tensor& x) {
        if (adapter_ && adapter_->takes_whole_forward(x)) return adapter_->forward_whole(x);
        at::Tensor out = LinearImpl::forward(x);
        return adapter_ ? adapter_->forward(x, out) : out;
    }
    // Throws UsageError when an adapter is already attached (one adapter per layer).
    void set_adapter(std::shared_ptr<LayerAdapter> adapter);
    LayerAdapter* adapter() const { return adapter_.get(); }

  private:
    std::shared_ptr<LayerAdapter> adapter_;
};
TORCH_MODULE(AdaptableLinear);

class AdaptableConv2dImpl : public Conv2dImpl {
  public:
    using Conv2dImpl::Conv2dImpl;
    at::Tensor forward(const at::Tensor& x) {
        at::Tensor out = Conv2dImpl::forward(x);
        return adapter_ ? adapter_->forward(x, out) : out;
    }
    void set_adapter(std::shared_ptr<LayerAdapter> adapter);
    LayerAdapter* adapter() const { return adapter_.get(); }

  private:
    std::shared_ptr<LayerAdapter> adapter_;
};
TORCH_MODULE(AdaptableConv2d);

}  // namespace dtune::models
