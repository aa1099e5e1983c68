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
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <atomic>
#include <cstdlib>
#include <string_view>

#include "core/error.h"
#include "core/log.h"

namespace dtune::dist {

void Group::all_reduce_mean_(at::Tensor& tensor) {
    all_reduce_sum_(tensor);
    if (world_size() > 1) tensor.div_(world_size());
}

namespace {

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
    void all_reduce_max_(at::Tensor&) override {}
    std::unique_ptr<Pending> reduce_sum_async(at::Tensor& tensor, int) override {
        return all_reduce_sum_async(tensor);
    }
    void broadcast_(at::Tensor&, int) override {}
    std::vector<at::Tensor> all_gather(const at::Tensor& tensor) override { return {tensor.clone()}; }
    void shutdown() override {}
    void abort() override {}
};

class WorkPending final : public Pending {
  public:
    explicit WorkPending(c10::intrusive_ptr<c10d::Work> work) : work_(std::move(work)) {}
    void wait() override {
        if (!work_) return;
        work_->wait();
        work_.reset();
    }
    bool ready() override { return !work_ || work_->isCompleted(); }

  private:
    c10::intrusive_ptr<c10d::Work> work_;
};

class C10dGroup final : public Group {
  public:
    C10dGroup(DistEnv env, c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Backend> backend,
              const char* name, at::Device device)
        : Group(std::move(env)),
          store_(std::move(store)),
          backend_(std::move(backend)),
          name_(name),
          device_(device) {}
    ~C10dGroup() override { shutdown(); }
    const char* backend() const override { return name_; }

    void barrier() override {
        check_open();
        Trace trace(rank(), "barrier");
        c10d::BarrierOptions opts;
        if (device_.is_cuda()) opts.device_ids = {device_.index()};
        backend_->barrier(opts)->wait();
    }
    std::unique_ptr<Pending> all_reduce_sum_async(at::Tensor& tensor) override {
        check_open();
        Trace trace(rank(), "all_reduce_sum", &tensor);
        std::vector<at::Tensor> tensors{tensor};
        c10d::AllreduceOptions opts;
        opts.reduceOp = c10d::ReduceOp::SUM;
        return std::make_unique<WorkPending>(backend_->allreduce(tensors, opts));
    }
    void all_reduce_max_(at::Tensor& tensor) override {
        check_open();
        Trace trace(rank(), "all_reduce_max", &tensor);
        std::vector<at::Tensor> tensors{tensor};
        c10d::AllreduceOptions opts;
        opts.reduceOp = c10d::ReduceOp::MAX;
        backend_->allreduce(tensors, opts)->wait();
    }
    std::unique_ptr<Pending> reduce_sum_async(at::Tensor& tensor, int root) override {
        check_open();
        std::vector<at::Tensor> tensors{tensor};
        c10d::ReduceOptions opts;
        opts.reduceOp = c10d::ReduceOp::SUM;
        opts.rootRank = root;
        return std::make_unique<WorkPending>(backend_->reduce(tensors, opts));
    }
    void broadcast_(at::Tensor& tensor, int root) override {
        check_open();
        Trace trace(rank(), "broadcast", &tensor);
        std::vector<at::Tensor> tensors{tensor};
        c10d::BroadcastOptions opts;
        opts.rootRank = root;
        backend_->broadcast(tensors, opts)->wait();
    }
    std::vector<at::Tensor> all_gather(const at::Tensor& tensor) override {
        check_open();
        Trace trace(rank(), "all_gather", &tensor);
        std::vector<at::Tensor> inputs{tensor.contiguous()};
        std::vector<std::vector<at::Tensor>> outputs(1);
        for (int r = 0; r < world_size(); ++r) outputs[0].push_back(at::empty_like(inputs[0]));
        backend_->allgather(outputs, inputs)->wait();
        return outputs[0];
    }
    void shutdown() override { end(false); }
    void abort() override { end(true); }

  private:
    // Ends the backend once: gracefully (waits for work in flight) or by abort (does not).
    void end(bool abort) {
        if (!backend_) return;
        try {
            if (abort)
                backend_->abort();
            else
                backend_->shutdown();
        } catch (const std::exception& e) {
            log::warn() << "dist: backend " << (abort ? "abort" : "shutdown") << ": " << e.what();
        }
        backend_.reset();
        store_.reset();
    }
    void check_open() const {
        DTUNE_CHECK(backend_, "dist: collective called after shutdown() on rank ", rank(),
                    "; call shutdown() only at the end of the job");
    }

    c10::intrusive_ptr<c10d::Store> store_;
    c10::intrusive_ptr<c10d::Backend> backend_;
    const char* name_;
    at::Device device_;
};

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
    auto store = connect_store(env, options);
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("dtune/0", store);
    c10::intrusive_ptr<c10d::Backend> backend;
    const char* name = "gloo";
    if (options.device.is_cuda()) {
#if defined(DTUNE_WITH_NCCL)
        backend = make_nccl(env, prefixed, options);
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
                    << ", collective timeout " << options.collective_timeout.count() / 1000 << " s";
    return std::make_unique<C10dGroup>(env, store, backend, name, options.device);
}

}  // namespace dtune::dist
