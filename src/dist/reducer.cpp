// Bucketed gradient all-reduce (ZeRO-2: reduce to the owner), parameter broadcast/check and the
// ZeRO partition (see reducer.h).
#include "dist/reducer.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/_foreach_div.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <numeric>

#include "core/error.h"
#include "dist/ready_hook.h"

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

    flats_.assign(buckets_.size(), at::Tensor());
    staged_.assign(buckets_.size(), 0);
    slot_bucket_.assign(options.staging_slots, -1);
    slots_.assign(options.staging_slots, at::Tensor());
    if (group_.world_size() <= 1) return;  // one process: autograd keeps its own gradients
    owns_ = true;
    bucket_of_.assign(params_.size(), 0);
    offset_.assign(params_.size(), 0);
    views_.assign(params_.size(), at::Tensor());
    bucket_numel_.assign(buckets_.size(), 0);
    for (std::size_t b = 0; b < buckets_.size(); ++b)
        for (std::size_t k : buckets_[b]) {
            bucket_of_[k] = b;
            offset_[k] = bucket_numel_[b];
            bucket_numel_[b] += params_[k].numel();
        }
    for (std::size_t b = 0; b < buckets_.size(); ++b)
        if (!persistent(b)) {
            const long numel = bucket_numel_[b] + static_cast<long>(buckets_[b].size());
            slot_bytes_ =
                std::max(slot_bytes_, numel * static_cast<long>(params_[buckets_[b][0]].element_size()));
        }
    used_.assign(params_.size(), 0);
    fired_.assign(params_.size(), 0);
    remaining_.assign(buckets_.size(), 0);
    launched_.assign(buckets_.size(), 0);
    reset_round();
    {
        at::NoGradGuard no_grad;
        for (std::size_t b = 0; b < buckets_.size(); ++b)
            if (persistent(b)) materialise(b);
    }
    // Every parameter: a post-accumulate hook (used flags; launches with overlap). ZeRO-2, other
    // ranks' parameters: a pre-accumulate hook that allocates the bucket before autograd would
    // allocate a gradient of its own.
    for (std::size_t k = 0; k < params_.size(); ++k) {
        if (!params_[k].requires_grad()) continue;  // never gets a gradient: counts as unused
        torch::autograd::impl::set_post_acc_grad_hooks(
            params_[k], std::make_unique<ReadyHook>([this, k] { on_grad_ready(k); }));
        if (!persistent(bucket_of_[k]))
            pre_hooks_.emplace_back(
                k, params_[k].register_hook([this, k](const at::Tensor&) { on_grad_arriving(k); }));
    }
}

GradReducer::~GradReducer() {
    if (owns_) remove_hooks();
}

void GradReducer::remove_hooks() {
    for (auto& p : params_)
        if (p.requires_grad()) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
    for (const auto& [k, position] : pre_hooks_) params_[k].remove_hook(position);
    pre_hooks_.clear();
}

// Allocates bucket b ([numel + n] zeros: the gradients, then the used flags) and makes it the grad
// of each of its parameters that has none (a grad a caller set is adopted at launch instead).
void GradReducer::materialise(std::size_t b) {
    const at::Tensor& first = params_[buckets_[b][0]];
    const long flags = static_cast<long>(buckets_[b].size());
    flats_[b] = at::zeros({bucket_numel_[b] + flags}, first.options());
    install_views(b);
}

