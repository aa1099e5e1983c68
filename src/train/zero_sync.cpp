// ZeRO-1/2 parameter sync overlapped with the next forward (see zero_sync.h).
#include "train/zero_sync.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>

#include "core/error.h"
#include "dist/group.h"

namespace dtune::train {

namespace {

// Offsets in a flat run buffer are multiples of this many bytes: every parameter starts where a
// fresh allocation would be aligned enough for vectorised kernels (GEMMs, the optimizer's).
constexpr int64_t kRunAlignBytes = 256;

int64_t align_up(int64_t elements, int64_t element_size) {
    const int64_t step = std::max<int64_t>(1, kRunAlignBytes / element_size);
    return (elements + step - 1) / step * step;
}

}  // namespace

DeferredParameterSync::DeferredParameterSync(dist::Group& group, torch::nn::Module& model,
                                             const std::vector<at::Tensor>& params,
                                             const std::vector<int>& owners, bool coalesce_runs)
    : group_(group) {
    DTUNE_CHECK(owners.size() == params.size(), "ZeRO sync: ", owners.size(), " owners for ", params.size(),
                " parameters");
    std::map<const c10::TensorImpl*, std::size_t> index;
    for (std::size_t i = 0; i < params.size(); ++i) {
        DTUNE_CHECK(params[i].is_contiguous(), "ZeRO sync: parameter ", i, " is not contiguous");
        index[params[i].unsafeGetTensorImpl()] = i;
    }
    // Each group first lists the parameters themselves (coalesce re-points them), then their
    // detached aliases for the collectives.
    std::vector<std::vector<at::Tensor>> members;
    std::vector<bool> taken(params.size(), false);
    groups_.emplace_back();  // the parameters outside every unit, filled last
    members.emplace_back();
    for (const auto& [name, module] : models::find_units(model)) {
        SyncGroup g;
        std::vector<at::Tensor> mine;
        for (const auto& p : module->parameters(/*recurse=*/true)) {
            const auto it = index.find(p.unsafeGetTensorImpl());
            if (it == index.end() || taken[it->second]) continue;  // frozen, or in an earlier unit
            taken[it->second] = true;
            mine.push_back(params[it->second]);
            g.roots.push_back(owners[it->second]);
        }
        if (mine.empty()) continue;
        group_of_[module.get()] = groups_.size();
        groups_.push_back(std::move(g));
        members.push_back(std::move(mine));
        modules_.push_back(module);
    }
    for (std::size_t i = 0; i < params.size(); ++i)
        if (!taken[i]) {
            members[0].push_back(params[i]);
            groups_[0].roots.push_back(owners[i]);
        }
    for (std::size_t g = 0; g < groups_.size(); ++g) {
        if (coalesce_runs) {
            coalesce(groups_[g], members[g]);
            continue;
        }
        for (const auto& p : members[g]) groups_[g].tensors.push_back(p.detach());
    }
    for (const auto& m : modules_) models::set_unit_hooks(*m, this);
}

void DeferredParameterSync::coalesce(SyncGroup& g, const std::vector<at::Tensor>& params) {
    at::NoGradGuard no_grad;
    std::vector<int> roots;
    for (std::size_t begin = 0; begin < params.size();) {
        const at::Tensor& first = params[begin];
        std::size_t end = begin + 1;
        while (end < params.size() && g.roots[end] == g.roots[begin] &&
               params[end].scalar_type() == first.scalar_type() && params[end].device() == first.device())
            ++end;
        roots.push_back(g.roots[begin]);
        if (end - begin == 1) {
            g.tensors.push_back(first.detach());
            begin = end;
            continue;
        }
        std::vector<int64_t> offsets;
        int64_t total = 0;
        for (std::size_t k = begin; k < end; ++k) {
            offsets.push_back(total);
            total = align_up(total + params[k].numel(), first.element_size());
        }
        // Zeros in the gaps: every rank broadcasts the same bytes.
        at::Tensor flat = at::zeros({total}, first.options().requires_grad(false));
        for (std::size_t k = begin; k < end; ++k) {
            at::Tensor p = params[k];
            at::Tensor view = flat.narrow(0, offsets[k - begin], p.numel());
            view.copy_(p.detach().reshape({-1}));
            // Same TensorImpl (model, autograd and optimizer keep it), its data now in the run.
            p.set_data(view.view(p.sizes()));
            g.moved.emplace_back(p, view.const_data_ptr());
        }
        g.tensors.push_back(flat);
        begin = end;
    }
    g.roots = std::move(roots);
}

std::size_t DeferredParameterSync::broadcasts() const {
    std::size_t n = 0;
    for (const auto& g : groups_) n += g.tensors.size();
    return n;
}

DeferredParameterSync::~DeferredParameterSync() {
    for (const auto& m : modules_) models::set_unit_hooks(*m, nullptr);
}

void DeferredParameterSync::issue() {
    wait_all();  // a group still in flight from an earlier issue is not overwritten by a second one
    for (const auto& g : groups_)
        for (const auto& [p, where] : g.moved)
            DTUNE_CHECK(p.const_data_ptr() == where, "ZeRO sync: a parameter of shape ", p.sizes(),
                        " no longer lives in its block's flat buffer (something re-pointed its data, e.g. "
                        "Module::to); its updates would no longer reach the other ranks");
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
