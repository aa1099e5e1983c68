// Bucketed gradient all-reduce (ZeRO-2: reduce to the owner), parameter broadcast/check and the
// ZeRO partition (see reducer.h).
#include "dist/reducer.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <numeric>

#include "core/error.h"

namespace dtune::dist {

GradReducer::GradReducer(Group& group, std::vector<at::Tensor> params, ReducerOptions options)
    : group_(group), params_(std::move(params)) {
    const std::vector<int>& owners = options.owners;
    DTUNE_CHECK(owners.empty() || owners.size() == params_.size(), "GradReducer: ", owners.size(),
                " owners for ", params_.size(), " parameters");
    // Reverse order: the last layers' gradients are ready first during backward.
    std::vector<std::size_t> current;
    std::size_t bytes = 0;
    auto close_bucket = [&] {
        if (!owners.empty()) bucket_owner_.push_back(owners[current[0]]);
        buckets_.push_back(std::move(current));
        current.clear();
        bytes = 0;
    };
    for (std::size_t k = params_.size(); k-- > 0;) {
        const at::Tensor& p = params_[k];
        bool compatible = current.empty() || (params_[current[0]].scalar_type() == p.scalar_type() &&
                                              params_[current[0]].device() == p.device() &&
                                              (owners.empty() || owners[current[0]] == owners[k]));
        std::size_t size = static_cast<std::size_t>(p.numel()) * p.element_size();
        if (!current.empty() && (!compatible || bytes + size > options.bucket_bytes)) close_bucket();
        current.push_back(k);
        bytes += size;
    }
    if (!current.empty()) close_bucket();
}

GradReducer::~GradReducer() {
    if (!overlap_) return;
    for (auto& p : params_) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
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

// Non-sharded: copies into the existing gradients (a new one is a clone, so that one view does not
// keep the whole bucket alive). ZeRO-2: the owner's gradients become views of `flat`, which holds
// only its own parameters.
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
            p.mutable_grad() = sharded() ? averaged : averaged.clone();
    }
}

void GradReducer::launch(std::size_t b) {
    flats_[b] = pack(buckets_[b]);
    if (!sharded()) {
        works_[b] = group_.all_reduce_sum_async(flats_[b]);
        return;
    }
    // ZeRO-2: the flat copy is all this rank needs; the owner gets the sum back in reduce().
    for (std::size_t k : buckets_[b]) params_[k].mutable_grad() = at::Tensor();
    works_[b] = group_.reduce_sum_async(flats_[b], bucket_owner_[b]);
}

// ZeRO-2, from the hooks: drops the flat copies of other ranks' buckets whose reduce has finished,
// in launch order (stops at the first one still in flight).
void GradReducer::release_finished() {
    for (; next_release_ < next_launch_; ++next_release_) {
        const std::size_t b = next_release_;
        if (bucket_owner_[b] == group_.rank()) continue;  // kept: this rank's own gradients
        if (!works_[b]->ready()) break;
        works_[b].reset();
        flats_[b] = at::Tensor();
        ++released_early_;
    }
}

void GradReducer::reset_round() {
    armed_ = false;
    next_launch_ = 0;
    next_release_ = 0;
    released_early_ = 0;
    std::fill(fired_.begin(), fired_.end(), 0);
    for (std::size_t b = 0; b < remaining_.size(); ++b) remaining_[b] = buckets_[b].size();
    flats_.assign(buckets_.size(), at::Tensor());
    works_.clear();
    works_.resize(buckets_.size());
    twice_.clear();
    hook_launches_ = 0;
}

namespace {

struct ReadyHook final : torch::autograd::PostAccumulateGradHook {
    explicit ReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
    void operator()(const torch::autograd::Variable&) override { fn_(); }
    std::function<void()> fn_;
};

}  // namespace

void GradReducer::enable_overlap() {
    if (group_.world_size() <= 1 || overlap_) return;
    overlap_ = true;
    bucket_of_.assign(params_.size(), 0);
    for (std::size_t b = 0; b < buckets_.size(); ++b)
        for (std::size_t k : buckets_[b]) bucket_of_[k] = b;
    fired_.assign(params_.size(), 0);
    remaining_.assign(buckets_.size(), 0);
    reset_round();
    for (std::size_t k = 0; k < params_.size(); ++k)
        torch::autograd::impl::set_post_acc_grad_hooks(
            params_[k], std::make_unique<ReadyHook>([this, k] { on_grad_ready(k); }));
}

void GradReducer::arm() {
    if (!overlap_) return;
    std::lock_guard lock(mutex_);
    armed_ = true;
}