// ZeRO-2, another rank's bucket in the armed backward: a free staging slot, else the slot of the
// earliest launched bucket once its reduce has finished (a wait on the device stream); fresh memory
// when every slot holds a bucket still filling. Zeroed, then the views installed as materialise().
void GradReducer::stage(std::size_t b) {
    long pick = -1;
    for (std::size_t s = 0; s < slots_.size() && pick < 0; ++s)
        if (slot_bucket_[s] < 0) pick = static_cast<long>(s);
    if (pick < 0) {
        for (std::size_t s = 0; s < slots_.size(); ++s) {
            const long held = slot_bucket_[s];
            if (launched_[static_cast<std::size_t>(held)] &&
                (pick < 0 || held < slot_bucket_[static_cast<std::size_t>(pick)]))
                pick = static_cast<long>(s);
        }
        if (pick < 0) return materialise(b);
        drop_foreign(static_cast<std::size_t>(slot_bucket_[static_cast<std::size_t>(pick)]));
        ++released_early_;
    }
    const auto slot = static_cast<std::size_t>(pick);
    const at::Tensor& first = params_[buckets_[b][0]];
    if (!slots_[slot].defined()) slots_[slot] = at::empty({slot_bytes_}, first.options().dtype(at::kByte));
    const long numel = bucket_numel_[b] + static_cast<long>(buckets_[b].size());
    flats_[b] =
        slots_[slot].narrow(0, 0, numel * static_cast<long>(first.element_size())).view(first.scalar_type());
    flats_[b].zero_();
    slot_bucket_[slot] = static_cast<long>(b);
    staged_[b] = 1;
    install_views(b);
}

// ZeRO-2: another rank's bucket leaves this rank: its reduce waited for (on the device stream), its
// memory (fresh, or a staging slot) no longer referenced here. Its parameters' grads went at launch.
void GradReducer::drop_foreign(std::size_t b) {
    if (works_[b]) {
        works_[b]->wait();
        works_[b].reset();
    }
    flats_[b] = at::Tensor();
    for (std::size_t k : buckets_[b]) views_[k] = at::Tensor();
    if (staged_[b])
        for (auto& held : slot_bucket_)
            if (held == static_cast<long>(b)) held = -1;
    staged_[b] = 0;
}

std::size_t GradReducer::staging_bytes() const {
    std::size_t bytes = 0;
    for (const auto& s : slots_)
        if (s.defined()) bytes += static_cast<std::size_t>(s.numel());
    return bytes;
}

void GradReducer::install_views(std::size_t b) {
    for (std::size_t k : buckets_[b]) {
        at::Tensor& p = params_[k];
        views_[k] = flats_[b].slice(0, offset_[k], offset_[k] + p.numel()).view(p.sizes());
        if (!p.grad().defined()) p.mutable_grad() = views_[k];
    }
}

// Makes parameter k's grad its view again: a grad a caller set (or autograd allocated after the
// caller dropped ours) is copied in and counts as used; no grad at all leaves a zero view.
void GradReducer::adopt_grad(std::size_t k) {
    at::Tensor& p = params_[k];
    const at::Tensor& g = p.grad();
    if (g.defined() && g.is_same(views_[k])) return;
    if (g.defined()) {
        views_[k].copy_(g);
        used_[k] = 1;
    } else {
        views_[k].zero_();
    }
    p.mutable_grad() = views_[k];
}

// The used flags of bucket b's parameters into `flags` ([n]): a fill in the common cases, else one
// small upload (pageable memory: staged at once, so the host tensor may go; no stream
// synchronisation).
void GradReducer::fill_used_flags(std::size_t b, at::Tensor& flags) {
    const auto& bucket = buckets_[b];
    bool all = true, none = true;
    for (std::size_t k : bucket) {
        all = all && used_[k];
        none = none && !used_[k];
    }
    if (all || none) {
        flags.fill_(all ? 1 : 0);
        return;
    }
    auto host = at::empty({static_cast<long>(bucket.size())}, at::TensorOptions().dtype(at::kFloat));
    float* h = host.data_ptr<float>();
    for (std::size_t j = 0; j < bucket.size(); ++j) h[j] = used_[bucket[j]] ? 1.0f : 0.0f;
    flags.copy_(host, /*non_blocking=*/true);
}

