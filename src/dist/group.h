// The job's communication group on c10d: rendezvous through a TCPStore (rank 0 hosts it), then a
// ProcessGroupNCCL (CUDA device, when built with NCCL) or ProcessGroupGloo (CPU) backend, both with
// a timeout so a dead peer ends a collective with an error instead of a hang.
//
// Every multi-process group runs the job's fault channel (fault_channel.h): a rank that fails
// publishes why (publish_fault), and a collective blocked on this rank throws PeerFailure within
// a poll interval of another rank's failure instead of waiting for the collective timeout (Gloo:
// the wait is sliced and checks the channel; NCCL: the watcher aborts the communicators). Once a
// peer has failed, the process ends within fault_exit_grace whatever its main thread is doing.
//
// Invariants: a single-process Group (world size 1) never opens a socket, and every collective is
// the identity on it; collectives must be called by every rank in the same order; after
// shutdown() or abort() no collective may be called.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "dist/env.h"
#include "dist/fault.h"

namespace dtune::dist {

struct GroupOptions {
    // Rendezvous (TCPStore connect and wait for all ranks) and per-collective timeouts.
    std::chrono::milliseconds store_timeout{std::chrono::minutes(5)};
    std::chrono::milliseconds collective_timeout{std::chrono::minutes(10)};
    // The device the tensors live on: cuda -> NCCL, cpu -> Gloo.
    at::Device device{at::kCPU};
    // Fault channel: how often each rank polls for another rank's failure (0: no channel), and how
    // long a rank may take to exit once a peer has failed before it is ended with _Exit.
    std::chrono::milliseconds fault_poll_interval{500};
    std::chrono::milliseconds fault_exit_grace{std::chrono::seconds(5)};
};

// A collective in flight. wait() rethrows the backend's error (peer gone, timeout).
class Pending {
  public:
    virtual ~Pending() = default;
    virtual void wait() = 0;
    // Whether it has finished, without blocking (false when unknown; wait() still required).
    virtual bool ready() { return false; }
};

class Group {
  public:
    virtual ~Group() = default;
    int rank() const { return env_.rank; }
    int world_size() const { return env_.world_size; }
    int local_rank() const { return env_.local_rank; }
    bool is_main() const { return env_.rank == 0; }
    const DistEnv& env() const { return env_; }
    // The backend's name: "gloo", "nccl", or "single" for one process.
    virtual const char* backend() const = 0;

