// ZeRO-3 parameter sharding (FSDP's "full shard"), built on c10d collectives.
//
// Parameters are grouped in units: one per block the model runs as a unit (models/common/
// unit_hooks.h: ResNet and transformer blocks) plus a root unit for the rest (embeddings, norms,
// projections, up/down samplers). Each unit's parameters live in one flat buffer [N * S] of the
// parameter dtype (padded to a multiple of the world size N), and each rank permanently keeps only
// its shard [S] of it, the shard's gradient and (through the optimizer) its optimizer state.
//
// One step, per micro-batch:
//   begin_forward()        the root unit is gathered (and kept until finish_backward)
//   before_unit(u)         unit u is all-gathered into its flat buffer
//   after_unit(u, outs)    unit u is released; a hook on each output's gradient gathers it again
//                          before its backward runs (with gradient checkpointing the recomputation's
//                          before_unit gathers it instead, and it stays until its gradients exist)
//   (parameter hooks)      once every parameter of u has its gradient: the gradients are packed,
//                          reduce-scattered (sum) into this rank's shard, and the full gradients and
//                          parameters are freed; units launch strictly in reverse forward order, so
//                          every rank issues the same collectives in the same order
//   finish_backward()      launches what is left, waits, adds sum / N into the shard gradients,
//                          releases everything; slices()[i].value.grad() is then the average
//
// Prefetch (options.prefetch = d > 0): each time a unit is needed ("used": before_unit, or the
// gradient hook that gathers it for backward), the all-gathers of the next d units expected after
// it are issued asynchronously, and a unit's gather is waited for only where it is used. On NCCL a
// collective runs on NCCL's own stream, so the next block's gather overlaps the current block's
// kernels; on Gloo it runs on the backend's worker threads. The expected order is, in forward, the
// order the previous micro-step's forward used the units (the first forward has none and gathers
// on demand), and in backward the reverse of this micro-step's forward order (the order both the
// output-gradient hooks and the checkpoint recomputations follow). At every use the units gathered
// ahead that are no longer among the next d expected are released (a misprediction costs a wasted
// gather, never a wrong value), so at most d units are ever gathered ahead of their use: the blocks
// held at once are those of the synchronous schedule plus at most d. Every decision depends only
// on the sequence of uses, which is the same on every rank, so every rank issues the same
// collectives in the same order, predicted right or wrong.
//
// Parameter offload (options.offload_params): the shards (and their gradients) live in host
// memory, pinned when the parameters are on a GPU, and the optimizer updates them there; a shard is
// copied to the device right before its all-gather is issued (so it rides on the prefetch), and
// the reduce-scattered gradient is copied back to the host. The device then holds only gathered
// units.
//
// How release keeps autograd working: a parameter keeps its TensorImpl for the whole run; its data
// is a view into the unit's flat buffer, and releasing frees the flat buffer's storage bytes
// (resized to 0) while the storage object stays. Tensors autograd saved (the parameter, its
// transposes and other views) reference that same storage, so when the storage is given bytes
// again and filled by the all-gather, they read the gathered values. A released parameter must
// not be read: its storage has no bytes (a read would fault, not return stale values).
//
// Collectives run in the parameter dtype (bf16 for adamw_bf16 runs).
//
// Invariants: every rank builds the engine from the same units in the same order; while
// gathered_all() the hooks do nothing (validation, export, checkpoints read whole weights); the
// pad elements of a shard are zero and belong to no slice; a unit's flat buffer is never read or
// freed while its gather is in flight (every reader waits for it first).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dist/group.h"

namespace dtune::dist {

struct Zero3Unit {
    std::string name;                // "down_blocks.0.resnets.1", or "root"
    std::vector<std::string> names;  // its parameters' names (checkpoint keys)
    std::vector<at::Tensor> params;  // the model's parameters; the engine takes over their data
    // Gathered from begin_forward() until finish_backward() (the root: its parameters are used
    // all over the forward, between the units).
    bool whole_step = false;
    // Its parameters take no gradient (a LoRA's base): sharded and gathered like the others, but no
    // gradient buffer, no reduce-scatter and no slices (the optimizer never sees them). Its backward
    // has no gradient to signal its end: the owner calls backward_done(u) once nothing reads its
    // weights any more (finish_backward() releases it otherwise).
    bool frozen = false;
};

struct Zero3Options {
    // false: a unit's parameters stay gathered from its forward until its gradients are reduced
    // (fsdp_reshard_after_forward false: less communication, more memory during the step).
    bool reshard_after_forward = true;
    // How many units' all-gathers are issued ahead of their use (0: each unit is gathered when it
    // is needed). DTUNE_ZERO3_PREFETCH in the trainer.
    int prefetch = 1;
    // Shards, their gradients and (through the optimizer) its state in host memory; the device holds
    // only gathered units (offload_param_device cpu).
    bool offload_params = false;
    // How many units' gradient reduce-scatters may be in flight during backward before the oldest
    // is waited for (a stream wait on NCCL, no host wait) and its full-size gradient buffer freed.
    // 0: every one waits at the end of backward, so the whole model's gradient is alive at once.
    // DTUNE_ZERO3_REDUCE_IN_FLIGHT in the trainer.
    int reduce_in_flight = 2;
};

// The part of one parameter this rank owns: elements [begin, end) of the flattened parameter.
struct Zero3Slice {
    std::string name;  // the parameter's name
    std::size_t unit = 0;
    std::size_t param = 0;  // index in the unit
    int64_t begin = 0, end = 0;
    at::Tensor value;  // [end - begin], a view of this rank's shard: the optimizer's parameter
};

class Zero3Engine {
  public:
    Zero3Engine(Group& group, std::vector<Zero3Unit> units, Zero3Options options = {});
    ~Zero3Engine();
    Zero3Engine(const Zero3Engine&) = delete;
    Zero3Engine& operator=(const Zero3Engine&) = delete;