// Direct: the bucket's gradients as they stand (zeros for a parameter without one, made its grad so
// that the sum lands there) and its flags, in one grouped all-reduce.
void GradReducer::launch_direct(std::size_t b) {
    std::vector<at::Tensor> tensors;
    tensors.reserve(buckets_[b].size() + 1);
    for (std::size_t k : buckets_[b]) {
        at::Tensor& p = params_[k];
        at::Tensor g = p.grad();
        if (!g.defined()) {
            g = at::zeros_like(p, at::MemoryFormat::Contiguous);
        } else {
            used_[k] = 1;  // (a grad a caller set counts, as adopt_grad does)
            const auto format = g.suggest_memory_format();
            if (g.scalar_type() != p.scalar_type() || !g.is_contiguous(format))
                g = g.to(p.scalar_type()).contiguous(format);
        }
        if (!g.is_same(p.grad())) p.mutable_grad() = g;
        tensors.push_back(g);
    }
    fill_used_flags(b, flags_[b]);
    tensors.push_back(flags_[b]);
    launched_[b] = 1;
    if (sharded()) {  // ZeRO-2: this rank's own bucket, reduced to it (the others send their staged views)
        works_[b] = group_.reduce_coalesced_async(tensors, group_.rank(), /*average=*/true, averaged_);
        return;
    }
    works_[b] = group_.all_reduce_coalesced_async(tensors, /*average=*/true);
    averaged_ = works_[b] != nullptr;
    if (!averaged_) works_[b] = group_.all_reduce_coalesced_async(tensors, /*average=*/false);
}

void GradReducer::launch(std::size_t b) {
    at::NoGradGuard no_grad;
    if (direct_ && persistent(b)) return launch_direct(b);
    if (!flats_[b].defined()) {  // ZeRO-2: no gradient of this bucket arrived here
        if (armed_ && !persistent(b))
            stage(b);
        else
            materialise(b);
    }
    const auto& bucket = buckets_[b];
    for (std::size_t k : bucket) adopt_grad(k);
    at::Tensor flags = flats_[b].slice(0, bucket_numel_[b]);  // behind the gradients
    fill_used_flags(b, flags);
    launched_[b] = 1;
    if (!sharded()) {
        // NCCL averages in the collective (the used flags become count / N: still 0 exactly when
        // no rank used the parameter); Gloo sums, and reduce() divides.
        works_[b] = group_.all_reduce_avg_async(flats_[b]);
        averaged_ = works_[b] != nullptr;
        if (!averaged_) works_[b] = group_.all_reduce_sum_async(flats_[b]);
        return;
    }
    // ZeRO-2: another rank's gradients leave the parameters now; the owner keeps its views.
    if (!persistent(b))
        for (std::size_t k : bucket) params_[k].mutable_grad() = at::Tensor();
    if (direct_ && !persistent(b)) {
        // The owner reduces its gradients where autograd left them, one tensor each with the flags
        // last (launch_direct): the same list here, as views of the staged bucket.
        std::vector<at::Tensor> tensors;
        tensors.reserve(bucket.size() + 1);
        for (std::size_t k : bucket) tensors.push_back(views_[k]);
        tensors.push_back(flags);
        bool averaged = false;
        works_[b] = group_.reduce_coalesced_async(tensors, bucket_owner_[b], /*average=*/true, averaged);
        return;
    }
    works_[b] = group_.reduce_sum_async(flats_[b], bucket_owner_[b]);
}

// Caller holds mutex_ (or no hook can run yet).
void GradReducer::reset_round() {
    armed_ = false;
    next_launch_ = 0;
    released_early_ = 0;
    std::fill(slot_bucket_.begin(), slot_bucket_.end(), -1);
    std::fill(staged_.begin(), staged_.end(), 0);
    std::fill(used_.begin(), used_.end(), 0);
    std::fill(fired_.begin(), fired_.end(), 0);
    std::fill(launched_.begin(), launched_.end(), 0);
    for (std::size_t b = 0; b < remaining_.size(); ++b) remaining_[b] = buckets_[b].size();
    works_.clear();
    works_.resize(buckets_.size());
    twice_.clear();
    hook_launches_ = 0;
}

