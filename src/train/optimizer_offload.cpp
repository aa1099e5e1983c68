// CpuOffloadOptimizer (see optimizer_offload.h).
#include "train/optimizer_offload.h"

#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/core/grad_mode.h>

#include <set>

#include "core/error.h"

namespace dtune::train {
namespace {

// Pinned host memory: ZeRO-3's offloaded parameter shards (offload_param_device cpu). Parameters
// on a CPU training device are copied like any other, so CPU runs exercise the copies that GPU
// runs make.
bool in_host_memory(const at::Tensor& p) {
    return p.is_cpu() && at::hasCUDA() && p.is_pinned();
}

}  // namespace

CpuOffloadOptimizer::CpuOffloadOptimizer(std::vector<ParamGroup> groups, const Factory& make_host_optimizer)
    : Optimizer(std::move(groups)) {
    at::NoGradGuard no_grad;
    std::vector<ParamGroup> host_groups;
    for (const auto& g : groups_) {
        ParamGroup h{g.names, {}, g.lr, g.weight_decay};
        auto& slots = slots_.emplace_back();
        for (const auto& p : g.params) {
            if (in_host_memory(p)) {  // already where the host optimizer works: updated in place
                h.params.push_back(p);
                slots.push_back(Slot{p, p, {}, /*in_place=*/true});
                continue;
            }
            const auto options = p.options().device(at::kCPU).requires_grad(false).pinned_memory(p.is_cuda());
            at::Tensor host = at::empty(p.sizes(), options);
            host.copy_(p.detach());
            host.set_requires_grad(true);
            h.params.push_back(host);
            slots.push_back(Slot{p, host, {}, /*in_place=*/false});
        }
        host_groups.push_back(std::move(h));
    }
    host_ = make_host_optimizer(std::move(host_groups));
    DTUNE_CHECK(host_ != nullptr, "internal: no host optimizer was built for CPU offload");
    name_ = std::string(host_->name()) + " (state offloaded to the CPU)";
}

void CpuOffloadOptimizer::step() {
    at::NoGradGuard no_grad;
    std::set<c10::DeviceIndex> gpus;
    if (reload_) {
        for (auto& slots : slots_)
            for (Slot& s : slots) {
                if (s.in_place) continue;
                s.host.detach().copy_(s.param.detach(), /*non_blocking=*/s.param.is_cuda());
                if (s.param.is_cuda()) gpus.insert(s.param.device().index());
            }
        reload_ = false;
    }
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
        ParamGroup& host_group = host_->param_groups()[gi];
        host_group.lr = groups_[gi].lr;  // set_lr() and schedules act on this wrapper's groups
        host_group.weight_decay = groups_[gi].weight_decay;
        for (Slot& s : slots_[gi]) {
            if (s.in_place) continue;  // its gradient is already the host optimizer's
            const at::Tensor& grad = s.param.grad();
            if (!grad.defined()) {
                s.host.mutable_grad().reset();
                continue;
            }
            if (!s.host_grad.defined() || s.host_grad.scalar_type() != grad.scalar_type())
                s.host_grad =
                    at::empty(grad.sizes(), grad.options().device(at::kCPU).pinned_memory(grad.is_cuda()));
            s.host_grad.copy_(grad, /*non_blocking=*/grad.is_cuda());
            s.host.mutable_grad() = s.host_grad;
            if (grad.is_cuda()) gpus.insert(grad.device().index());
        }
    }
    // The host reads the gradients next: wait once for the copies queued above.
    for (const auto index : gpus) at::accelerator::synchronizeDevice(index);
    host_->step();
    // Back to the device, asynchronously from pinned memory; the next step's wait above also
    // guarantees these copies are done before the host copies change again.
    for (auto& slots : slots_)
        for (Slot& s : slots) {
            if (s.in_place || !s.host.grad().defined()) continue;
            s.param.detach().copy_(s.host, /*non_blocking=*/s.param.is_cuda());
            s.host.mutable_grad().reset();
        }
}

int64_t CpuOffloadOptimizer::host_copy_bytes() const {
    int64_t bytes = 0;
    for (const auto& slots : slots_)
        for (const Slot& s : slots) {
            if (s.in_place) continue;
            bytes += s.host.numel() * static_cast<int64_t>(s.host.element_size());
            if (s.host_grad.defined())
                bytes += s.host_grad.numel() * static_cast<int64_t>(s.host_grad.element_size());
        }
    return bytes;
}

}  // namespace dtune::train
