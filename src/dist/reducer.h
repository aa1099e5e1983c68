// Data-parallel gradient averaging (libtorch has no C++ DDP) and the ZeRO-1 parameter partition.
//
// GradReducer: gradients packed into buckets of ~bucket_bytes (parameters in reverse order, the
// order backward produces them; one dtype and device per bucket), each bucket all-reduced
// asynchronously as one flat tensor, then averaged and copied back. A parameter whose grad is
// undefined on a rank contributes zeros there; after the reduction its grad is defined on every
// rank iff it was defined on at least one (a per-parameter "used" count rides in the bucket), so
// all ranks stay identical. For gradient accumulation call reduce() only on the final micro-step.
// With enable_overlap(), a post-accumulate-grad hook on every parameter launches a bucket's
// all-reduce during the armed backward as soon as all of its gradients are final, buckets
// strictly in order (so every rank issues the same sequence even when a parameter is unused on
// one of them); reduce() launches the rest and waits. A parameter whose gradient is accumulated
// twice in one backward (shared weights across recomputed segments) makes reduce() throw.
//
// ZeRO-2 (ReducerOptions::owners set): each bucket holds the parameters of one owner rank only and
// is reduced (summed) to that rank instead of all-reduced. Launching a bucket copies its gradients
// into the bucket's flat tensor and drops them from the parameters on every rank; after the
// reduction only the owner gets them back (as views of the flat tensor), so a rank ends the
// reduction holding the gradients of the parameters it owns and no others. A bucket another rank
// owns is dropped as soon as its reduce has finished (checked from the hooks while backward runs),
// so its memory comes back before backward ends.
//
// ZeroPartition (ZeRO-1/2): each parameter belongs to one rank, which alone keeps its optimizer
// state and updates it; sync_parameters() broadcasts every parameter from its owner after the step.
// The caller must clear the gradients of ALL parameters before the next step (the sharded
// optimizer's zero_grad only sees its own).
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dist/group.h"

namespace dtune::dist {

struct ReducerOptions {
    std::size_t bucket_bytes = 25u << 20;  // DDP's default bucket_cap_mb=25
    // ZeRO-2: the rank that keeps each parameter's reduced gradient (index = parameter); empty:
    // every rank keeps every gradient (all-reduce). Contiguous runs make few buckets (see
    // ZeroLayout::kContiguous).
    std::vector<int> owners;
};

class GradReducer {
  public:
    GradReducer(Group& group, std::vector<at::Tensor> params, ReducerOptions options = {});
    ~GradReducer();  // removes the hooks
    GradReducer(const GradReducer&) = delete;
    GradReducer& operator=(const GradReducer&) = delete;

    // Averages every parameter's gradient over the ranks (no-op for one process).
    void reduce();
    // Installs the post-accumulate-grad hooks (once; no-op for one process).
    void enable_overlap();
    // The next backward is the last before reduce(): its hooks launch buckets.
    void arm();
    // Buckets the hooks launched while backward ran, in the last reduce() (tests, logs).
    std::size_t overlapped_buckets() const { return last_overlapped_; }
    // Parameter indices per bucket, in launch order (for tests and logs).
    const std::vector<std::vector<std::size_t>>& buckets() const { return buckets_; }
    // ZeRO-2: buckets of other ranks dropped while backward ran, in the last reduce() (tests, logs).
    std::size_t released_early() const { return last_released_early_; }

  private:
    bool sharded() const { return !bucket_owner_.empty(); }
    void release_finished();
    at::Tensor pack(const std::vector<std::size_t>& bucket) const;
    void unpack(const std::vector<std::size_t>& bucket, const at::Tensor& flat);

    void on_grad_ready(std::size_t param);
    void launch(std::size_t bucket);
    void reset_round();

    Group& group_;
    std::vector<at::Tensor> params_;
    std::vector<std::vector<std::size_t>> buckets_;
    std::vector<int> bucket_owner_;  // ZeRO-2: the rank each bucket is reduced to; empty otherwise
    // Overlap state of the current round (guarded by mutex_: hooks run on autograd threads).
    bool overlap_ = false;
    bool armed_ = false;
    std::mutex mutex_;
    std::vector<std::size_t> bucket_of_;
    std::vector<int> fired_;              // per parameter: hook calls this round
    std::vector<std::size_t> remaining_;  // per bucket: parameters not ready yet
    std::size_t next_launch_ = 0;
    std::size_t next_release_ = 0;  // ZeRO-2: the first launched bucket not yet checked for release
    std::vector<at::Tensor> flats_;
    std::vector<std::unique_ptr<Pending>> works_;
    std::string twice_;  // a parameter whose hook fired twice this round
    std::size_t hook_launches_ = 0, last_overlapped_ = 0;
    std::size_t released_early_ = 0, last_released_early_ = 0;
};

// Averages the gradients of `params` over the ranks in flat all-reduces of at most `bucket_bytes`
// with no host synchronisation, so it can run inside a CUDA graph capture (the graphed
// data-parallel step). An undefined gradient counts as zeros and is left undefined; every rank must
// see the same parameters used (true when one graph is replayed everywhere).
void all_reduce_gradients_flat(Group& group, const std::vector<at::Tensor>& params,
                               std::size_t bucket_bytes = std::size_t{64} << 20);

// Copies rank `root`'s values into every rank's parameters (start of training: identical weights).
void broadcast_parameters(Group& group, const std::vector<at::Tensor>& params, int root = 0);

// Throws Error naming the first parameter (by `names`, else index) whose values differ between
// ranks by more than `tolerance` (max abs over elements of the difference to rank 0).
void check_parameters_identical(Group& group, const std::vector<at::Tensor>& params,
                                const std::vector<std::string>& names = {}, double tolerance = 0.0);

enum class ZeroLayout {
    kGreedy,      // largest first to the least-loaded rank: best balance (ZeRO-1)
    kContiguous,  // runs of consecutive parameters, balanced by element count: the reducer's
                  // buckets (consecutive parameters) then each have one owner (ZeRO-2)
};

class ZeroPartition {
  public:
    // Deterministic on every rank. kContiguous gives every rank at least one parameter when there
    // are at least as many parameters as ranks; each rank's element count is within the largest
    // parameter of total / world_size.
    ZeroPartition(const std::vector<at::Tensor>& params, int world_size,
                  ZeroLayout layout = ZeroLayout::kGreedy);
    int owner(std::size_t index) const { return owner_[index]; }
    const std::vector<int>& owners() const { return owner_; }
    // Indices of the parameters `rank` updates, in parameter order.
    std::vector<std::size_t> owned_by(int rank) const;
    // After each rank stepped its own parameters: broadcast each parameter from its owner.
    void sync_parameters(Group& group, const std::vector<at::Tensor>& params) const;

  private:
    void assign_contiguous(const std::vector<at::Tensor>& params, int world_size);
    std::vector<int> owner_;
};

}  // namespace dtune::dist
