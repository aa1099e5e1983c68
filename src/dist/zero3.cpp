// ZeRO-3 engine: flat sharded units, gather/release around each unit (with the next units'
// gathers issued ahead), reduce-scatter of each unit's gradients once they are all ready, shards
// optionally in host memory (see zero3.h).
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
            DTUNE_CHECK(!spec.frozen || !p.requires_grad(), "ZeRO-3: parameter ", spec.names[k],
                        " requires a gradient but its unit ", spec.name, " is frozen");
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
        const at::Tensor mine = s.flat.narrow(0, rank * s.shard, s.shard);
        if (options_.offload_params) {
            // Pinned when the device is a GPU: the copy to the device before a gather is asynchronous.
            s.shard_values =
                at::empty({s.shard}, mine.options().device(at::kCPU).pinned_memory(mine.is_cuda()));
            s.shard_values.copy_(mine);
        } else {
            s.shard_values = mine.clone();
        }
        s.gathered = true;
        if (!s.spec.whole_step) ++gathered_units_;
        s.spec = std::move(spec);
        units_.push_back(std::move(s));
    }
    for (std::size_t u = 0; u < units_.size(); ++u) {
        UnitState& s = units_[u];
        const int64_t lo = rank * s.shard, hi = lo + s.shard;
        for (std::size_t k = 0; k < s.spec.params.size(); ++k) {
            const int64_t a = s.offsets[k], b = a + s.spec.params[k].numel();
            const int64_t from = std::max(a, lo), to = std::min(b, hi);
            if (from < to && !s.spec.frozen)
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
    issue_gather(u);
    wait_gather(u);
}

void Zero3Engine::issue_gather(std::size_t u) {
    UnitState& s = units_[u];
    if (s.gathered) return;
    if (before_gather_) before_gather_(u);
    at::NoGradGuard no_grad;
    allocate_storage(s.flat);
    at::Tensor input = s.shard_values;
    if (options_.offload_params) {
        // Host -> device on the current stream; the backend orders the collective after it. The
        // host shard is next written by the optimizer step, after finish_backward's copies of the
        // gradients to the host, which this stream runs after this copy.
        s.staging = at::empty({s.shard}, s.flat.options());
        s.staging.copy_(s.shard_values, /*non_blocking=*/s.flat.is_cuda());
        input = s.staging;
    }
    s.gathering = group_.all_gather_into_async(s.flat, input);
    s.gathered = true;
    ++gathers_;
    if (!s.spec.whole_step) peak_gathered_ = std::max(peak_gathered_, ++gathered_units_);
}

void Zero3Engine::wait_gather(std::size_t u) {
    UnitState& s = units_[u];
    if (!s.gathering) return;
    const auto work = std::move(s.gathering);
    work->wait();
    s.staging = at::Tensor();
}

void Zero3Engine::use(std::size_t u, bool backward) {
    UnitState& s = units_[u];
    issue_gather(u);  // on demand (not expected, or no prefetch): ahead of the prefetched ones
    if (s.ahead) {
        s.ahead = false;
        --ahead_units_;
    }
    prefetch(u, backward);
    wait_gather(u);
}

// The window: the next `prefetch` units expected after u that need a gather (forward: not run yet
// in this micro-step; backward: ran, not reduced yet, released), in the predicted forward order or
// the reverse of this micro-step's. u not in the order: an empty window.
void Zero3Engine::prefetch(std::size_t u, bool backward) {
    if (options_.prefetch <= 0 || hold_all_) return;
    const auto depth = static_cast<std::size_t>(options_.prefetch);
    const std::vector<std::size_t>& seq = backward ? order_ : predicted_;
    std::vector<std::size_t> window;
    const auto found = std::find(seq.begin(), seq.end(), u);
    const auto n = static_cast<std::ptrdiff_t>(seq.size());
    const std::ptrdiff_t step = backward ? -1 : 1;
    // begin_forward passes the root (not in predicted_): the window starts at the first unit.
    std::ptrdiff_t i =
        found != seq.end() ? (found - seq.begin()) + step : (units_[u].spec.whole_step ? 0 : n);
    for (; i >= 0 && i < n && window.size() < depth; i += step) {
        const UnitState& s = units_[seq[static_cast<std::size_t>(i)]];
        if (s.spec.whole_step || s.launched || s.ran != backward) continue;
        if (s.gathered && !s.ahead) continue;  // in use, or kept gathered (no resharding)
        window.push_back(seq[static_cast<std::size_t>(i)]);
    }
    // Gathered ahead but no longer expected next (a misprediction): freed, gathered again if used.
    for (std::size_t v = 0; v < units_.size(); ++v)
        if (units_[v].ahead && std::find(window.begin(), window.end(), v) == window.end()) release(v);
    for (const std::size_t v : window) {
        UnitState& s = units_[v];
        if (s.gathered) continue;
        issue_gather(v);
        s.ahead = true;
        ++prefetched_;
        peak_ahead_ = std::max(peak_ahead_, ++ahead_units_);
    }
}

void Zero3Engine::release(std::size_t u) {
    UnitState& s = units_[u];
    if (!s.gathered || hold_all_) return;
    wait_gather(u);  // the collective writes the buffer until it completes
    if (s.ahead) {
        s.ahead = false;
        --ahead_units_;
    }
    free_storage(s.flat);
    s.gathered = false;
    if (!s.spec.whole_step) --gathered_units_;
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
    std::vector<std::size_t> last;
    for (const std::size_t u : order_)
        if (!units_[u].spec.whole_step) last.push_back(u);
    if (!last.empty()) predicted_ = std::move(last);
    order_.clear();
    for (auto& s : units_) s.ran = false;
    reset_backward();
    std::vector<std::size_t> roots;
    for (std::size_t u = 0; u < units_.size(); ++u) {
        if (!units_[u].spec.whole_step) continue;
        issue_gather(u);
        units_[u].ran = true;
        order_.push_back(u);
        roots.push_back(u);
    }
    // The first blocks expected queue behind the root's gather.
    if (!roots.empty()) prefetch(roots.front(), /*backward=*/false);
    for (const std::size_t u : roots) wait_gather(u);
}

void Zero3Engine::before_unit(std::size_t u, bool recompute) {
    std::lock_guard lock(mutex_);
    if (!recompute && !units_[u].ran) {
        units_[u].ran = true;
        order_.push_back(u);
    }
    if (hold_all_) return;  // everything is gathered
    use(u, recompute);
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
                    const UnitState& s = units_[u];
                    if (s.launched) return;
                    if (!s.gathered || s.ahead)
                        use(u, /*backward=*/true);  // (a second output's hook finds it in use)
                    else
                        wait_gather(u);
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
        if (units_[u].spec.frozen) {  // no collective: backward_done() releases it
            ++next_launch_;
            continue;
        }
        if (!units_[u].ready) break;
        launch(u);
        ++next_launch_;
    }
}

