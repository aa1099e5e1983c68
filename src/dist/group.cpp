// c10d-backed Group (see group.h): TCPStore rendezvous, then ProcessGroupGloo or ProcessGroupNCCL.
// We talk to the c10d Backend directly (no ProcessGroup wrapper): one backend per job is all the
// trainer needs, and Backend exposes every collective with Work objects to wait on.
#include "dist/group.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if defined(DTUNE_WITH_NCCL)
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <string_view>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "dist/fault_channel.h"

namespace dtune::dist {

void Group::all_reduce_mean_(at::Tensor& tensor) {
    all_reduce_sum_(tensor);
    if (world_size() > 1) tensor.div_(world_size());
}

namespace {

// How long a rank whose collective failed waits for a peer's fault record before reporting the
// collective's own error (a launcher publishes for a killed rank after noticing its death).
constexpr std::chrono::milliseconds kPeerReportWait{1500};

// DTUNE_DIST_TRACE=1 logs every collective on entry and completion with the rank: the way to see
// which collective a stuck job waits in (ranks that disagree on the sequence hang).
bool trace_enabled() {
    static const bool on = [] {
        const char* v = std::getenv("DTUNE_DIST_TRACE");
        return v && *v && std::string_view(v) != "0";
    }();
    return on;
}

class Trace {
  public:
    Trace(int rank, const char* op, const at::Tensor* t = nullptr) : rank_(rank), op_(op) {
        if (!trace_enabled()) return;
        seq_ = ++counter();
        auto line = log::info();
        line << "dist trace: rank " << rank_ << " #" << seq_ << " " << op_ << " begin";
        if (t) line << " " << t->sizes() << " " << t->dtype() << " on " << t->device();
    }
    ~Trace() {
        if (trace_enabled())
            log::info() << "dist trace: rank " << rank_ << " #" << seq_ << " " << op_ << " issued";
    }

  private:
    static std::atomic<int64_t>& counter() {
        static std::atomic<int64_t> n{0};
        return n;
    }
    int rank_;
    const char* op_;
    int64_t seq_ = 0;
};

// Several collectives waited for as one, in order (Gloo's stand-in for a grouped NCCL call).
struct AllPending final : Pending {
    std::vector<std::unique_ptr<Pending>> parts;
    void wait() override {
        for (auto& p : parts) p->wait();
    }
    bool ready() override {
        for (auto& p : parts)
            if (!p->ready()) return false;
        return true;
    }
};

class SingleGroup final : public Group {
  public:
    explicit SingleGroup(DistEnv env) : Group(std::move(env)) {}
    const char* backend() const override { return "single"; }
    void barrier() override {}
    std::unique_ptr<Pending> all_reduce_sum_async(at::Tensor&) override {
        struct Done final : Pending {
            void wait() override {}
        };
        return std::make_unique<Done>();
    }
    std::unique_ptr<Pending> all_reduce_coalesced_async(std::vector<at::Tensor>& tensors, bool) override {
        return all_reduce_sum_async(tensors.front());
    }
    void all_reduce_max_(at::Tensor&) override {}
    std::unique_ptr<Pending> reduce_sum_async(at::Tensor& tensor, int) override {
        return all_reduce_sum_async(tensor);
    }
    std::unique_ptr<Pending> reduce_coalesced_async(std::vector<at::Tensor>& tensors, int, bool,
                                                    bool& averaged) override {
        averaged = true;  // one rank: the sum is the mean
        return all_reduce_sum_async(tensors.front());
    }
    void broadcast_(at::Tensor&, int) override {}
    std::unique_ptr<Pending> broadcast_coalesced_async(std::vector<at::Tensor>& tensors,
                                                       const std::vector<int>&) override {
        return all_reduce_sum_async(tensors.front());
    }
    std::vector<at::Tensor> all_gather(const at::Tensor& tensor) override { return {tensor.clone()}; }
    std::unique_ptr<Pending> all_gather_into_async(at::Tensor& out, const at::Tensor& shard) override {
        out.copy_(shard);
        return all_reduce_sum_async(out);
    }
    std::unique_ptr<Pending> reduce_scatter_sum_async(at::Tensor& out, at::Tensor& in) override {
        out.copy_(in);
        return all_reduce_sum_async(out);
    }
    void shutdown() override {}
};

class C10dGroup;

class WorkPending final : public Pending {
  public:
    WorkPending(C10dGroup& group, c10::intrusive_ptr<c10d::Work> work)
        : group_(group), work_(std::move(work)) {}
    void wait() override;
    bool ready() override { return !work_ || work_->isCompleted(); }