void GradReducer::enable_overlap() {
    if (!owns_ || overlap_) return;
    std::lock_guard lock(mutex_);
    overlap_ = true;
}

void GradReducer::arm() {
    if (!overlap_) return;
    std::lock_guard lock(mutex_);
    armed_ = true;
}

void GradReducer::on_grad_arriving(std::size_t k) {
    std::lock_guard lock(mutex_);
    const std::size_t b = bucket_of_[k];
    if (flats_[b].defined() || launched_[b]) return;
    at::NoGradGuard no_grad;
    if (armed_)
        stage(b);
    else
        materialise(b);
}

void GradReducer::on_grad_ready(std::size_t k) {
    std::lock_guard lock(mutex_);
    used_[k] = 1;
    if (!armed_) return;  // no overlap, or a micro-step before the last: gradients only accumulate
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
}

// After the waits: a parameter no rank used loses its grad. Read back only for kept buckets where
// this rank did not use every parameter (elsewhere its own flag makes every count >= 1).
void GradReducer::resolve_unused() {
    last_host_reads_ = 0;
    std::vector<std::size_t> unresolved;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
        if (!persistent(b)) continue;
        for (std::size_t k : buckets_[b])
            if (!used_[k]) {
                unresolved.push_back(b);
                break;
            }
    }
    if (unresolved.empty()) return;
    std::vector<at::Tensor> parts;
    parts.reserve(unresolved.size());
    for (std::size_t b : unresolved)
        parts.push_back((direct_ ? flags_[b] : flats_[b].slice(0, bucket_numel_[b])).to(at::kFloat));
    const at::Tensor counts = at::cat(parts).to(at::kCPU).contiguous();  // [sum n] ranks that used each
    last_host_reads_ = 1;
    const float* count = counts.data_ptr<float>();
    for (std::size_t b : unresolved)
        for (std::size_t k : buckets_[b])
            if (*count++ == 0) params_[k].mutable_grad() = at::Tensor();
}

void GradReducer::reduce() {
    if (!owns_) return;
    std::string twice;
    {
        std::lock_guard lock(mutex_);
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
        if (!persistent(b)) {      // the owner has the sum; nothing of it stays here
            drop_foreign(b);
            continue;
        }
        works_[b]->wait();
        works_[b].reset();
        if (averaged_) continue;
        if (!direct_) {
            flats_[b].slice(0, 0, bucket_numel_[b]).div_(n_ranks);  // the mean, in place
            continue;
        }
        std::vector<at::Tensor> grads;
        grads.reserve(buckets_[b].size());
        for (std::size_t k : buckets_[b]) grads.push_back(params_[k].grad());
        at::_foreach_div_(grads, static_cast<double>(n_ranks));
    }
    resolve_unused();
    {
        std::lock_guard lock(mutex_);
        reset_round();
    }
    DTUNE_CHECK(twice.empty(), "dist: the gradient of parameter #", twice,
                " was accumulated twice in one backward, after its bucket's all-reduce had started; ",
                "set DTUNE_DDP_OVERLAP=0 to reduce after backward instead");
}

void GradReducer::set_copy_in(bool on) {
    if (on) set_direct(false);
    std::lock_guard lock(mutex_);
    copy_in_ = on && !sharded();
}

void GradReducer::set_direct(bool on) {
    if (!owns_ || on == direct_) return;
    std::lock_guard lock(mutex_);
    at::NoGradGuard no_grad;
    direct_ = on;
    if (!on) {
        flags_.clear();
        for (std::size_t b = 0; b < buckets_.size(); ++b)
            if (persistent(b)) materialise(b);
        return;
    }
    copy_in_ = false;
    flags_.assign(buckets_.size(), at::Tensor());
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
        if (!persistent(b)) continue;  // ZeRO-2: other ranks' buckets stay staged (one flat each)
        const at::Tensor& first = params_[buckets_[b][0]];
        flags_[b] = at::zeros({static_cast<long>(buckets_[b].size())}, first.options());
        for (std::size_t k : buckets_[b]) {
            if (params_[k].grad().defined() && params_[k].grad().is_same(views_[k]))
                params_[k].mutable_grad() = at::Tensor();
            views_[k] = at::Tensor();
        }
        flats_[b] = at::Tensor();
    }
}