void Zero3Engine::launch(std::size_t u) {
    UnitState& s = units_[u];
    if (s.launched) return;
    s.launched = true;
    if (s.spec.frozen) {  // nothing to reduce
        release(u);
        return;
    }
    // The oldest reduce-scatters finish first, so their buffers are free before this one's is made.
    if (options_.reduce_in_flight > 0) retire(static_cast<std::size_t>(options_.reduce_in_flight - 1));
    at::NoGradGuard no_grad;
    const int64_t n_ranks = group_.world_size();
    at::Tensor in = at::zeros({s.shard * n_ranks}, s.flat.options());  // [N * S], on the device
    for (std::size_t k = 0; k < s.spec.params.size(); ++k) {
        at::Tensor& p = s.spec.params[k];
        if (p.grad().defined()) in.narrow(0, s.offsets[k], p.numel()).copy_(p.grad().reshape({-1}));
        p.mutable_grad() = at::Tensor();  // the full gradient is freed now, not at the step
    }
    release(u);  // its backward is over: every gradient is in
    at::Tensor out = at::empty({s.shard}, s.flat.options());
    auto work = group_.reduce_scatter_sum_async(out, in);
    in_flight_.push_back({u, std::move(in), std::move(out), std::move(work)});
    peak_reducing_ = std::max(peak_reducing_, in_flight_.size());
}

void Zero3Engine::retire(std::size_t keep) {
    if (in_flight_.size() <= keep) return;
    at::NoGradGuard no_grad;
    const double inv = 1.0 / static_cast<double>(group_.world_size());
    const std::size_t done = in_flight_.size() - keep;
    for (std::size_t i = 0; i < done; ++i) {
        InFlight& f = in_flight_[i];
        f.work->wait();  // NCCL: the compute stream waits for it; `in` is freed below, stream-safely
        UnitState& s = units_[f.unit];
        f.out.mul_(inv);
        // offload_params: the shard's gradient joins the shard in host memory (a blocking copy).
        const at::Tensor grad = f.out.to(s.shard_values.device());
        if (s.shard_grad.defined())
            s.shard_grad.add_(grad);
        else
            s.shard_grad = grad;
    }
    in_flight_.erase(in_flight_.begin(), in_flight_.begin() + static_cast<std::ptrdiff_t>(done));
}

void Zero3Engine::backward_done(std::size_t u) {
    std::lock_guard lock(mutex_);
    if (units_[u].spec.frozen) launch(u);
}

void Zero3Engine::finish_backward() {
    std::lock_guard lock(mutex_);
    // What the hooks did not launch: the rest of the forward order, then units that did not run.
    for (; next_launch_ < order_.size(); ++next_launch_) launch(order_[order_.size() - 1 - next_launch_]);
    for (std::size_t u = 0; u < units_.size(); ++u) launch(u);
    retire(0);
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
    for (std::size_t u = 0; u < units_.size(); ++u) issue_gather(u);
    for (std::size_t u = 0; u < units_.size(); ++u) {
        wait_gather(u);
        if (units_[u].ahead) {
            units_[u].ahead = false;
            --ahead_units_;
        }
    }
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
    for (const auto& s : units_) {
        bytes += static_cast<int64_t>(s.flat.storage().nbytes());
        if (s.staging.defined()) bytes += static_cast<int64_t>(s.staging.storage().nbytes());
        if (!options_.offload_params) bytes += static_cast<int64_t>(s.shard_values.storage().nbytes());
    }
    return bytes;
}

int64_t Zero3Engine::host_parameter_bytes() const {
    return options_.offload_params ? shard_bytes() : 0;
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