  private:
    C10dGroup& group_;
    c10::intrusive_ptr<c10d::Work> work_;
};

class C10dGroup final : public Group {
  public:
    // `side`: the agreement's communicator (NCCL; null: the main one serves).
    C10dGroup(DistEnv env, c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Backend> backend,
              c10::intrusive_ptr<c10d::Backend> side, const char* name, const GroupOptions& options)
        : Group(std::move(env)),
          store_(std::move(store)),
          backend_(std::move(backend)),
          side_(std::move(side)),
          name_(name),
          device_(options.device),
          poll_interval_(options.fault_poll_interval),
          exit_grace_(options.fault_exit_grace) {
        if (poll_interval_.count() <= 0) return;
        FaultChannelOptions channel;
        channel.poll_interval = poll_interval_;
        channel.store_address = str(env_.master_addr, ":", env_.master_port);
        channel_ = std::make_unique<FaultChannel>(store_, rank(), world_size(), channel,
                                                  [this](const FaultRecord& r) { on_peer_fault(r); });
    }
    ~C10dGroup() override {
        if (std::uncaught_exceptions() > 0 || peer_fault())
            abort();
        else
            shutdown();
    }
    const char* backend() const override { return name_; }

    void barrier() override {
        check_open();
        Trace trace(rank(), "barrier");
        c10d::BarrierOptions opts;
        if (device_.is_cuda()) opts.device_ids = {device_.index()};
        wait(backend_->barrier(opts));
    }
    std::unique_ptr<Pending> all_reduce_sum_async(at::Tensor& tensor) override {
        check_open();
        Trace trace(rank(), "all_reduce_sum", &tensor);
        std::vector<at::Tensor> tensors{tensor};
        c10d::AllreduceOptions opts;
        opts.reduceOp = c10d::ReduceOp::SUM;
        return std::make_unique<WorkPending>(*this, backend_->allreduce(tensors, opts));
    }
    std::unique_ptr<Pending> all_reduce_sum_side_async(at::Tensor& tensor) override {
        if (!side_) return all_reduce_sum_async(tensor);
        check_open(/*after_graph_launch=*/false);  // this communicator is never captured
        Trace trace(rank(), "all_reduce_sum_side", &tensor);
        std::vector<at::Tensor> tensors{tensor};
        c10d::AllreduceOptions opts;
        opts.reduceOp = c10d::ReduceOp::SUM;
        return std::make_unique<WorkPending>(*this, side_->allreduce(tensors, opts));
    }
    void note_graph_launch() override {
        if (name_ == std::string("nccl")) graph_launched_.store(true);
    }
    std::unique_ptr<Pending> all_reduce_avg_async(at::Tensor& tensor) override {
        if (name_ != std::string("nccl")) return nullptr;
        check_open();
        Trace trace(rank(), "all_reduce_avg", &tensor);
        std::vector<at::Tensor> tensors{tensor};
        c10d::AllreduceOptions opts;
        opts.reduceOp = c10d::ReduceOp::AVG;
        return std::make_unique<WorkPending>(*this, backend_->allreduce(tensors, opts));
    }
    std::unique_ptr<Pending> all_reduce_coalesced_async(std::vector<at::Tensor>& tensors,
                                                        bool average) override {
        const bool nccl = name_ == std::string("nccl");
        if (average && !nccl) return nullptr;
        check_open();
        Trace trace(rank(), average ? "all_reduce_avg_coalesced" : "all_reduce_sum_coalesced",
                    &tensors.front());
        c10d::AllreduceCoalescedOptions opts;
        opts.reduceOp = average ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
        return std::make_unique<WorkPending>(*this, backend_->allreduce_coalesced(tensors, opts));
    }
    void all_reduce_max_(at::Tensor& tensor) override {
        check_open();
        Trace trace(rank(), "all_reduce_max", &tensor);
        std::vector<at::Tensor> tensors{tensor};
        c10d::AllreduceOptions opts;
        opts.reduceOp = c10d::ReduceOp::MAX;
        wait(backend_->allreduce(tensors, opts));
    }
    std::unique_ptr<Pending> reduce_sum_async(at::Tensor& tensor, int root) override {
        check_open();
        Trace trace(rank(), "reduce_sum", &tensor);
        std::vector<at::Tensor> tensors{tensor};
        c10d::ReduceOptions opts;
        opts.reduceOp = c10d::ReduceOp::SUM;
        opts.rootRank = root;
        return std::make_unique<WorkPending>(*this, backend_->reduce(tensors, opts));
    }
    std::unique_ptr<Pending> reduce_coalesced_async(std::vector<at::Tensor>& tensors, int root, bool average,
                                                    bool& averaged) override {
        check_open();
        Trace trace(rank(), "reduce_coalesced", &tensors.front());
        c10d::ReduceOptions opts;
        opts.rootRank = root;
        if (name_ != std::string("nccl")) {  // Gloo: one reduce each, waited for in order
            auto all = std::make_unique<AllPending>();
            opts.reduceOp = c10d::ReduceOp::SUM;
            for (auto& t : tensors) {
                std::vector<at::Tensor> one{t};
                all->parts.push_back(std::make_unique<WorkPending>(*this, backend_->reduce(one, opts)));
            }
            averaged = false;
            return all;
        }
        opts.reduceOp = average ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
        backend_->startCoalescing();
        for (auto& t : tensors) {
            std::vector<at::Tensor> one{t};
            (void)backend_->reduce(one, opts);
        }
        averaged = average;
        return std::make_unique<WorkPending>(*this, backend_->endCoalescing());
    }
    void broadcast_(at::Tensor& tensor, int root) override {
        check_open();
        Trace trace(rank(), "broadcast", &tensor);
        std::vector<at::Tensor> tensors{tensor};
        c10d::BroadcastOptions opts;
        opts.rootRank = root;
        wait(backend_->broadcast(tensors, opts));
    }
    std::unique_ptr<Pending> broadcast_coalesced_async(std::vector<at::Tensor>& tensors,
                                                       const std::vector<int>& roots) override {
        check_open();
        DTUNE_CHECK(!tensors.empty() && roots.size() == tensors.size(),
                    "dist: broadcast_coalesced_async needs one root per tensor");
        Trace trace(rank(), "broadcast_coalesced", &tensors.front());
        c10d::BroadcastOptions opts;
        if (name_ != std::string("nccl")) {  // Gloo: one broadcast each, waited for in order
            auto all = std::make_unique<AllPending>();
            for (std::size_t i = 0; i < tensors.size(); ++i) {
                std::vector<at::Tensor> one{tensors[i]};
                opts.rootRank = roots[i];
                all->parts.push_back(std::make_unique<WorkPending>(*this, backend_->broadcast(one, opts)));
            }
            return all;
        }
        if (tensors.size() == 1) {  // one collective: no coalescing group around it
            std::vector<at::Tensor> one{tensors[0]};
            opts.rootRank = roots[0];
            return std::make_unique<WorkPending>(*this, backend_->broadcast(one, opts));
        }
        backend_->startCoalescing();
        for (std::size_t i = 0; i < tensors.size(); ++i) {
            std::vector<at::Tensor> one{tensors[i]};
            opts.rootRank = roots[i];
            (void)backend_->broadcast(one, opts);
        }
        return std::make_unique<WorkPending>(*this, backend_->endCoalescing());
    }
    std::vector<at::Tensor> all_gather(const at::Tensor& tensor) override {
        check_open();
        Trace trace(rank(), "all_gather", &tensor);
        std::vector<at::Tensor> inputs{tensor.contiguous()};
        std::vector<std::vector<at::Tensor>> outputs(1);
        for (int r = 0; r < world_size(); ++r) outputs[0].push_back(at::empty_like(inputs[0]));
        wait(backend_->allgather(outputs, inputs));
        return outputs[0];
    }
    std::unique_ptr<Pending> all_gather_into_async(at::Tensor& out, const at::Tensor& shard) override {
        check_open();
        Trace trace(rank(), "all_gather_into", &out);
        DTUNE_CHECK(
            out.is_contiguous() && shard.is_contiguous() && out.numel() == shard.numel() * world_size(),
            "dist: all_gather_into needs a contiguous [", world_size(), " x ", shard.numel(),
            "] output, got ", out.sizes());
        if (name_ == std::string("gloo")) {
            // Gloo's flat all-gather runs its work inside wait(), which the sliced wait below calls
            // repeatedly: use the list form with views of `out` as the outputs instead.
            std::vector<at::Tensor> inputs{shard};
            std::vector<std::vector<at::Tensor>> outputs(1);
            for (int r = 0; r < world_size(); ++r)
                outputs[0].push_back(out.narrow(0, r * shard.numel(), shard.numel()));
            return std::make_unique<WorkPending>(*this, backend_->allgather(outputs, inputs));
        }
        at::Tensor input = shard;  // (the backend takes non-const references)
        return std::make_unique<WorkPending>(*this, backend_->_allgather_base(out, input));
    }
    std::unique_ptr<Pending> reduce_scatter_sum_async(at::Tensor& out, at::Tensor& in) override {
        check_open();
        Trace trace(rank(), "reduce_scatter_sum", &in);
        DTUNE_CHECK(out.is_contiguous() && in.is_contiguous() && in.numel() == out.numel() * world_size(),
                    "dist: reduce_scatter needs a contiguous [", world_size(), " x ", out.numel(),
                    "] input, got ", in.sizes());
        if (name_ == std::string("gloo")) {
            // Gloo's reduce-scatter runs inside wait() (see all_gather_into_async): an all-reduce of
            // `in`, then this rank's slice copied out (CPU tests; twice the traffic of NCCL's).
            struct SliceAfter final : Pending {
                std::unique_ptr<Pending> reduce;
                at::Tensor out, slice;
                void wait() override {
                    reduce->wait();
                    out.copy_(slice);
                }
                bool ready() override { return reduce->ready(); }
            };
            auto p = std::make_unique<SliceAfter>();
            std::vector<at::Tensor> tensors{in};
            c10d::AllreduceOptions opts;
            opts.reduceOp = c10d::ReduceOp::SUM;
            p->reduce = std::make_unique<WorkPending>(*this, backend_->allreduce(tensors, opts));
            p->out = out;
            p->slice = in.narrow(0, rank() * out.numel(), out.numel());
            return p;
        }
        c10d::ReduceScatterOptions opts;
        opts.reduceOp = c10d::ReduceOp::SUM;
        return std::make_unique<WorkPending>(*this, backend_->_reduce_scatter_base(out, in, opts));
    }
    void shutdown() override {
        if (!backend_) return;
        if (peer_fault()) return abort();
        if (channel_) channel_->leave();  // rank 0 keeps the store until every rank stopped watching
        try {
            if (side_) side_->shutdown();
            backend_->shutdown();
        } catch (const std::exception& e) {
            log::warn() << "dist: backend shutdown: " << e.what();
        }
        side_.reset();
        backend_.reset();
        channel_.reset();
        store_.reset();
    }