    std::size_t unit_count() const { return units_.size(); }
    const Zero3Options& options() const { return options_; }
    const Zero3Unit& unit(std::size_t u) const { return units_[u].spec; }
    // This rank's slices, in unit then parameter order (every parameter has at most one here).
    const std::vector<Zero3Slice>& slices() const { return slices_; }

    // The step protocol (see the header comment).
    void begin_forward();
    void before_unit(std::size_t u, bool recompute);
    void after_unit(std::size_t u, bool recompute, const std::vector<at::Tensor>& outputs);
    void finish_backward();
    // Drops the shard gradients (after the optimizer step).
    void zero_grad();
    // Units in the order the last forward first ran them (the root first); the next forward
    // prefetches in this order.
    std::vector<std::size_t> forward_order() const;

    // Whole weights: gather_all() all-gathers every unit (collective) and keeps them until
    // release_all() (local). reshard_from_full(): after the caller changed the gathered weights,
    // every rank takes its shard from them.
    bool gathered_all() const { return hold_all_; }
    void gather_all();
    void release_all();
    void reshard_from_full();

    // Memory accounting, measured from the storages: bytes of parameter data this rank holds now on
    // the training device (flat buffers currently gathered or being gathered, the shards unless
    // offloaded), bytes of shards in host memory (offload_params; else 0), this rank's shards
    // wherever they are, and what an unsharded copy takes.
    int64_t resident_parameter_bytes() const;
    int64_t host_parameter_bytes() const;
    int64_t shard_bytes() const;
    int64_t full_parameter_bytes() const;
    // Gathers since construction (tests: gradient checkpointing gathers each unit once more), and
    // how many of them were issued ahead of their use by the prefetch.
    int64_t gathers() const { return gathers_; }
    int64_t prefetched_gathers() const { return prefetched_; }
    // The most units other than whole-step ones that were gathered (or being gathered) at once, and
    // the most that were gathered ahead of their use at once (<= options().prefetch), since
    // construction.
    std::size_t peak_gathered_units() const { return peak_gathered_; }
    std::size_t peak_prefetched_units() const { return peak_ahead_; }
    // The most units whose full-size gradient buffers were alive at once waiting for their
    // reduce-scatter (<= options().reduce_in_flight when that is > 0), since construction.
    std::size_t peak_reducing_units() const { return peak_reducing_; }
    // Called before every all-gather with the unit (fault injection in tests: a rank that dies
    // here leaves the others inside the collective). Empty: nothing.
    void set_before_gather(std::function<void(std::size_t)> fn) { before_gather_ = std::move(fn); }
    // A frozen unit's backward of this micro-step is over: it is released now, and not gathered
    // again before the next forward. No-op for other units.
    void backward_done(std::size_t u);

  private:
    struct UnitState {
        Zero3Unit spec;
        std::vector<int64_t> offsets;        // each parameter's first element in the flat buffer
        int64_t numel = 0, shard = 0;        // unpadded elements; S (padded = N * S)
        at::Tensor flat;                     // [N * S]; storage bytes only while gathered
        at::Tensor shard_values;             // [S] this rank's part (host memory with offload_params)
        at::Tensor shard_grad;               // [S] sum of the reduced gradients / N (undefined: none yet)
        bool gathered = false;               // flat has its bytes: gathered, or its gather is in flight
        std::unique_ptr<Pending> gathering;  // the gather in flight (null: none)
        at::Tensor staging;                  // offload_params: the shard's device copy, until then
        bool ahead = false;                  // gathered by the prefetch and not used yet
        // Backward bookkeeping of the current micro-step.
        std::size_t pending = 0;  // parameters without their gradient yet
        bool ready = false, launched = false, ran = false;
    };
    struct InFlight {
        std::size_t unit;
        at::Tensor in, out;
        std::unique_ptr<Pending> work;
    };

    void gather(std::size_t u);              // issue_gather + wait_gather
    void issue_gather(std::size_t u);        // starts u's all-gather unless u is gathered or in flight
    void wait_gather(std::size_t u);         // waits for u's gather if it is in flight
    void use(std::size_t u, bool backward);  // u is needed now: prefetch after it, wait for it
    void prefetch(std::size_t u, bool backward);
    void release(std::size_t u);
    void on_grad_ready(std::size_t u);
    void launch_ready();  // under mutex_
    void launch(std::size_t u);
    // Finishes the oldest reduce-scatters until at most `keep` are in flight: the shard's gradient
    // (/ N) is added to shard_grad and the full-size buffer is dropped. Under mutex_.
    void retire(std::size_t keep);
    void reset_backward();

    Group& group_;
    Zero3Options options_;
    std::vector<UnitState> units_;
    std::vector<Zero3Slice> slices_;
    std::vector<std::size_t> order_;      // forward order of this micro-step
    std::vector<std::size_t> predicted_;  // forward order of the last micro-step, whole-step units out
    std::size_t next_launch_ = 0;         // index into the reverse of order_
    std::vector<InFlight> in_flight_;
    std::recursive_mutex mutex_;  // hooks run on autograd threads
    bool hold_all_ = false;
    int64_t gathers_ = 0, prefetched_ = 0;
    std::size_t gathered_units_ = 0, ahead_units_ = 0;  // now (whole-step units not counted)
    std::size_t peak_gathered_ = 0, peak_ahead_ = 0, peak_reducing_ = 0;
    std::function<void(std::size_t)> before_gather_;
};

}  // namespace dtune::dist
