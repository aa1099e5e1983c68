// zero_stage 3 in the trainer (see trainer.h, data_parallel.h, zero3_model.h): which runs it
// supports, attaching the model's parameters as shards, resuming the shards from whole weights, and
// whole weights on demand for checkpoints, validation and exports.
//
// Checkpoints of a ZeRO-3 full fine-tune hold the whole weights (rank 0 writes them after a gather,
// so a checkpoint folder is a plain diffusers UNet as for any other run) and one optimizer shard
// file per rank, written by every rank in parallel and keyed by parameter name and element offset;
// any world size, sharded or not, resumes from them exactly (zero3_model.h).
//
// A LoRA under ZeRO-3 shards its frozen base only; the adapters, their optimizer state and EMA are
// whole and the same on every rank, so its checkpoints are a plain LoRA run's (rank 0 writes the
// adapter file, with no gather of the base; each rank's optimizer shard file holds the whole
// adapter state) and resume on any world size.
#include <set>

#include "core/error.h"
#include "core/log.h"
#include "dist/zero3.h"
#include "models/common/weights.h"
#include "train/checkpoint.h"
#include "train/data_parallel.h"
#include "train/fault_inject.h"
#include "train/trainer.h"

namespace dtune::train {

void Trainer::check_zero3_support() const {
    const char* why = "zero_stage 3 (or fsdp_enable)";
    DTUNE_CHECK_AS(UsageError, !base_quantized_, why,
                   " cannot shard a quantised base model (base_model_precision ",
                   config_.text("base_model_precision"), "); set base_model_precision no_change");
    // A LoRA's adapters are whole and replicated: their optimizer (any, offloaded or not), state
    // and EMA are plain data parallelism's; the frozen base's shards may live in host memory
    // (offload_param_device cpu) since no optimizer updates them.
    if (lora_) return;
    DTUNE_CHECK_AS(UsageError, !config_.flag("use_ema"), why,
                   " with use_ema is not implemented for model_type full (the EMA copy would need the ",
                   "whole weights on every rank); set use_ema false, or use zero_stage 2 with EMA");
    DTUNE_CHECK_AS(UsageError, offload_optimizer_ || !resolve_zero3_options(config_).offload_params, why,
                   " with offload_param_device cpu needs offload_optimizer_device cpu too: the parameter ",
                   "shards, which the optimizer updates, are then in host memory, and so must its state ",
                   "and update be; set offload_optimizer_device cpu, or offload_param_device none");
    const std::string optimizer = config_.text("optimizer");
    static const std::set<std::string> kElementwise = {"torch-adamw", "optimi-adamw", "adamw_bf16",
                                                       "optimi-lion", "torch-sgd"};
    DTUNE_CHECK_AS(UsageError, kElementwise.count(optimizer) > 0, "optimizer ", optimizer, " with ", why,
                   ": ZeRO-3 gives each rank flat slices of the parameters, and ", optimizer,
                   " factors a parameter's state over its whole 2-D shape; choose adamw_bf16, torch-adamw, ",
                   "optimi-adamw, optimi-lion or torch-sgd, or use zero_stage 2");
}

void Trainer::attach_data_parallel() {
    std::vector<at::Tensor> tensors;
    std::vector<std::string> names;
    for (const auto& p : trainable_) {
        tensors.push_back(p.tensor);
        names.push_back(p.name);
    }
    if (dp_->zero_stage() != 3) {
        // Copy-in and direct leave a round's sums to autograd, which a graphed accumulation
        // (gradients at fixed addresses across its micro-step graphs) cannot use: only one
        // micro-step a step.
        const GradientHandoff handoff = gradient_handoff_requested();
        const int64_t accumulation = config_.integer("gradient_accumulation_steps");
        dp_->attach(std::move(tensors), accumulation == 1 ? handoff : GradientHandoff::kInPlace);
        // ZeRO-1/2: the owners' updates reach the other ranks during the next forward. Not with
        // gradient accumulation (each micro-step's forward would sync again), EMA (it reads every
        // weight after each step) or a LoRA (its adapters are small; units hold the frozen base).
        const ZeroSync sync = zero_sync_requested();
        if (dp_->zero_stage() >= 1 && world_size() > 1 && sync != ZeroSync::kStep && accumulation == 1 &&
            !lora_ && !config_.flag("use_ema"))
            dp_->defer_parameter_sync(model_->module(), sync == ZeroSync::kForward);
        if (accumulation > 1 && handoff == GradientHandoff::kDirect && gradient_handoff_named() &&
            world_size() > 1 && dp_->rank() == 0)
            log::info() << "DTUNE_DDP_GRAD_COPY=direct is not used with gradient_accumulation_steps "
                        << accumulation
                        << ": the gradients add up in the reducer's buckets over the micro-steps";
        return;
    }
    check_zero3_support();
    if (!lora_) {
        dp_->attach_sharded(model_->module(), names, std::move(tensors), resolve_zero3_options(config_));
        return;
    }
    // A LoRA: the base (every parameter but the adapters) is sharded, the adapters replicated.
    const std::set<std::string> adapters(names.begin(), names.end());
    std::vector<std::string> base_names;
    std::vector<at::Tensor> base;
    for (const auto& item : model_->module().named_parameters()) {
        if (adapters.count(item.key())) continue;
        base_names.push_back(item.key());
        base.push_back(item.value());
    }
    dp_->attach_sharded_base(model_->module(), base_names, std::move(base), std::move(tensors),
                             resolve_zero3_options(config_));
}

void Trainer::load_sharded_weights(const std::filesystem::path& file,
                                   const std::map<std::string, at::Tensor>& by_name) {
    at::NoGradGuard no_grad;
    std::map<std::string, const dist::Zero3Slice*> slice_of;
    for (const auto& s : dp_->zero3_slices()) slice_of[s.name] = &s;
    std::vector<at::Tensor> copied;
    std::vector<std::string> copied_names;
    for (const auto& p : trainable_) {
        auto it = by_name.find(p.name);
        DTUNE_CHECK_AS(DataError, it != by_name.end(), "checkpoint file ", file.string(), " has no weight ",
                       p.name, "; it was written by a different model or model_type");
        check_resumed_tensor(file, p.name, it->second, p.tensor);  // (shape and dtype are kept when released)
        const auto s = slice_of.find(p.name);
        if (s == slice_of.end()) continue;  // another rank's part only
        const dist::Zero3Slice& slice = *s->second;
        slice.value.copy_(it->second.reshape({-1}).slice(0, slice.begin, slice.end));
        copied.push_back(slice.value);
        copied_names.push_back(p.name);
    }
    if (const int64_t bad = models::first_non_finite(copied); bad >= 0)
        throw DataError(str(file.string(), ": tensor '", copied_names[static_cast<std::size_t>(bad)],
                            "' holds NaN or infinite values (the run had diverged when it was saved, or the "
                            "file is damaged); resume from an earlier checkpoint"));
}

bool Trainer::arm_gather_fault_injection() {
    if (!inject_at_gather_) inject_at_gather_ = inject_point() == InjectPoint::kZero3Gather;
    dist::Zero3Engine* engine = dp_->zero3_engine();
    if (!*inject_at_gather_ || !engine) return false;
    auto count = std::make_shared<int>(0);
    engine->set_before_gather([count, rank = dp_->rank(), step = global_step_ + 1](std::size_t) {
        if (++*count == 3) inject_step_error(rank, step);
    });
    return true;
}

std::shared_ptr<void> Trainer::whole_weights() {
    if (!dp_ || !dp_->gather_weights()) return nullptr;
    return std::shared_ptr<void>(nullptr, [dp = dp_.get()](void*) { dp->release_weights(); });
}

}  // namespace dtune::train