    FaultRecord publish_fault(const FaultRecord& record) override {
        if (!channel_) return record;
        FaultRecord winner = channel_->publish(record);
        if (winner.rank == rank()) {
            // The bound on this rank's own exit: its webhooks get their flush time (15 s) first.
            exit_after(exit_grace_ + std::chrono::seconds(20), record.exit_code,
                       str("rank ", rank(), " failed (", record.message.substr(0, 200), ")"));
        }
        return winner;
    }
    std::optional<FaultRecord> peer_fault() const override {
        return channel_ ? channel_->peer_fault() : std::nullopt;
    }
    void abort() override {
        if (!backend_) return;
        if (channel_) channel_->leave_after_failure();
        abort_backend();
        // Leaked on purpose: destroying the backend joins its threads, and a collective still
        // pending there (the peer that failed never joins it) would block the join.
        (void)backend_.release();
        (void)side_.release();
        store_.reset();
    }

    // Waits for `work`, in slices on Gloo so that a peer's failure interrupts the wait; turns a
    // backend error that a peer's failure caused into PeerFailure.
    void wait(const c10::intrusive_ptr<c10d::Work>& work) {
        try {
            if (!channel_ || name_ != std::string("gloo")) {
                work->wait();  // NCCL: returns once queued; the watcher aborts a hung communicator
            } else {
                const auto slice = std::min(poll_interval_, std::chrono::milliseconds(100));
                for (;;) {
                    try {
                        work->wait(slice);  // throws "timed out" when the slice passes first
                    } catch (const std::exception&) {
                        if (!work->isCompleted()) throw_if_peer_failed();
                    }
                    if (work->isCompleted()) {
                        work->wait();  // returns, or rethrows the collective's own error
                        break;
                    }
                    throw_if_peer_failed();
                }
            }
        } catch (const PeerFailure&) {
            throw;
        } catch (const std::exception&) {
            // A collective that fails because a peer died (its socket closed) usually fails before
            // anyone has published why: give the peer, or the launcher of a peer killed outright,
            // a moment to say so, so this rank names the real cause.
            if (channel_) {
                const auto deadline =
                    std::chrono::steady_clock::now() + std::max(2 * poll_interval_, kPeerReportWait);
                for (;;) {
                    if (auto f = channel_->check_now()) throw PeerFailure(*f, rank());
                    if (std::chrono::steady_clock::now() >= deadline) break;
                    std::this_thread::sleep_for(std::chrono::milliseconds(100));
                }
            }
            throw;
        }
        throw_if_peer_failed();
    }