void GradReducer::zero_grad() {
    if (!owns_) return;
    std::lock_guard lock(mutex_);
    at::NoGradGuard no_grad;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
        if (persistent(b) && (copy_in_ || direct_)) {  // launch() overwrites every view, or uses the grads
            for (std::size_t k : buckets_[b]) params_[k].mutable_grad() = at::Tensor();
            continue;
        }
        if (persistent(b)) {
            flats_[b].zero_();
            for (std::size_t k : buckets_[b]) params_[k].mutable_grad() = views_[k];
            continue;
        }
        flats_[b] = at::Tensor();  // left over from a round that never reached reduce()
        for (std::size_t k : buckets_[b]) {
            views_[k] = at::Tensor();
            params_[k].mutable_grad() = at::Tensor();
        }
    }
    reset_round();
}

void GradReducer::abandon_round() {
    if (!owns_) return;
    std::lock_guard lock(mutex_);
    const std::vector<char> used = used_;
    // A staging slot holds what the broken-off capture recorded, never computed: gone, as at launch.
    for (std::size_t b = 0; b < buckets_.size(); ++b)
        if (staged_[b]) {
            flats_[b] = at::Tensor();
            for (std::size_t k : buckets_[b]) {
                views_[k] = at::Tensor();
                params_[k].mutable_grad() = at::Tensor();
            }
        }
    reset_round();
    used_ = used;
    for (std::size_t k = 0; k < params_.size(); ++k) {
        if (direct_) {  // one micro-step a round, as with copy-in: no grad, as zero_grad() leaves it
            params_[k].mutable_grad() = at::Tensor();
            continue;
        }
        if (!views_[k].defined() || params_[k].grad().is_same(views_[k])) continue;
        // A grad the broken-off capture made was never computed: the view again, or with copy-in
        // (one micro-step a round: no sums to keep) no grad, as zero_grad() leaves it.
        params_[k].mutable_grad() = copy_in_ ? at::Tensor() : views_[k];
    }
}

