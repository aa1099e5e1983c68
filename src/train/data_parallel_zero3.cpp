// ZeRO-3 parts of DataParallel (see data_parallel.h, dist/zero3.h, train/zero3_model.h): the
// resolution of the stage-3 keys (DeepSpeed's and SimpleTuner's FSDP ones), attaching the sharded
// model, the micro-step protocol, whole weights on demand and the global norm over shards.
//
// Invariant: under ZeRO-3 every element of every trainable parameter is in exactly one rank's
// slices, so a sum over the slices, all-reduced, is the sum over the whole model. A LoRA
// (attach_sharded_base) has no slices: its base is sharded but frozen, and its adapters are whole
// on every rank with the same averaged gradients, as with plain data parallelism.
#include <cstdlib>

#include "core/error.h"
#include "core/log.h"
#include "dist/group.h"
#include "dist/reducer.h"
#include "dist/zero3.h"
#include "train/config.h"
#include "train/data_parallel.h"
#include "train/optimizer.h"
#include "train/zero3_model.h"
#include "train/zero_sync.h"

namespace dtune::train {

dist::Zero3Options resolve_zero3_options(const TrainConfig& config) {
    dist::Zero3Options o;
    // fsdp_cpu_offload true makes it cpu (and the optimizer's too, resolve_offload_optimizer).
    const OffloadDevice param =
        resolve_offload_device(config, "offload_param_device", "DTUNE_OFFLOAD_PARAM_DEVICE");
    const std::string& param_device = param.value;
    const std::string& origin = param.origin;
    DTUNE_CHECK_AS(UsageError, param_device.empty() || param_device == "none" || param_device == "cpu",
                   origin, " is '", param_device,
                   "'; dtune offloads parameters to the cpu: set it to cpu or none (nvme ",
                   "offload is not implemented)");
    // The shards live in host memory (a full fine-tune's optimizer then updates them there:
    // Trainer::check_zero3_support asks for offload_optimizer_device cpu too).
    o.offload_params = param_device == "cpu";
    if (const char* env = std::getenv("DTUNE_ZERO3_PREFETCH"); env && *env) {
        char* end = nullptr;
        const long depth = std::strtol(env, &end, 10);
        DTUNE_CHECK_AS(UsageError, *end == '\0' && depth >= 0 && depth <= 16, "DTUNE_ZERO3_PREFETCH is '",
                       env,
                       "'; set it to the number of blocks whose all-gather is issued ahead of use (1 to 16, ",
                       "default 1), or 0 to gather each block only when it is needed");
        o.prefetch = static_cast<int>(depth);
    }
    if (const char* env = std::getenv("DTUNE_ZERO3_REDUCE_IN_FLIGHT"); env && *env) {
        char* end = nullptr;
        const long depth = std::strtol(env, &end, 10);
        DTUNE_CHECK_AS(
            UsageError, *end == '\0' && depth >= 0 && depth <= 1024, "DTUNE_ZERO3_REDUCE_IN_FLIGHT is '", env,
            "'; set it to the number of blocks whose gradient reduce-scatter may be in flight at once ",
            "(default 2), or 0 to wait for all of them at the end of backward");
        o.reduce_in_flight = static_cast<int>(depth);
    }
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

void DataParallel::attach_sharded_base(torch::nn::Module& model, const std::vector<std::string>& base_names,
                                       std::vector<at::Tensor> base_params, std::vector<at::Tensor> trainable,
                                       const dist::Zero3Options& options) {
    // The adapters: as attach() does for zero_stage 0 (every rank updates every one of them).
    params_ = std::move(trainable);
    dist::broadcast_parameters(*group_, params_, 0);
    reducer_ = std::make_unique<dist::GradReducer>(*group_, params_);
    const char* overlap = std::getenv("DTUNE_DDP_OVERLAP");
    if (!(overlap && std::string(overlap) == "0")) reducer_->enable_overlap();
    // The base is read from the same files on every rank (no broadcast, as without ZeRO-3).
    sharded_base_only_ = true;
    zero3_ =
        std::make_unique<ShardedModel>(*group_, model, base_names, base_params, options, /*frozen=*/true);
    const auto& engine = zero3_->engine();
    log::info() << "ZeRO-3 rank " << env_.rank << ": frozen base sharded, resident base bytes "
                << engine.resident_parameter_bytes() << " of " << engine.full_parameter_bytes() << "; "
                << params_.size() << " adapter tensors replicated (world size " << env_.world_size << ")";
}

dist::Zero3Engine* DataParallel::zero3_engine() {
    return zero3_ ? &zero3_->engine() : nullptr;
}

const std::vector<dist::Zero3Slice>& DataParallel::zero3_slices() const {
    static const std::vector<dist::Zero3Slice> kNone;
    return zero3_ ? zero3_->engine().slices() : kNone;
}

std::vector<at::Tensor> DataParallel::gradient_holders(const std::vector<at::Tensor>& params) const {
    if (!sharded_parameters()) return params;
    std::vector<at::Tensor> out;
    for (const auto& s : zero3_->engine().slices()) out.push_back(s.value);
    return out;
}

void DataParallel::before_forward() {
    if (zero3_) zero3_->engine().begin_forward();
    if (deferred_) deferred_->begin_forward();  // ZeRO-1/2: the owners' updates, unit by unit
}

void DataParallel::after_backward() {
    if (zero3_) zero3_->engine().finish_backward();
}

bool DataParallel::gather_weights() {
    flush_parameters();  // ZeRO-1/2 with the sync deferred: whole weights on every rank
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
                << " of " << engine.full_parameter_bytes()
                << (sharded_base_only_ ? " frozen base bytes" : " parameter bytes") << " resident ("
                << engine.gathers() << " unit gathers in the first step, " << engine.prefetched_gathers()
                << " prefetched; " << engine.host_parameter_bytes() << " shard bytes in host memory)";
}

at::Tensor DataParallel::sharded_clip_grad_norm(const std::vector<at::Tensor>& slices, double max_norm) {
    // A LoRA's base is sharded, not its adapters: every rank holds the same averaged gradients.
    if (!sharded_parameters()) return train::clip_grad_norm_async(slices, max_norm);
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