  private:
    // `after_graph_launch`: whether this collective's communicator needs the host wait after a
    // graph launch (the main one; not the side one, which no graph holds).
    void check_open(bool after_graph_launch = true) const {
        DTUNE_CHECK(backend_, "dist: collective called after shutdown() on rank ", rank(),
                    "; call shutdown() only at the end of the job");
        throw_if_peer_failed();
        count_collective();  // every collective starts here
        if (after_graph_launch) wait_for_graph_launch();
    }
    // NCCL with graph mixing off: a collective issued outside a capture after a graph launch waits
    // for the device first (note_graph_launch).
    void wait_for_graph_launch() const {
#if defined(DTUNE_WITH_NCCL)
        if (!graph_launched_.load() ||
            c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None)
            return;
        c10::cuda::device_synchronize();
        graph_launched_.store(false);
#endif
    }
    // Runs once, on the watcher thread (or in a failed collective's check): says why this rank
    // stops, unblocks NCCL, and bounds the time left to this process.
    void on_peer_fault(const FaultRecord& record) {
        log::error() << peer_failure_line(record, rank());
        abort_backend();
        exit_after(exit_grace_, record.exit_code,
                   str("rank ", rank(), " stops because rank ", record.rank, " failed"));
    }
    void abort_backend() {
        if (aborted_.exchange(true)) return;
        try {
            if (side_) side_->abort();
            backend_->abort();  // NCCL: aborts the communicators; Gloo: nothing to abort
        } catch (const std::exception& e) {
            log::warn() << "dist: backend abort: " << e.what();
        }
    }

