// Data-parallel training for the trainer: joins the job the torchrun variables describe (`dtune
// launch` or torchrun), gives every rank rank 0's starting weights, averages the gradients of the
// trainable parameters after backward (dist::GradReducer, ~25 MB buckets), partitions optimizer
// state with ZeRO-1 (and the gradients too with ZeRO-2: reduced to their owner only; ZeRO-3 shards
// the parameters as well, see attach_sharded and dist/zero3.h), and makes every
// per-step decision (stop, GPU fault, the logged loss) with one small all-reduce, read back a step
// later without a wait of its own, so that all ranks leave the loop at the same step. A rank that
// fails publishes why on the group's fault channel
// (report_failure; also done for any exception that unwinds through the destructor), so the others
// stop within a poll interval and exit with its code.
//
// Invariants: with one process every call is a no-op and nothing touches the network; collectives
// are issued in the same order on every rank (the trainer calls these at fixed points of its loop);
// with ZeRO-1/2 each parameter has exactly one owner, which alone keeps its optimizer state (ZeRO-2:
// and its reduced gradient) and updates it, and after after_step() every rank holds the same weights.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dist/env.h"

namespace dtune::dist {
class Group;
class Pending;
class GradReducer;
class ZeroPartition;
struct Zero3Options;
struct Zero3Slice;
class Zero3Engine;
}  // namespace dtune::dist

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace dtune::train {

class TrainConfig;
class ShardedModel;
class DeferredParameterSync;

// What the ranks agreed on after a step. The step loop issues the agreement at the end of each
// step and reads it one step later (train/readback.h), so a stop or a GPU fault requested during
// step N ends every rank's loop after step N + 1, with no device-to-host wait of its own.
struct StepAgreement {
    bool stop = false;     // some rank was asked to stop (SIGINT/SIGTERM)
    int fault_rank = -1;   // the lowest rank whose node reported a GPU fault, -1 when none
    int fault_gpu = -1;    // that rank's faulty GPU index (-1 unknown)
    double mean_loss = 0;  // the loss averaged over ranks
    bool fault() const { return fault_rank >= 0; }
};

// zero_stage from config.json, else DTUNE_ZERO_STAGE (set by `dtune launch --accelerate_config`
// from deepspeed_config.zero_stage), else 0; SimpleTuner's fsdp_enable true means 3. UsageError for
// a stage other than 0..3, fsdp_enable with another zero_stage, or offload_param_device cpu or
// fsdp_cpu_offload true with a stage other than 3.
int resolve_zero_stage(const TrainConfig& config);

// ZeRO-3 settings from SimpleTuner's fsdp_* keys, accelerate's offload_param_device
// (DTUNE_OFFLOAD_PARAM_DEVICE: none or cpu) and DTUNE_ZERO3_PREFETCH (blocks gathered ahead, default
// 1, 0 off): reshard_after_forward from fsdp_reshard_after_forward, offload_params also from
// fsdp_cpu_offload true; UsageError naming the key or variable for what the engine does not do (nvme
// offload, a bad prefetch depth) or for a parameter device that contradicts fsdp_cpu_offload.
dist::Zero3Options resolve_zero3_options(const TrainConfig& config);

// How backward's gradients reach the data-parallel all-reduce (ZeRO-0/1), from DTUNE_DDP_GRAD_COPY:
// kDirect (direct or unset, the default): no gradient buffers, each bucket's gradients all-reduced
// where autograd left them in one grouped collective (dist::GradReducer::set_direct), which saves a
// copy of every gradient and a gradient-sized buffer (2 H200s, SDXL full fine-tune: 101.8 ms a step
// and 25.0 GiB, against 109.7 ms and 29.8 GiB copying into 25 MiB buckets); kCopyIn (1): copied
// into the reducer's flat buckets when a bucket launches (dist::GradReducer::set_copy_in); kInPlace
// (0): the buckets are zeroed and backward adds into them. UsageError otherwise.
enum class GradientHandoff { kInPlace, kCopyIn, kDirect };
GradientHandoff gradient_handoff_requested();
// Whether DTUNE_DDP_GRAD_COPY names the handoff (the trainer says why an explicit direct is not
// used, and stays quiet about its own default).
bool gradient_handoff_named();

// DTUNE_ZERO_SYNC: when ZeRO-1/2 ranks get each other's updated parameters. forward (or unset, the
// default): at the start of the next forward, overlapping it, each block's parameters of one owner
// moved into one flat buffer and broadcast at once (DataParallel::defer_parameter_sync);
// forward-params: the same, one broadcast per parameter; step: right after the optimizer step.
// UsageError naming the variable otherwise.
enum class ZeroSync { kForward, kForwardParams, kStep };
ZeroSync zero_sync_requested();

// DTUNE_ZERO1_LAYOUT: which parameters a ZeRO-1 rank owns. contiguous (or unset, the default): a run
// of consecutive parameters balanced by elements (dist::ZeroLayout::kContiguous, as ZeRO-2), so a
// block has one or two owners; greedy: largest first to the least-loaded rank. true for greedy;
// UsageError naming the variable otherwise.
bool zero1_layout_greedy();

// DTUNE_GRAPH_REDUCER=0: the graphed data-parallel step all-reduces every gradient in one flat pass
// after backward instead of through the reducer's buckets (DataParallel::graph_reduces_in_buckets;
// cuda_graph_blocker keeps ZeRO-2 eager then).
bool graph_reducer_disabled();

// The data-parallel gradient bucket size for `handoff`: DTUNE_BUCKET_MB (MiB), else 100 MiB for
// kDirect (one grouped all-reduce per bucket: fewer, larger groups overlapped the backward best on 2
// H200s) and 25 MiB (DDP's bucket_cap_mb) for the flat buckets; UsageError naming the variable for a
// value that is not a number in (0, 4096].
std::size_t gradient_bucket_bytes(GradientHandoff handoff);

// ZeRO-2: how many of other ranks' gradient buckets a rank stages at once in the armed backward
// (dist::ReducerOptions::staging_slots): DTUNE_ZERO2_SLOTS, else 4; UsageError naming the variable
// for a value that is not a whole number in [1, 64].
std::size_t zero2_staging_slots();

// offload_optimizer_device from config.json, else DTUNE_OFFLOAD_OPTIMIZER_DEVICE (set by `dtune launch
// --accelerate_config` from deepspeed_config.offload_optimizer_device), else none. true for "cpu"
// (train::CpuOffloadOptimizer), and for SimpleTuner's fsdp_cpu_offload true; UsageError naming the
// origin for anything but "none" or "cpu", or for a device that contradicts fsdp_cpu_offload.
bool resolve_offload_optimizer(const TrainConfig& config);

// An offload device setting (offload_param_device or offload_optimizer_device): the config key's
// value, else the environment variable `dtune launch` sets from accelerate's deepspeed_config
// (`env`), else "". `origin` names where it came from, for errors. With SimpleTuner's
// fsdp_cpu_offload true the device is "cpu", and any other explicit value is a UsageError naming
// both. Used by resolve_zero3_options and resolve_offload_optimizer.
struct OffloadDevice {
    std::string value;
    std::string origin;
};
OffloadDevice resolve_offload_device(const TrainConfig& config, const char* key, const char* env);

class DataParallel {
  public:
    // Joins the job of `env` (a single process when env.world_size == 1). Tensors of collectives
    // live on `device` (CUDA: NCCL, CPU: Gloo).
    DataParallel(const dist::DistEnv& env, c10::Device device, int zero_stage,
                 std::chrono::seconds collective_timeout);
    ~DataParallel();
    DataParallel(const DataParallel&) = delete;
    DataParallel& operator=(const DataParallel&) = delete;

    // The device a rank trains on, from the `device` option's text and the `cuda_devices` this
    // process sees. Launched with "cuda" or "auto" on a CUDA machine: cuda:LOCAL_RANK (one GPU per
    // process), or cuda:0 when each process is shown a single GPU (CUDA_VISIBLE_DEVICES per rank).
    // An explicit "cuda:N" while several processes share the node would put them all on GPU N
    // (NCCL refuses that as a duplicate GPU): a UsageError. Not launched: the text as parse_device
    // reads it.
    static c10::Device pick_device(const std::string& text, const dist::DistEnv& env, int cuda_devices);

    int rank() const { return env_.rank; }
    int local_rank() const { return env_.local_rank; }
    int world_size() const { return env_.world_size; }
    int zero_stage() const { return zero_stage_; }
    void barrier();
    std::function<void()> barrier_function();

    // Broadcasts rank 0's values of `params` to every rank and prepares the reducer (and the ZeRO
    // partition), whose gradients reach the all-reduce by `handoff` (ZeRO-0/1; ZeRO-2 reduces each
    // bucket in place to its owner). Call once, before the optimizer is built.
    void attach(std::vector<at::Tensor> params, GradientHandoff handoff = GradientHandoff::kInPlace);
    // ZeRO-3, instead of attach(): rank 0's weights everywhere, then the trainable parameters
    // (`names`, `params`, from `model`) sharded by unit (train/zero3_model.h); afterwards 1/N of
    // them is resident between steps and the optimizer updates zero3_slices().
    void attach_sharded(torch::nn::Module& model, const std::vector<std::string>& names,
                        std::vector<at::Tensor> params, const dist::Zero3Options& options);
    // ZeRO-3 for a LoRA, instead of attach(): the frozen base (`base_names`, `base_params`, from
    // `model`) sharded by unit with no gradients, and the adapters (`trainable`) replicated: rank
    // 0's values everywhere, gradients averaged by the reducer, the optimizer on whole tensors,
    // as plain data parallelism does. zero3_slices() is then empty.
    void attach_sharded_base(torch::nn::Module& model, const std::vector<std::string>& base_names,
                             std::vector<at::Tensor> base_params, std::vector<at::Tensor> trainable,
                             const dist::Zero3Options& options);
    // Whether the trainable parameters are sharded (ZeRO-3 full fine-tune; not a LoRA's base).
    bool sharded_parameters() const { return zero3_ != nullptr && !sharded_base_only_; }
    dist::Zero3Engine* zero3_engine();
    // This rank's parameter slices (ZeRO-3; empty otherwise): the optimizer's parameters.
    const std::vector<dist::Zero3Slice>& zero3_slices() const;
    // The tensors whose gradients the step clips, unscales and the optimizer updates: ZeRO-3 this
    // rank's slices, otherwise `params`.
    std::vector<at::Tensor> gradient_holders(const std::vector<at::Tensor>& params) const;
    // ZeRO-3, around every micro-step: gathers the root unit before the forward; after the
    // backward, finishes the reduce-scatter into the shard gradients. No-ops otherwise.
    void before_forward();
    void after_backward();
    // Whole weights on every rank (ZeRO-3: collective, every rank must call it) until
    // release_weights(). Returns false when nothing was gathered (not sharded, or already whole).
    bool gather_weights();
    void release_weights();
    // Whether this rank's optimizer updates parameter `index` of attach()'s list (ZeRO-1/2: only
    // the ones it owns; otherwise all).
    bool updates(std::size_t index) const;
    // Call before the last micro-step's backward: its gradient hooks start the all-reduce of each
    // bucket as soon as its gradients are final (overlap with backward; DTUNE_DDP_OVERLAP=0 turns
    // it off). No communication happens on the other micro-steps.
    void arm_reduction();
    // Averages every attached gradient over the ranks (after the last micro-step's backward):
    // launches what the hooks did not, waits for all buckets. ZeRO-2: afterwards this rank holds
    // only the gradients of the parameters it owns.
    void reduce_gradients();
    // The gradient average with no host synchronisation (inside a CUDA graph capture): one flat
    // all-reduce per 64 MB of `params`' gradients, no overlap with backward. The fallback of the
    // graphed step when graph_reduces_in_buckets() is false.
    void all_reduce_gradients_capturable(const std::vector<at::Tensor>& params);
    // The graphed data-parallel step (zero_stage 0, 1 or 2, several ranks) keeps the reducer: the
    // gradients sit at static addresses (autograd's, the reducer's buckets or, ZeRO-2, its staging
    // slots for other ranks' buckets), the armed backward's hooks launch each bucket's collective as
    // soon as it is final (captured with the rest, so the collectives overlap the backward on every
    // replay), and the step clears the gradients at its end (zero_gradients_in_step). ZeRO-1/2 the
    // same (their parameter broadcasts open the next captured forward with defer_parameter_sync(),
    // else they run in after_step, after the replay). False with one process,
    // with ZeRO-3, or with DTUNE_GRAPH_REDUCER=0 (then: all_reduce_gradients_capturable after
    // backward; cuda_graph_blocker keeps ZeRO-2 eager there).
    bool graph_reduces_in_buckets() const;
    // Called by the graphed step after its optimizer step (inside the capture): the buckets zeroed
    // in place and the grads views of them again. From then on after_step() leaves the gradients
    // alone (the step already cleared them, on replays too).
    void zero_gradients_in_step();
    // After a failed CUDA graph capture of a gradient-accumulation micro-step: the reducer forgets
    // the round's recorded collectives and keeps the gradients summed so far
    // (dist::GradReducer::abandon_round). No-op without the reducer's buckets.
    void abandon_reduction();
    // A CUDA graph step was launched (dist::Group::note_graph_launch: the next collective issued
    // outside a graph waits for the device first, as NCCL requires with graph mixing off).
    void note_graph_launch();
    // ZeRO-1/2 with several ranks, after attach(): the parameters are no longer broadcast by
    // after_step() but at the start of the next forward, one grouped broadcast per unit of `model`
    // overlapping the forward (train/zero_sync.h): before_forward() issues them, each unit waits for
    // its own, reduce_gradients() waits for any left. Anything else that reads the weights between
    // steps calls flush_parameters() first (gather_weights() and check_identical() do). `coalesce`:
    // each unit's parameters of one owner move into one flat buffer, broadcast at once (call it
    // before anything keeps a parameter's data pointer: the optimizer, a CUDA graph). No-op
    // otherwise.
    void defer_parameter_sync(torch::nn::Module& model, bool coalesce = true);
    bool defers_parameter_sync() const { return deferred_ != nullptr; }
    // With the sync deferred: every rank's weights made whole now (collective: every rank calls it
    // at the same point). No-op otherwise.
    void flush_parameters();
    // After the optimizer step: ZeRO-1/2 copy the parameters from their owners (one broadcast per
    // ~64 MB run of an owner's parameters; deferred to the next forward after
    // defer_parameter_sync()); then clears the gradients of every attached parameter
    // (the sharded optimizer's zero_grad sees only its own): with several ranks the reducer's
    // buckets are zeroed in place and the grads are views of them again, else grads are dropped.
    void after_step();
    // Gradient clipping by norm over the attached parameters (`params`, attach()'s order): the
    // global norm of all gradients, returned (undefined when no parameter has a gradient). ZeRO-2:
    // each rank holds only its own gradients, so the per-parameter norms are summed over the
    // ranks (one all-reduce of [2, N]) and the norm is taken over the same vector an unsharded run
    // would stack, so it is bit-identical to one. max_norm <= 0: measure only. With
    // set_step_graphed(true) no step reads back to the host: the positions of this rank's gradients
    // go to the device once per change of their pattern (before the capture, in the warm-up steps),
    // and the norm is taken over every parameter's entry (a graph gives every parameter a gradient,
    // so that is the same vector).
    at::Tensor clip_grad_norm_async(const std::vector<at::Tensor>& params, double max_norm);
    // The step runs as a CUDA graph (Trainer::init_graph): clip_grad_norm_async stays on the device.
    void set_step_graphed(bool on) { step_graphed_ = on; }
    // fp16: whether the gradients of any rank overflowed. ZeRO-2 all-reduces `local` (each rank saw
    // only its shard); otherwise every rank holds the same gradients and `local` is returned.
    bool gradients_overflowed(bool local);
    // One all-reduce: the stop and fault requests of every rank and the mean loss, waited for.
    // `fault_gpu` is gpu_fault_request() (GPU index + 1, 0 when none). One process: no collective.
    StepAgreement agree(double loss, bool stop, int fault_gpu);
    // The same all-reduce started without a host wait, for the step loop (several ranks): `loss`
    // is this rank's loss as a 1-element float64 tensor on the training device; the flags
    // ([2 + world_size] float64 there) hold the sums once `reduce` has finished (train/readback.h
    // reads them back with the step's other scalars, then read_agreement() decodes them).
    struct PendingAgreement {
        at::Tensor flags;
        std::unique_ptr<dist::Pending> reduce;
    };
    PendingAgreement agree_async(const at::Tensor& loss, bool stop, int fault_gpu);
    // The agreement in flags read back on the host (agreement_size() values). Throws PeerFailure
    // when another rank has failed (NCCL: an aborted all-reduce leaves garbage behind).
    StepAgreement read_agreement(const double* flags) const;
    int64_t agreement_size() const { return 2 + env_.world_size; }
    // Publishes this rank's failure to the other ranks (fault channel): a CUDA error as a GPU
    // fault (exit 75), a dtune::Error with its exit code, anything else with 1. Nothing for a
    // dist::PeerFailure (another rank failed first) or with one process.
    void report_failure(const std::exception& error);
    // Throws Error naming the parameter when the ranks' weights differ by more than `tolerance`.
    void check_identical(const std::vector<std::string>& names, double tolerance);

    // Rank 0 writes a token file into `dir`; every rank must read it back within
    // DTUNE_SHARED_DIR_WAIT_S seconds (default 60: NFS may cache a negative lookup that long).
    // UsageError on every rank naming the directory and the fix when one cannot. No-op for one
    // process.
    void check_shared_output_dir(const std::filesystem::path& dir);

    // Writes a per-rank file in a checkpoint being saved: every rank calls this in the same order;
    // rank 0 first creates `tmp_dir` (before the call), the others write their files in `write`
    // between two barriers.
    void write_shards(const std::filesystem::path& tmp_dir,
                      const std::function<void(const std::filesystem::path&)>& write);

  private:
    void report_gradient_shard();  // ZeRO-2, first reduction: what this rank holds (log)
    void zero3_after_step();       // ZeRO-3: drops the shard gradients
    // ZeRO-3: the norm over every rank's slices (each element is on one rank): one all-reduce.
    at::Tensor sharded_clip_grad_norm(const std::vector<at::Tensor>& slices, double max_norm);

    dist::DistEnv env_;
    c10::Device device_;
    int zero_stage_ = 0;
    std::unique_ptr<dist::Group> group_;
    std::unique_ptr<dist::GradReducer> reducer_;
    std::unique_ptr<dist::ZeroPartition> partition_;
    std::unique_ptr<ShardedModel> zero3_;
    std::unique_ptr<DeferredParameterSync> deferred_;  // defer_parameter_sync()
    bool sharded_base_only_ = false;                   // attach_sharded_base: zero3_ holds a frozen base
    std::vector<at::Tensor> params_;
    bool shard_reported_ = false;
    bool step_graphed_ = false;
    std::vector<long> clip_index_;  // ZeRO-2 clip: positions of this rank's gradients, and on the device
    at::Tensor clip_index_device_;
    bool failed_ = false;  // report_failure() ran: end with abort(), not a normal shutdown
    // zero_gradients_in_step() ran: the graphed step zeroes the gradients, after_step() leaves them.
    bool step_clears_gradients_ = false;
    bool overlap_reported_ = false;      // reduce_gradients() logged the buckets started in backward
    bool sync_reported_ = false;         // after_step() logged its ZeRO-1/2 broadcasts
    bool graph_reducer_allowed_ = true;  // DTUNE_GRAPH_REDUCER is not 0 (read at construction)
};

// Per-rank checkpoint file names.
std::string rank_rng_file(int rank);                    // "random_states_rank<r>.safetensors" (r >= 1)
std::string optimizer_shard_file(int rank, int world);  // "optimizer-shard-<r>-of-<w>.safetensors"
bool is_optimizer_shard_file(const std::string& relative_path);

}  // namespace dtune::train
