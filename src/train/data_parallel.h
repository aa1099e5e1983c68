// Data-parallel training for the trainer: joins the job the torchrun variables describe (`dtune
// launch` or torchrun), gives every rank rank 0's starting weights, averages the gradients of the
// trainable parameters after backward (dist::GradReducer, ~25 MB buckets), partitions optimizer
// state with ZeRO-1, and makes every per-step decision (stop, GPU fault, the logged loss) with one
// small all-reduce so that all ranks leave the loop at the same step. A rank that fails publishes
// why on the group's fault channel (report_failure; also done for any exception that unwinds
// through the destructor), so the others stop within a poll interval and exit with its code.
//
// Invariants: with one process every call is a no-op and nothing touches the network; collectives
// are issued in the same order on every rank (the trainer calls these at fixed points of its loop);
// with ZeRO-1 each parameter has exactly one owner, which alone keeps its optimizer state and
// updates it, and after after_step() every rank holds the same weights.
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
class GradReducer;
class ZeroPartition;
}  // namespace dtune::dist

namespace dtune::train {

class TrainConfig;

// What the ranks agreed on after a step.
struct StepAgreement {
    bool stop = false;     // some rank was asked to stop (SIGINT/SIGTERM)
    int fault_rank = -1;   // the lowest rank whose node reported a GPU fault, -1 when none
    int fault_gpu = -1;    // that rank's faulty GPU index (-1 unknown)
    double mean_loss = 0;  // the loss averaged over ranks
    bool fault() const { return fault_rank >= 0; }
};

// zero_stage from config.json, else DTUNE_ZERO_STAGE (set by `dtune launch --accelerate_config`
// from deepspeed_config.zero_stage), else 0. Stage 2 runs as 1 with a warning (ZeRO-2 is not
// built yet); UsageError for any other stage.
int resolve_zero_stage(const TrainConfig& config);

class DataParallel {
  public:
    // Joins the job of `env` (a single process when env.world_size == 1). Tensors of collectives
    // live on `device` (CUDA: NCCL, CPU: Gloo).
    DataParallel(const dist::DistEnv& env, c10::Device device, int zero_stage,
                 std::chrono::seconds collective_timeout);
    ~DataParallel();
    DataParallel(const DataParallel&) = delete;
    DataParallel& operator=(const DataParallel&) = delete;

    // The device a launched rank trains on: cuda:LOCAL_RANK when `requested` is CUDA without an
    // explicit index (one GPU per process), else `requested`.
    static c10::Device pick_device(c10::Device requested, const dist::DistEnv& env);

    int rank() const { return env_.rank; }
    int local_rank() const { return env_.local_rank; }
    int world_size() const { return env_.world_size; }
    int zero_stage() const { return zero_stage_; }
    void barrier();
    std::function<void()> barrier_function();

    // Broadcasts rank 0's values of `params` to every rank and prepares the reducer (and the ZeRO
    // partition). Call once, before the optimizer is built.
    void attach(std::vector<at::Tensor> params);
    // Whether this rank's optimizer updates parameter `index` of attach()'s list (ZeRO-1: only
    // the ones it owns; otherwise all).
    bool updates(std::size_t index) const;
    // Call before the last micro-step's backward: its gradient hooks start the all-reduce of each
    // bucket as soon as its gradients are final (overlap with backward; DTUNE_DDP_OVERLAP=0 turns
    // it off). No communication happens on the other micro-steps.
    void arm_reduction();
    // Averages every attached gradient over the ranks (after the last micro-step's backward):
    // launches what the hooks did not, waits for all buckets.
    void reduce_gradients();
    // After the optimizer step: ZeRO-1 broadcasts each parameter from its owner; then drops the
    // gradients of every attached parameter (the sharded optimizer's zero_grad sees only its own).
    void after_step();
    // One all-reduce: the stop and fault requests of every rank and the mean loss.
    // `fault_gpu` is gpu_fault_request() (GPU index + 1, 0 when none).
    StepAgreement agree(double loss, bool stop, int fault_gpu);
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
    dist::DistEnv env_;
    c10::Device device_;
    int zero_stage_ = 0;
    std::unique_ptr<dist::Group> group_;
    std::unique_ptr<dist::GradReducer> reducer_;
    std::unique_ptr<dist::ZeroPartition> partition_;
    std::vector<at::Tensor> params_;
    bool failed_ = false;  // report_failure() ran: end with abort(), not a normal shutdown
};

// Per-rank checkpoint file names.
std::string rank_rng_file(int rank);                    // "random_states_rank<r>.safetensors" (r >= 1)
std::string optimizer_shard_file(int rank, int world);  // "optimizer-shard-<r>-of-<w>.safetensors"
bool is_optimizer_shard_file(const std::string& relative_path);

}  // namespace dtune::train