    virtual void barrier() = 0;
    // In place: sum over ranks (mean divides by the world size afterwards).
    virtual std::unique_ptr<Pending> all_reduce_sum_async(at::Tensor& tensor) = 0;
    void all_reduce_sum_(at::Tensor& tensor) { all_reduce_sum_async(tensor)->wait(); }
    // all_reduce_sum_async on a second communicator that no CUDA graph ever holds (NCCL): for the
    // per-step agreement, issued right after a graph launch with no host wait (see
    // note_graph_launch). Gloo and one process: the same as all_reduce_sum_async.
    virtual std::unique_ptr<Pending> all_reduce_sum_side_async(at::Tensor& tensor) {
        return all_reduce_sum_async(tensor);
    }
    // A CUDA graph holding this group's collectives was launched (replayed). With NCCL's graph-mixing
    // support off (NCCL_GRAPH_MIXING_SUPPORT=0, which init_group sets when it is unset), NCCL requires
    // a host synchronisation between such a launch and the next collective issued outside a graph
    // on the same communicator: the next collective issued outside a capture first waits for the
    // device (so only rare eager collectives pay it: checkpoints, validation, warm-up steps of a new
    // batch shape). No-op for Gloo and one process.
    virtual void note_graph_launch() {}
    void all_reduce_mean_(at::Tensor& tensor);
    // In place: the mean over ranks in one collective where the backend averages itself (NCCL's
    // ncclAvg), so no division pass follows; nullptr where it does not (Gloo: sum, then divide).
    virtual std::unique_ptr<Pending> all_reduce_avg_async(at::Tensor&) { return nullptr; }
    // In place, several tensors of one dtype and device in one grouped collective (NCCL: one
    // ncclGroup of all-reduces, no flat copy): their sums, or with `average` their means where the
    // backend averages itself (else nullptr, as all_reduce_avg_async).
    virtual std::unique_ptr<Pending> all_reduce_coalesced_async(std::vector<at::Tensor>& tensors,
                                                                bool average) = 0;
    virtual void all_reduce_max_(at::Tensor& tensor) = 0;
    // In place on `root`: the sum over ranks (the other ranks' `tensor` is scratch afterwards).
    virtual std::unique_ptr<Pending> reduce_sum_async(at::Tensor& tensor, int root) = 0;
    // reduce_sum_async over several tensors (every rank passes the same sizes in the same order): on
    // NCCL one grouped call, with `average` the mean on root (ncclAvg); on Gloo one reduce per tensor,
    // always sums, so `averaged` tells the caller whether a division is left to do.
    virtual std::unique_ptr<Pending> reduce_coalesced_async(std::vector<at::Tensor>& tensors, int root,
                                                            bool average, bool& averaged) = 0;
    // In place: `tensor` takes root's values on every rank.
    virtual void broadcast_(at::Tensor& tensor, int root) = 0;
    // In place, several contiguous tensors, each from its own root (`roots[i]` for `tensors[i]`;
    // every rank passes the same sizes and roots in the same order): NCCL one grouped call with no
    // flat copy, Gloo one broadcast per tensor. Nothing is waited for here.
    virtual std::unique_ptr<Pending> broadcast_coalesced_async(std::vector<at::Tensor>& tensors,
                                                               const std::vector<int>& roots) = 0;
    // Every rank's `tensor` (same shape everywhere), in rank order.
    virtual std::vector<at::Tensor> all_gather(const at::Tensor& tensor) = 0;
    // ZeRO-3 (zero3.h): `out` [world_size * n] gets every rank's `shard` [n], in rank order; both
    // contiguous, same dtype and device. The collective writes `out` in place.
    virtual std::unique_ptr<Pending> all_gather_into_async(at::Tensor& out, const at::Tensor& shard) = 0;
    // ZeRO-3: `out` [n] gets the sum over ranks of rank r's slice [r * n, (r + 1) * n) of `in`
    // [world_size * n]; `in` is scratch afterwards.
    virtual std::unique_ptr<Pending> reduce_scatter_sum_async(at::Tensor& out, at::Tensor& in) = 0;
    // Ends the backend and the store after a normal run (idempotent; also run by the destructor
    // when no exception is in flight and no peer failed).
    virtual void shutdown() = 0;

    // Publishes this rank's failure on the fault channel so that the other ranks stop; returns
    // the record that won (an earlier rank's, if one was there first). When this rank's record
    // wins, the process is ended with its exit code fault_exit_grace + 20 s later unless it has
    // exited by then (webhooks get their 15 s flush first). No-op for one process.
    virtual FaultRecord publish_fault(const FaultRecord& record) { return record; }
    // Another rank's failure once this rank has seen it, else nullopt.
    virtual std::optional<FaultRecord> peer_fault() const { return std::nullopt; }
    void throw_if_peer_failed() const {
        if (auto f = peer_fault()) throw PeerFailure(*f, rank());
    }
    // Ends the group after a failure (idempotent): stops the watcher, aborts the backend (NCCL
    // communicators) and leaves its threads to the process exit instead of joining them, since a
    // collective still pending would block the join.
    virtual void abort() {}

    // Collectives this rank has issued (barriers included; none for one process, where every
    // collective is the identity): tests count what a code path costs in calls, not in bytes.
    std::size_t collectives_issued() const { return collectives_.load(std::memory_order_relaxed); }

  protected:
    explicit Group(DistEnv env) : env_(std::move(env)) {}
    void count_collective() const { collectives_.fetch_add(1, std::memory_order_relaxed); }
    DistEnv env_;
    mutable std::atomic<std::size_t> collectives_{0};
};

// Creates the group for `env`: single-process when env.world_size == 1, else TCPStore + backend.
// Logs the backend and NCCL_NVLS_ENABLE (set to 0 when unset). Throws Error naming the address and
// the timeout when the rendezvous fails, with what to check.
std::unique_ptr<Group> init_group(const DistEnv& env, const GroupOptions& options = {});

}  // namespace dtune::dist
