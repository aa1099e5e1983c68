// Bucketed gradient all-reduce, parameter broadcast/check and the ZeRO-1 partition (see reducer.h).
#include "dist/reducer.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <memory>
#include <numeric>

#include "core/error.h"

namespace dtune::dist {

GradReducer::GradReducer(Group& group, std::vector<at::Tensor> params, ReducerOptions options)
    : group_(group), params_(std::move(params)) {
    // Reverse order: the last layers' gradients are ready first during backward.
    std::vector<std::size_t> current;
    std::size_t bytes = 0;
    for (std::size_t k = params_.size(); k-- > 0;) {
        const at::Tensor& p = params_[k];
        bool compatible = current.empty() || (params_[current[0]].scalar_type() == p.scalar_type() &&
                                              params_[current[0]].device() == p.device());
        std::size_t size = static_cast<std::size_t>(p.numel()) * p.element_size();
        if (!current.empty() && (!compatible || bytes + size > options.bucket_bytes)) {
            buckets_.push_back(std::move(current));
            current.clear();
            bytes = 0;
        }
        current.push_back(k);
        bytes += size;
    }
    if (!current.empty()) buckets_.push_back(std::move(current));
}

// [sum numel + n]: the gradients (zeros where undefined) then one "used" flag per parameter.
at::Tensor GradReducer::pack(const std::vector<std::size_t>& bucket) const {
    std::vector<at::Tensor> parts;
    parts.reserve(bucket.size() + 1);
    const at::Tensor& first = params_[bucket[0]];
    auto used = at::zeros({static_cast<long>(bucket.size())}, first.options());
    for (std::size_t j = 0; j < bucket.size(); ++j) {
        const at::Tensor& p = params_[bucket[j]];
        const at::Tensor& g = p.grad();
        if (g.defined()) {
            parts.push_back(g.detach().reshape({-1}).to(p.scalar_type()));
            used[static_cast<long>(j)].fill_(1);
        } else {
            parts.push_back(at::zeros({p.numel()}, p.options()));
        }
    }
    parts.push_back(used);
    return at::cat(parts);
}

void GradReducer::unpack(const std::vector<std::size_t>& bucket, const at::Tensor& flat) {
    long total = flat.numel() - static_cast<long>(bucket.size());
    // [n] how many ranks had a grad; read once on the host (one sync per bucket, not per parameter).
    auto used = flat.slice(0, total).to(at::kCPU).to(at::kDouble).contiguous();
    const double* used_count = used.data_ptr<double>();
    long offset = 0;
    for (std::size_t j = 0; j < bucket.size(); ++j) {
        at::Tensor& p = params_[bucket[j]];
        long n = p.numel();
        auto averaged = flat.slice(0, offset, offset + n).view(p.sizes());
        offset += n;
        if (used_count[j] == 0) continue;  // unused on every rank
        if (p.grad().defined())
            p.mutable_grad().copy_(averaged);
        else
            p.mutable_grad() = averaged.clone();
    }
}

void GradReducer::reduce() {
    if (group_.world_size() <= 1) return;
    std::vector<at::Tensor> flats;
    std::vector<std::unique_ptr<Pending>> pending;
    flats.reserve(buckets_.size());
    for (const auto& bucket : buckets_) {
        flats.push_back(pack(bucket));
        pending.push_back(group_.all_reduce_sum_async(flats.back()));
    }
    at::NoGradGuard no_grad;
    const long n_ranks = group_.world_size();
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
        pending[b]->wait();
        long grads = flats[b].numel() - static_cast<long>(buckets_[b].size());
        flats[b].slice(0, 0, grads).div_(n_ranks);
        unpack(buckets_[b], flats[b]);
    }
}

void broadcast_parameters(Group& group, const std::vector<at::Tensor>& params, int root) {
    if (group.world_size() <= 1) return;
    at::NoGradGuard no_grad;
    for (const auto& p : params) {
        at::Tensor t = p.detach();
        if (t.is_contiguous()) {
            group.broadcast_(t, root);
        } else {
            at::Tensor c = t.contiguous();
            group.broadcast_(c, root);
            t.copy_(c);
        }
    }
}

void check_parameters_identical(Group& group, const std::vector<at::Tensor>& params,
                                const std::vector<std::string>& names, double tolerance) {
    if (group.world_size() <= 1) return;
    for (std::size_t i = 0; i < params.size(); ++i) {
        at::Tensor mine = params[i].detach().to(at::kDouble).contiguous();
        at::Tensor reference = mine.clone();
        group.broadcast_(reference, 0);
        at::Tensor diff = (mine - reference).abs().max().reshape({1});
        group.all_reduce_max_(diff);
        double worst = diff.item<double>();
        if (!(worst <= tolerance))
            throw Error(str("dist: parameter ", i < names.size() ? names[i] : str("#", i),
                            " differs between ranks by ", worst, " (tolerance ", tolerance,
                            "); the ranks diverged: check that every rank ",
                            "loads the same weights and that gradients are reduced on every optimizer step"));
    }
}

ZeroPartition::ZeroPartition(const std::vector<at::Tensor>& params, int world_size)
    : owner_(params.size(), 0) {
    DTUNE_CHECK(world_size >= 1, "ZeroPartition: world size ", world_size, " must be at least 1");
    std::vector<std::size_t> order(params.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return params[a].numel() > params[b].numel(); });
    std::vector<long> load(static_cast<std::size_t>(world_size), 0);
    for (std::size_t i : order) {
        auto least = std::min_element(load.begin(), load.end()) - load.begin();
        owner_[i] = static_cast<int>(least);
        load[static_cast<std::size_t>(least)] += params[i].numel();
    }
}

std::vector<std::size_t> ZeroPartition::owned_by(int rank) const {
    std::vector<std::size_t> out;
    for (std::size_t i = 0; i < owner_.size(); ++i)
        if (owner_[i] == rank) out.push_back(i);
    return out;
}

void ZeroPartition::sync_parameters(Group& group, const std::vector<at::Tensor>& params) const {
    if (group.world_size() <= 1) return;
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params.size(); ++i) {
        at::Tensor t = params[i].detach();
        at::Tensor c = t.is_contiguous() ? t : t.contiguous();
        group.broadcast_(c, owner_[i]);
        if (!t.is_contiguous()) t.copy_(c);
    }
}

}  // namespace dtune::dist
