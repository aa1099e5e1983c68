// ZeRO-3 parts of DataParallel (see data_parallel.h, dist/zero3.h, train/zero3_model.h): the
// resolution of the stage-3 keys (DeepSpeed's and SimpleTuner's FSDP ones), attaching the sharded
// model, the micro-step protocol, whole weights on demand and the global norm over shards.
//
// Invariant: under ZeRO-3 every element of every trainable parameter is in exactly one rank's
// slices, so a sum over the slices, all-reduced, is the sum over the whole model.
#include <cstdlib>

#include "core/error.h"
#include "core/log.h"
#include "dist/group.h"
#include "dist/reducer.h"
#include "dist/zero3.h"
#include "train/config.h"
#include "train/data_parallel.h"
#include "train/zero3_model.h"

namespace dtune::train {

dist::Zero3Options resolve_zero3_options(const TrainConfig& config) {
    dist::Zero3Options o;
    std::string param_device = config.text("offload_param_device");
    std::string origin = "offload_param_device in the config";
    if (param_device.empty()) {
        const char* env = std::getenv("DTUNE_OFFLOAD_PARAM_DEVICE");
        param_device = env ? env : "";
        origin = "DTUNE_OFFLOAD_PARAM_DEVICE (from deepspeed_config.offload_param_device)";
    }
    DTUNE_CHECK_AS(UsageError, param_device.empty() || param_device == "none", origin, " is '", param_device,
                   "'; dtune does not offload parameters: ZeRO-3 keeps each rank's shard (1/N of the ",
                   "weights) on the training device. Set it to none and add GPUs, or move the optimizer ",
                   "state to host memory with offload_optimizer_device cpu");
    o.reshard_after_forward = config.flag("fsdp_reshard_after_forward");
    return o;
}

void DataParallel::attach_sharded(torch::nn::Module& model, const std::vector<std::string>& names,
                                  std::vector<at::Tensor> params, const dist::Zero3Options& options) {
    params_ = std::move(params);
    dist::broadcast_parameters(*group_, params_, 0);
    zero3_ = std::make_unique<ShardedModel>(*group_, model, names, params_, options);
    const auto& engine = zero3_->engine();
    log::info() << "ZeRO-3 rank " << env_.rank << ": " << engine.slices().size()
                << " parameter slices, resident parameter bytes " << engine.resident_parameter_bytes()
                << " of " << engine.full_parameter_bytes() << " (world size " << env_.world_size << ")";
}

dist::Zero3Engine* DataParallel::zero3_engine() {
    return zero3_ ? &zero3_->engine() : nullptr;
}

const std::vector<dist::Zero3Slice>& DataParallel::zero3_slices() const {
    static const std::vector<dist::Zero3Slice> kNone;
    return zero3_ ? zero3_->engine().slices() : kNone;
}

std::vector<at::Tensor> DataParallel::gradient_holders(const std::vector<at::Tensor>& params) const {
    if (!zero3_) return params;
    std::vector<at::Tensor> out;
    for (const auto& s : zero3_->engine().slices()) out.push_back(s.value);
    return out;
}

void DataParallel::before_forward() {
    if (zero3_) zero3_->engine().begin_forward();
}

void DataParallel::after_backward() {
    if (zero3_) zero3_->engine().finish_backward();
}

bool DataParallel::gather_weights() {
    if (!zero3_ || zero3_->engine().gathered_all()) return false;
    zero3_->engine().gather_all();
    return true;
}

void DataParallel::release_weights() {
    if (zero3_) zero3_->engine().release_all();
}

void DataParallel::zero3_after_step() {
    auto& engine = zero3_->engine();
    engine.zero_grad();
    if (shard_reported_) return;
    // Measured from the storages after a whole step (tests/dist/zero3_multi_test.cpp reads it).
    shard_reported_ = true;
    log::info() << "ZeRO-3 rank " << env_.rank << ": between steps " << engine.resident_parameter_bytes()
                << " of " << engine.full_parameter_bytes() << " parameter bytes resident ("
                << engine.gathers() << " unit gathers in the first step)";
}

at::Tensor DataParallel::sharded_clip_grad_norm(const std::vector<at::Tensor>& slices, double max_norm) {
    at::NoGradGuard no_grad;
    // [2]: this rank's sum of squares, and whether it holds any gradient.
    auto local = at::zeros({2}, at::TensorOptions().dtype(at::kFloat).device(device_));
    std::vector<at::Tensor> grads;
    for (const auto& s : slices)
        if (s.grad().defined()) grads.push_back(s.grad());
    if (!grads.empty()) {
        at::Tensor squares = at::zeros({}, local.options());
        for (const auto& g : grads) squares = squares + g.to(at::kFloat).square().sum();
        local[0].copy_(squares);
        local[1].fill_(1.0);
    }
    group_->all_reduce_sum_(local);
    if (local[1].item<float>() == 0) return {};
    const at::Tensor total = local[0].sqrt();
    if (max_norm <= 0 || grads.empty()) return total;
    const at::Tensor coef = at::clamp_max(max_norm / (total + 1e-6), 1.0);  // scalar, on device
    for (auto& g : grads) g.mul_(coef.to(g.device(), g.scalar_type()));
    return total;
}

}  // namespace dtune::train
