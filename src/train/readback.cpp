// Deferred read-back of a step's scalars (see readback.h).
#include "train/readback.h"

#include <ATen/DeviceAccelerator.h>

#include <cstdlib>

#include "core/error.h"
#include "dist/group.h"

namespace dtune::train {

void StepScalars::add_micro_batch(const at::Tensor& loss, bool is_regularisation,
                                  const std::vector<std::string>& paths) {
    losses.push_back(loss.detach());
    regularisation.push_back(is_regularisation);
    std::string files;
    for (const auto& p : paths) files += (files.empty() ? "" : ", ") + p;
    batches.push_back(std::move(files));
}

at::Tensor pack_step_scalars(const StepScalars& s) {
    DTUNE_CHECK(!s.losses.empty(), "pack_step_scalars: a step without a micro-batch loss");
    at::NoGradGuard no_grad;
    const auto n = static_cast<int64_t>(s.losses.size());
    const auto options = at::TensorOptions().dtype(at::kDouble).device(s.losses.front().device());
    at::Tensor out = at::zeros({n + 2}, options);  // [losses..., grad_norm, mean loss]
    for (int64_t i = 0; i < n; ++i) out.select(0, i).copy_(s.losses[static_cast<std::size_t>(i)].reshape({}));
    if (s.grad_norm.defined()) out.select(0, n).copy_(s.grad_norm.reshape({}));
    // The host summed the micro-batches' losses as doubles, in order, from 0, then divided: the
    // same operations here (a tensor divisor: CUDA divides by a host scalar through its reciprocal).
    at::Tensor mean = out.narrow(0, n + 1, 1);
    for (int64_t i = 0; i < n; ++i) mean.add_(out.narrow(0, i, 1));
    mean.div_(at::full({1}, static_cast<double>(n), options));
    return out;
}

DeferredRead::DeferredRead() = default;
DeferredRead::DeferredRead(DeferredRead&&) noexcept = default;
DeferredRead& DeferredRead::operator=(DeferredRead&&) noexcept = default;
DeferredRead::~DeferredRead() = default;

DeferredRead::DeferredRead(std::vector<at::Tensor> parts, std::unique_ptr<dist::Pending> before) {
    DTUNE_CHECK(!parts.empty(), "DeferredRead: nothing to read");
    const c10::Device device = parts.front().device();
    if (device.is_cpu()) {  // read at wait(), after the collective (if any) has written them
        parts_ = std::move(parts);
        before_ = std::move(before);
        return;
    }
    if (before) before->wait();  // NCCL: the current stream waits for the collective; no host wait
    const at::Tensor all = parts.size() == 1 ? parts.front() : at::cat(parts);
    parts_ = {all.to(at::kCPU, /*non_blocking=*/true)};  // into pinned memory, on the current stream
    copied_.emplace(device.type());
    copied_->record(at::accelerator::getCurrentStream(device.index()));
}

bool DeferredRead::ready() {
    if (done_ || parts_.empty()) return true;
    if (copied_) return copied_->query();
    return !before_ || before_->ready();
}

const std::vector<double>& DeferredRead::wait() {
    if (done_ || parts_.empty()) return values_;
    if (copied_) copied_->synchronize();
    if (before_) before_->wait();  // Gloo: rethrows the collective's error (PeerFailure)
    const at::Tensor all = (parts_.size() == 1 ? parts_.front() : at::cat(parts_)).contiguous();
    const double* p = all.data_ptr<double>();
    values_.assign(p, p + all.numel());
    parts_.clear();
    before_.reset();
    copied_.reset();
    done_ = true;
    return values_;
}

ReadbackOptions ReadbackOptions::from_env() {
    ReadbackOptions o;
    const char* v = std::getenv("DTUNE_SYNC_READBACK");
    if (!v || !*v) return o;
    const std::string s = v;
    DTUNE_CHECK_AS(UsageError, s == "0" || s == "1", "DTUNE_SYNC_READBACK='", s,
                   "' is not 0 or 1; set 1 to read each step's loss back before the next step starts ",
                   "(a reference for triage), or unset it");
    o.lag = s == "1" ? 0 : 1;
    return o;
}

}  // namespace dtune::train
