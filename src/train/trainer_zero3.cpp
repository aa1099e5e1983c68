// zero_stage 3 in the trainer (see trainer.h, data_parallel.h, zero3_model.h): which runs it
// supports, attaching the model's parameters as shards, resuming the shards from whole weights, and
// whole weights on demand for checkpoints, validation and exports.
//
// Checkpoints of a ZeRO-3 run hold the whole weights (rank 0 writes them after a gather, so a
// checkpoint folder is a plain diffusers UNet as for any other run) and one optimizer shard file
// per rank, written by every rank in parallel and keyed by parameter name and element offset; any
// world size, sharded or not, resumes from them exactly (zero3_model.h).
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
    DTUNE_CHECK_AS(
        UsageError, !lora_, why,
        " with model_type lora is not implemented yet (the frozen base would be sharded and the ",
        "adapters replicated); a LoRA's trainable state is small: use zero_stage 0, or model_type full");
    DTUNE_CHECK_AS(UsageError, !config_.flag("use_ema"), why,
                   " with use_ema is not implemented (the EMA copy would need the whole weights on every ",
                   "rank); set use_ema false, or use zero_stage 2 with EMA");
    DTUNE_CHECK_AS(UsageError, !base_quantized_, why,
                   " cannot shard a quantised base model (base_model_precision ",
                   config_.text("base_model_precision"), "); set base_model_precision no_change");
    DTUNE_CHECK_AS(
        UsageError, !offload_optimizer_, why,
        " with offload_optimizer_device cpu is not implemented yet; each rank already keeps only ",
        "1/N of the optimizer state: set offload_optimizer_device none, or use zero_stage 2 with the ",
        "offload");
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
        dp_->attach(std::move(tensors));
        return;
    }
    check_zero3_support();
    dp_->attach_sharded(model_->module(), names, std::move(tensors), resolve_zero3_options(config_));
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