void GradReducer::on_grad_ready(std::size_t k) {
    std::lock_guard lock(mutex_);
    if (!armed_) return;  // a micro-step before the last: gradients only accumulate
    if (fired_[k]++ > 0) {
        if (twice_.empty()) twice_ = std::to_string(k);
        return;
    }
    --remaining_[bucket_of_[k]];
    // Launch in bucket order only, so that every rank issues the same collectives in the same order.
    while (next_launch_ < buckets_.size() && remaining_[next_launch_] == 0) {
        launch(next_launch_++);
        ++hook_launches_;
    }
    if (sharded()) release_finished();
}

void GradReducer::reduce() {
    if (group_.world_size() <= 1) return;
    std::string twice;
    {
        std::lock_guard lock(mutex_);
        if (!armed_) {  // no overlap this round: everything is launched now
            next_launch_ = 0;
            flats_.assign(buckets_.size(), at::Tensor());
            works_.clear();
            works_.resize(buckets_.size());
            released_early_ = 0;
        }
        armed_ = false;  // a late hook must not launch anything now
        while (next_launch_ < buckets_.size()) launch(next_launch_++);
        twice = twice_;
        last_overlapped_ = hook_launches_;
        last_released_early_ = released_early_;
    }
    at::NoGradGuard no_grad;
    const long n_ranks = group_.world_size();
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
        if (!works_[b]) continue;  // ZeRO-2: another rank's bucket, already released
        works_[b]->wait();
        if (sharded() && bucket_owner_[b] != group_.rank()) {
            flats_[b] = at::Tensor();  // the owner has the sum; nothing of it stays here
            continue;
        }
        long grads = flats_[b].numel() - static_cast<long>(buckets_[b].size());
        flats_[b].slice(0, 0, grads).div_(n_ranks);
        unpack(buckets_[b], flats_[b]);
    }
    if (overlap_) reset_round();
    DTUNE_CHECK(twice.empty(), "dist: the gradient of parameter #", twice,
                " was accumulated twice in one backward, after its bucket's all-reduce had started; ",
                "set DTUNE_DDP_OVERLAP=0 to reduce after backward instead");
}

void all_reduce_gradients_flat(Group& group, const std::vector<at::Tensor>& params,
                               std::size_t bucket_bytes) {
    if (group.world_size() <= 1) return;
    at::NoGradGuard no_grad;
    const double inv = 1.0 / group.world_size();
    std::size_t k = 0;
    while (k < params.size()) {
        // One bucket: consecutive parameters of one dtype and device, up to bucket_bytes.
        std::vector<std::size_t> bucket{k};
        std::size_t bytes = static_cast<std::size_t>(params[k].numel()) * params[k].element_size();
        for (++k; k < params.size(); ++k) {
            const at::Tensor& p = params[k];
            const std::size_t size = static_cast<std::size_t>(p.numel()) * p.element_size();
            if (p.scalar_type() != params[bucket[0]].scalar_type() ||
                p.device() != params[bucket[0]].device() || bytes + size > bucket_bytes)
                break;
            bucket.push_back(k);
            bytes += size;
        }
        std::vector<at::Tensor> parts;
        for (std::size_t j : bucket) {
            const at::Tensor& p = params[j];
            parts.push_back(p.grad().defined() ? p.grad().detach().reshape({-1}).to(p.scalar_type())
                                               : at::zeros({p.numel()}, p.options()));
        }
        at::Tensor flat = at::cat(parts);  // [sum numel]
        group.all_reduce_sum_(flat);
        flat.mul_(inv);
        int64_t offset = 0;
        for (std::size_t j : bucket) {
            const at::Tensor& p = params[j];
            if (p.grad().defined()) p.grad().copy_(flat.slice(0, offset, offset + p.numel()).view(p.sizes()));
            offset += p.numel();
        }
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

ZeroPartition::ZeroPartition(const std::vector<at::Tensor>& params, int world_size, ZeroLayout layout)
    : owner_(params.size(), 0) {
    DTUNE_CHECK(world_size >= 1, "ZeroPartition: world size ", world_size, " must be at least 1");
    if (layout == ZeroLayout::kContiguous) {
        assign_contiguous(params, world_size);
        return;
    }
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

// Rank r takes the parameters whose midpoint (in cumulative elements) falls in the r-th
// world_size-th of the total; a rank moves on early when exactly one parameter per remaining rank
// is left, and never before it has one.
void ZeroPartition::assign_contiguous(const std::vector<at::Tensor>& params, int world_size) {
    double total = 0;
    for (const auto& p : params) total += static_cast<double>(p.numel());
    const double share = total / world_size;
    double prefix = 0;
    int rank = 0;
    std::size_t in_rank = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
        const double n = static_cast<double>(params[i].numel());
        const std::size_t left = params.size() - i;  // this one included
        const auto later_ranks = static_cast<std::size_t>(world_size - 1 - rank);
        if (rank < world_size - 1 && in_rank > 0 &&
            (prefix + n / 2 > share * (rank + 1) || left <= later_ranks)) {
            ++rank;
            in_rank = 0;
        }
        owner_[i] = rank;
        ++in_rank;
        prefix += n;
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
