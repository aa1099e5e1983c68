// One adapter per layer: attaching a second is a usage error rather than a silent replacement.
#include "models/common/adaptable.h"

#include "core/error.h"

namespace dtune::models {
namespace {

void check_free(const LayerAdapter* current) {
    if (current)
        throw UsageError(
            "this layer already carries an adapter; inject LoRA once per model (merge or rebuild the "
            "model before injecting another)");
}

}  // namespace

at::Tensor LayerAdapter::forward_whole(const at::Tensor& /*x*/) {
    throw Error("this adapter has no whole-layer forward (takes_whole_forward must be false)");
}

void AdaptableLinearImpl::set_adapter(std::shared_ptr<LayerAdapter> adapter) {
    check_free(adapter_.get());
    adapter_ = std::move(adapter);
}

void AdaptableConv2dImpl::set_adapter(std::shared_ptr<LayerAdapter> adapter) {
    check_free(adapter_.get());
    adapter_ = std::move(adapter);
}

}  // namespace dtune::models