    c10::intrusive_ptr<c10d::Store> store_;
    c10::intrusive_ptr<c10d::Backend> backend_;
    c10::intrusive_ptr<c10d::Backend> side_;           // the agreement's (NCCL), never captured; may be null
    mutable std::atomic<bool> graph_launched_{false};  // since the last wait_for_graph_launch
    const char* name_;
    at::Device device_;
    std::chrono::milliseconds poll_interval_, exit_grace_;
    std::unique_ptr<FaultChannel> channel_;
    std::atomic<bool> aborted_{false};
};

void WorkPending::wait() {
    if (!work_) return;
    auto work = std::move(work_);
    group_.wait(work);
}

c10::intrusive_ptr<c10d::Store> connect_store(const DistEnv& env, const GroupOptions& options) {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(env.master_port);
    opts.isServer = env.rank == 0;
    opts.numWorkers = static_cast<std::size_t>(env.world_size);
    opts.waitWorkers = true;
    opts.timeout = options.store_timeout;
    try {
        return c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
    } catch (const std::exception& e) {
        throw Error(
            str("dist: rank ", env.rank, " could not rendezvous at ", env.master_addr, ":", env.master_port,
                " within ", options.store_timeout.count() / 1000, " s (", e.what(),
                "); check that every node was started, that MASTER_ADDR is node 0's address reachable ",
                "from here, and that the port is free and open in the firewall"));
    }
}

c10::intrusive_ptr<c10d::Backend> make_gloo(const DistEnv& env, const c10::intrusive_ptr<c10d::Store>& store,
                                            const GroupOptions& options) {
    // create_default picks the interface from GLOO_SOCKET_IFNAME, else this host's name.
    auto opts = c10d::ProcessGroupGloo::Options::create_default(options.collective_timeout);
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, env.rank, env.world_size, opts);
}

#if defined(DTUNE_WITH_NCCL)
c10::intrusive_ptr<c10d::Backend> make_nccl(const DistEnv& env, const c10::intrusive_ptr<c10d::Store>& store,
                                            const GroupOptions& options) {
    c10::cuda::set_device(options.device.index());
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = options.collective_timeout;
    auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, env.rank, env.world_size, opts);
    // Bind the group to this rank's GPU and create the communicator now, as torch's
    // init_process_group(device_id=...) does: barriers then use this GPU instead of a guess from the
    // rank, and a rendezvous problem shows up here rather than inside the first collective.
    backend->setBoundDeviceId(options.device);
    backend->eagerConnectSingleDevice(options.device);
    return backend;
}
#endif

}  // namespace