void GradReducer::release_gradients() {
    if (!owns_) return;
    std::lock_guard lock(mutex_);
    remove_hooks();
    owns_ = false;
    overlap_ = false;
    flats_.assign(buckets_.size(), at::Tensor());
    views_.assign(params_.size(), at::Tensor());
    flags_.clear();
    std::fill(slots_.begin(), slots_.end(), at::Tensor());
    direct_ = false;
    reset_round();
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

namespace {

// One broadcast of params[bucket] from `root`. A lone contiguous parameter goes in place; anything
// else through a flat tensor: `staging` when it is large enough (same dtype and device), else a
// temporary. Stream order makes reuse safe on NCCL: Pending::wait() queues the rest of the
// current stream behind the collective, and the next pack into the staging tensor is queued there.
void broadcast_bucket(Group& group, const std::vector<at::Tensor>& params,
                      const std::vector<std::size_t>& bucket, int root, at::Tensor* staging) {
    const at::Tensor& first = params[bucket[0]];
    if (bucket.size() == 1 && first.is_contiguous()) {
        at::Tensor t = first.detach();
        group.broadcast_(t, root);
        return;
    }
    long total = 0;
    for (std::size_t k : bucket) total += params[k].numel();
    at::Tensor flat;
    if (staging && staging->defined() && staging->numel() >= total)
        flat = staging->slice(0, 0, total);
    else
        flat = at::empty({total}, first.options());
    std::vector<at::Tensor> parts, targets;
    parts.reserve(bucket.size());
    targets.reserve(bucket.size());
    long offset = 0;
    for (std::size_t k : bucket) {
        const at::Tensor& p = params[k];
        parts.push_back(flat.slice(0, offset, offset + p.numel()).view(p.sizes()));
        targets.push_back(p.detach());
        offset += p.numel();
    }
    if (group.rank() == root) at::_foreach_copy_(parts, targets);  // pack
    group.broadcast_(flat, root);
    if (group.rank() != root) at::_foreach_copy_(targets, parts);  // unpack
}

// Consecutive runs of `indices` of one dtype and device, at most `bucket_bytes` each (a larger
// parameter alone).
std::vector<std::vector<std::size_t>> runs_of(const std::vector<at::Tensor>& params,
                                              const std::vector<std::size_t>& indices,
                                              std::size_t bucket_bytes) {
    std::vector<std::vector<std::size_t>> out;
    std::vector<std::size_t> current;
    std::size_t bytes = 0;
    for (std::size_t k : indices) {
        const at::Tensor& p = params[k];
        const std::size_t size = static_cast<std::size_t>(p.numel()) * p.element_size();
        const bool compatible = current.empty() || (params[current[0]].scalar_type() == p.scalar_type() &&
                                                    params[current[0]].device() == p.device());
        if (!current.empty() && (!compatible || bytes + size > bucket_bytes)) {
            out.push_back(std::move(current));
            current.clear();
            bytes = 0;
        }
        current.push_back(k);
        bytes += size;
    }
    if (!current.empty()) out.push_back(std::move(current));
    return out;
}

}  // namespace

void broadcast_parameters(Group& group, const std::vector<at::Tensor>& params, int root,
                          std::size_t bucket_bytes) {
    if (group.world_size() <= 1) return;
    at::NoGradGuard no_grad;
    std::vector<std::size_t> all(params.size());
    std::iota(all.begin(), all.end(), 0);
    for (const auto& bucket : runs_of(params, all, bucket_bytes))
        broadcast_bucket(group, params, bucket, root, nullptr);
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

std::vector<std::vector<std::size_t>> ZeroPartition::sync_buckets(const std::vector<at::Tensor>& params,
                                                                  std::size_t bucket_bytes) const {
    DTUNE_CHECK(params.size() == owner_.size(), "ZeroPartition: ", params.size(),
                " parameters for a partition of ", owner_.size());
    const int ranks = owner_.empty() ? 0 : *std::max_element(owner_.begin(), owner_.end()) + 1;
    std::vector<std::vector<std::size_t>> out;
    for (int r = 0; r < ranks; ++r)
        for (auto& run : runs_of(params, owned_by(r), bucket_bytes)) out.push_back(std::move(run));
    return out;
}

void ZeroPartition::sync_parameters(Group& group, const std::vector<at::Tensor>& params,
                                    std::size_t bucket_bytes) {
    if (group.world_size() <= 1) return;
    at::NoGradGuard no_grad;
    for (const auto& bucket : sync_buckets(params, bucket_bytes)) {
        const at::Tensor& first = params[bucket[0]];
        at::Tensor* staging = nullptr;
        if (bucket.size() > 1) {
            for (auto& s : staging_)
                if (s.scalar_type() == first.scalar_type() && s.device() == first.device()) staging = &s;
            if (!staging) {
                // Sized once, for the largest bucket it can serve: bucket_bytes (or less when the
                // parameters of this dtype are fewer).
                long most = 0;
                for (const auto& b : sync_buckets(params, bucket_bytes)) {
                    const at::Tensor& f = params[b[0]];
                    if (b.size() < 2 || f.scalar_type() != first.scalar_type() ||
                        f.device() != first.device())
                        continue;
                    long n = 0;
                    for (std::size_t k : b) n += params[k].numel();
                    most = std::max(most, n);
                }
                staging_.push_back(at::empty({most}, first.options()));
                staging = &staging_.back();
            }
        }
        broadcast_bucket(group, params, bucket, owner_[bucket[0]], staging);
    }
}

}  // namespace dtune::dist
