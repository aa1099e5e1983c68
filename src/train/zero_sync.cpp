// ZeRO-1/2 parameter sync overlapped with the next forward (see zero_sync.h).
#include "train/zero_sync.h"

#include <ATen/core/grad_mode.h>

#include "core/error.h"
#include "dist/group.h"

namespace dtune::train {

DeferredParameterSync::DeferredParameterSync(dist::Group& group, torch::nn::Module& model,
                                             const std::vector<at::Tensor>& params,
                                             const std::vector<int>& owners)
    : group_(group) {
    DTUNE_CHECK(owners.size() == params.size(), "ZeRO sync: ", owners.size(), " owners for ", params.size(),
                " parameters");
    std::map<const c10::TensorImpl*, std::size_t> index;
    for (std::size_t i = 0; i < params.size(); ++i) {
        DTUNE_CHECK(params[i].is_contiguous(), "ZeRO sync: parameter ", i, " is not contiguous");
        index[params[i].unsafeGetTensorImpl()] = i;
    }
    std::vector<bool> taken(params.size(), false);
    groups_.emplace_back();  // the parameters outside every unit, filled last
    for (const auto& [name, module] : models::find_units(model)) {
        SyncGroup g;
        for (const auto& p : module->parameters(/*recurse=*/true)) {
            const auto it = index.find(p.unsafeGetTensorImpl());
            if (it == index.end() || taken[it->second]) continue;  // frozen, or in an earlier unit
            taken[it->second] = true;
            g.tensors.push_back(params[it->second].detach());
            g.roots.push_back(owners[it->second]);
        }
        if (g.tensors.empty()) continue;
        group_of_[module.get()] = groups_.size();
        groups_.push_back(std::move(g));
        modules_.push_back(module);
    }
    for (std::size_t i = 0; i < params.size(); ++i)
        if (!taken[i]) {
            groups_[0].tensors.push_back(params[i].detach());
            groups_[0].roots.push_back(owners[i]);
        }
    for (const auto& m : modules_) models::set_unit_hooks(*m, this);
}

DeferredParameterSync::~DeferredParameterSync() {
    for (const auto& m : modules_) models::set_unit_hooks(*m, nullptr);
}

void DeferredParameterSync::issue() {
    wait_all();  // a group still in flight from an earlier issue is not overwritten by a second one
    at::NoGradGuard no_grad;
    for (auto& g : groups_)
        if (!g.tensors.empty()) g.pending = group_.broadcast_coalesced_async(g.tensors, g.roots);
}

void DeferredParameterSync::wait(std::size_t g) {
    if (!groups_[g].pending) return;
    groups_[g].pending->wait();
    groups_[g].pending.reset();
}

void DeferredParameterSync::begin_forward() {
    issue();
    wait(0);
}

void DeferredParameterSync::wait_all() {
    for (std::size_t g = 0; g < groups_.size(); ++g) wait(g);
}

void DeferredParameterSync::flush() {
    issue();
    wait_all();
}

void DeferredParameterSync::before_unit(const torch::nn::Module& unit, bool /*recompute*/) {
    const auto it = group_of_.find(&unit);
    if (it != group_of_.end()) wait(it->second);
}

}  // namespace dtune::train
