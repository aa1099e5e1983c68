// ZeRO-3 engine: flat sharded units, gather/release around each unit, reduce-scatter of each
// unit's gradients once they are all ready (see zero3.h).
#include "dist/zero3.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <functional>

#include "core/error.h"
#include "dist/ready_hook.h"

namespace dtune::dist {
namespace {

// Gives a released storage its bytes back (same StorageImpl: every view of it sees the new bytes).
void allocate_storage(const at::Tensor& flat) {
    c10::StorageImpl* impl = flat.storage().unsafeGetStorageImpl();
    const auto nbytes = static_cast<std::size_t>(flat.numel()) * flat.element_size();
    if (impl->nbytes() == nbytes) return;
    c10::Allocator* allocator = impl->allocator();
    if (!allocator) allocator = c10::GetAllocator(flat.device().type());
    impl->set_data_ptr_noswap(allocator->allocate(nbytes));
    impl->set_nbytes(nbytes);
}

void free_storage(const at::Tensor& flat) {
    c10::StorageImpl* impl = flat.storage().unsafeGetStorageImpl();
    impl->set_data_ptr_noswap(at::DataPtr(nullptr, flat.device()));
    impl->set_nbytes(0);
}

}  // namespace

Zero3Engine::Zero3Engine(Group& group, std::vector<Zero3Unit> units, Zero3Options options)
    : group_(group), options_(options) {
    at::NoGradGuard no_grad;
    const int64_t n_ranks = group_.world_size();
    const int64_t rank = group_.rank();
    units_.reserve(units.size());
    for (auto& spec : units) {
        DTUNE_CHECK(!spec.params.empty(), "ZeRO-3: unit ", spec.name, " has no parameters");
        DTUNE_CHECK(spec.names.size() == spec.params.size(), "ZeRO-3: unit ", spec.name, " has ",
                    spec.names.size(), " names for ", spec.params.size(), " parameters");
        UnitState s;
        const at::Tensor& first = spec.params.front();
        for (std::size_t k = 0; k < spec.params.size(); ++k) {
            const at::Tensor& p = spec.params[k];
            DTUNE_CHECK_AS(UsageError, p.scalar_type() == first.scalar_type() && p.device() == first.device(),
                           "ZeRO-3: parameter ", spec.names[k], " is ", p.scalar_type(), " on ", p.device(),
                           " but ", spec.names[0], " of the same unit (", spec.name, ") is ",
                           first.scalar_type(), " on ", first.device(),
                           "; ZeRO-3 needs one dtype per block: load the model in one dtype");
            s.offsets.push_back(s.numel);
            s.numel += p.numel();
        }
        s.shard = (s.numel + n_ranks - 1) / n_ranks;
        s.flat = at::zeros({s.shard * n_ranks}, first.options().requires_grad(false));
        for (std::size_t k = 0; k < spec.params.size(); ++k) {
            at::Tensor& p = spec.params[k];
            at::Tensor view = s.flat.narrow(0, s.offsets[k], p.numel());
            view.copy_(p.detach().reshape({-1}));
            // Same TensorImpl (autograd, optimizer and module keep pointing at it), new data.
            p.set_data(view.view(p.sizes()));
        }
        s.shard_values = s.flat.narrow(0, rank * s.shard, s.shard).clone();
        s.gathered = true;
        s.spec = std::move(spec);
        units_.push_back(std::move(s));
    }
    for (std::size_t u = 0; u < units_.size(); ++u) {
        UnitState& s = units_[u];
        const int64_t lo = rank * s.shard, hi = lo + s.shard;
        for (std::size_t k = 0; k < s.spec.params.size(); ++k) {
            const int64_t a = s.offsets[k], b = a + s.spec.params[k].numel();
            const int64_t from = std::max(a, lo), to = std::min(b, hi);
            if (from < to)
                slices_.push_back({s.spec.names[k], u, k, from - a, to - a,
                                   s.shard_values.narrow(0, from - lo, to - from)});
            if (s.spec.params[k].requires_grad())
                torch::autograd::impl::set_post_acc_grad_hooks(
                    s.spec.params[k], std::make_unique<ReadyHook>([this, u] { on_grad_ready(u); }));
        }
        release(u);
    }
    reset_backward();
}

Zero3Engine::~Zero3Engine() {
    for (auto& s : units_)
        for (auto& p : s.spec.params)
            if (p.requires_grad()) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
}

void Zero3Engine::gather(std::size_t u) {
    UnitState& s = units_[u];
    if (s.gathered) return;
    if (before_gather_) before_gather_(u);
    at::NoGradGuard no_grad;
    allocate_storage(s.flat);
    group_.all_gather_into_async(s.flat, s.shard_values)->wait();
    s.gathered = true;
    ++gathers_;
}

void Zero3Engine::release(std::size_t u) {
    UnitState& s = units_[u];
    if (!s.gathered || hold_all_) return;
    free_storage(s.flat);
    s.gathered = false;
}

void Zero3Engine::reset_backward() {
    for (auto& s : units_) {
        s.pending = 0;
        for (const auto& p : s.spec.params) s.pending += p.requires_grad() ? 1 : 0;
        s.ready = s.launched = false;
    }
    next_launch_ = 0;
}

void Zero3Engine::begin_forward() {
    std::lock_guard lock(mutex_);
    DTUNE_CHECK(in_flight_.empty(), "ZeRO-3: begin_forward() before finish_backward() of the last backward");
    order_.clear();
    for (auto& s : units_) s.ran = false;
    reset_backward();
    for (std::size_t u = 0; u < units_.size(); ++u) {
        if (!units_[u].spec.whole_step) continue;
        gather(u);
        units_[u].ran = true;
        order_.push_back(u);
    }
}

void Zero3Engine::before_unit(std::size_t u, bool recompute) {
    std::lock_guard lock(mutex_);
    if (!recompute && !units_[u].ran) {
        units_[u].ran = true;
        order_.push_back(u);
    }
    gather(u);
}

void Zero3Engine::after_unit(std::size_t u, bool recompute, const std::vector<at::Tensor>& outputs) {
    std::lock_guard lock(mutex_);
    if (hold_all_ || recompute) return;  // recomputed: stays until its gradients are reduced
    if (at::GradMode::is_enabled()) {
        // Gathered again when the first output's gradient arrives, before the unit's own backward.
        for (const at::Tensor& out : outputs)
            if (out.defined() && out.requires_grad())
                out.register_hook([this, u](const at::Tensor&) {
                    std::lock_guard relock(mutex_);
                    if (!units_[u].launched) gather(u);
                });
    }
    if (options_.reshard_after_forward && !units_[u].spec.whole_step) release(u);
}

void Zero3Engine::on_grad_ready(std::size_t u) {
    std::lock_guard lock(mutex_);
    UnitState& s = units_[u];
    if (s.pending > 0 && --s.pending == 0) s.ready = true;
    launch_ready();
}

// Strictly in reverse forward order: a unit that is ready early waits for the ones before it, so
// the collectives' sequence is the same on every rank.
void Zero3Engine::launch_ready() {
    while (next_launch_ < order_.size()) {
        const std::size_t u = order_[order_.size() - 1 - next_launch_];
        if (!units_[u].ready) break;
        launch(u);
        ++next_launch_;
    }
}

void Zero3Engine::launch(std::size_t u) {
    UnitState& s = units_[u];
    if (s.launched) return;
    s.launched = true;
    at::NoGradGuard no_grad;
    const int64_t n_ranks = group_.world_size();
    at::Tensor in = at::zeros({s.shard * n_ranks}, s.shard_values.options());  // [N * S]
    for (std::size_t k = 0; k < s.spec.params.size(); ++k) {
        at::Tensor& p = s.spec.params[k];
        if (p.grad().defined()) in.narrow(0, s.offsets[k], p.numel()).copy_(p.grad().reshape({-1}));
        p.mutable_grad() = at::Tensor();  // the full gradient is freed now, not at the step
    }
    release(u);  // its backward is over: every gradient is in
    at::Tensor out = at::empty({s.shard}, s.shard_values.options());
    auto work = group_.reduce_scatter_sum_async(out, in);
    in_flight_.push_back({u, std::move(in), std::move(out), std::move(work)});
}

void Zero3Engine::finish_backward() {
    std::lock_guard lock(mutex_);
    // What the hooks did not launch: the rest of the forward order, then units that did not run.
    for (; next_launch_ < order_.size(); ++next_launch_) launch(order_[order_.size() - 1 - next_launch_]);
    for (std::size_t u = 0; u < units_.size(); ++u) launch(u);
    at::NoGradGuard no_grad;
    const double inv = 1.0 / static_cast<double>(group_.world_size());
    for (auto& f : in_flight_) {
        f.work->wait();
        UnitState& s = units_[f.unit];
        f.out.mul_(inv);
        if (s.shard_grad.defined())
            s.shard_grad.add_(f.out);
        else
            s.shard_grad = f.out;
    }
    in_flight_.clear();
    for (std::size_t u = 0; u < units_.size(); ++u) release(u);
    for (auto& slice : slices_) {
        const UnitState& s = units_[slice.unit];
        const int64_t lo = group_.rank() * s.shard;
        slice.value.mutable_grad() =
            s.shard_grad.narrow(0, s.offsets[slice.param] + slice.begin - lo, slice.end - slice.begin);
    }
    reset_backward();
}

void Zero3Engine::zero_grad() {
    std::lock_guard lock(mutex_);
    for (auto& s : units_) s.shard_grad = at::Tensor();
    for (auto& slice : slices_) slice.value.mutable_grad() = at::Tensor();
}

std::vector<std::size_t> Zero3Engine::forward_order() const {
    return order_;
}

void Zero3Engine::gather_all() {
    std::lock_guard lock(mutex_);
    for (std::size_t u = 0; u < units_.size(); ++u) gather(u);
    hold_all_ = true;
}

void Zero3Engine::release_all() {
    std::lock_guard lock(mutex_);
    hold_all_ = false;
    for (std::size_t u = 0; u < units_.size(); ++u) release(u);
}

void Zero3Engine::reshard_from_full() {
    std::lock_guard lock(mutex_);
    at::NoGradGuard no_grad;
    for (auto& s : units_) {
        DTUNE_CHECK(s.gathered, "ZeRO-3: reshard_from_full() needs gathered weights (gather_all() first)");
        s.shard_values.copy_(s.flat.narrow(0, group_.rank() * s.shard, s.shard));
    }
}

int64_t Zero3Engine::resident_parameter_bytes() const {
    int64_t bytes = 0;
    for (const auto& s : units_)
        bytes += static_cast<int64_t>(s.flat.storage().nbytes() + s.shard_values.storage().nbytes());
    return bytes;
}

int64_t Zero3Engine::shard_bytes() const {
    int64_t bytes = 0;
    for (const auto& s : units_) bytes += static_cast<int64_t>(s.shard_values.storage().nbytes());
    return bytes;
}

int64_t Zero3Engine::full_parameter_bytes() const {
    int64_t bytes = 0;
    for (const auto& s : units_) bytes += s.numel * static_cast<int64_t>(s.flat.element_size());
    return bytes;
}

}  // namespace dtune::dist