std::unique_ptr<Group> init_group(const DistEnv& env, const GroupOptions& options) {
    if (env.world_size <= 1) return std::make_unique<SingleGroup>(env);
    std::string nvls = ensure_nvls_disabled();
    const std::string mixing = ensure_graph_mixing_disabled();
    auto store = connect_store(env, options);
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("dtune/0", store);
    c10::intrusive_ptr<c10d::Backend> backend, side;
    const char* name = "gloo";
    if (options.device.is_cuda()) {
#if defined(DTUNE_WITH_NCCL)
        backend = make_nccl(env, prefixed, options);
        side = make_nccl(env, c10::make_intrusive<c10d::PrefixStore>("dtune/side", store), options);
        name = "nccl";
#else
        throw UsageError(
            "dist: a CUDA device was asked for, but this dtune was built without NCCL; rebuild "
            "against a CUDA libtorch with nccl.h available (see docs/multi-node.md)");
#endif
    } else {
        backend = make_gloo(env, prefixed, options);
    }
    if (env.rank == 0)
        log::info() << "dist: " << env.world_size << " ranks over " << name << ", rendezvous "
                    << env.master_addr << ":" << env.master_port << ", NCCL_NVLS_ENABLE=" << nvls
                    << (options.device.is_cuda() ? str(", NCCL_GRAPH_MIXING_SUPPORT=", mixing)
                                                 : std::string())
                    << ", collective timeout " << options.collective_timeout.count() / 1000 << " s";
    return std::make_unique<C10dGroup>(env, store, backend, side, name, options);
}

}  // namespace dtune::dist
