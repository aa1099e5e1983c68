// Data-parallel gradient averaging (libtorch has no C++ DDP) and the ZeRO-1/2 parameter partition.
//
// GradReducer: the gradients live in persistent flat buckets of ~bucket_bytes (parameters in
// reverse order, the order backward produces them; one dtype and device per bucket), allocated
// once: every parameter's `.grad` is a view into its bucket, so backward accumulates in place and
// the bucket is all-reduced and averaged as it stands (no pack or unpack copy). zero_grad() zeroes
// the buckets in place and puts back any view a caller replaced or dropped (an optimizer's
// set-to-none zero_grad); a gradient found replaced at launch is copied into its view, so callers
// that manage `.grad` themselves still get the right sums. With one process nothing is owned.
// set_copy_in() and set_direct() (below) change how backward's gradients reach the collective.
//
// Unused parameters: after the reduction a parameter's grad is defined on every rank iff some rank
// produced one (the optimizers skip undefined gradients). Each bucket carries one "used" flag per
// parameter behind its gradients (set from the post-accumulate-grad hooks, so no host read), summed
// by the same collective. A rank reads those counts back to the host only when one of its own
// parameters in a kept bucket was unused locally (then at most one read per step, all buckets in
// one copy); when it used every parameter, every count is known to be >= 1 without a read.
//
// Overlap (enable_overlap()): during the armed backward a bucket's collective starts as soon as
// all of its gradients are final, buckets strictly in order (so every rank issues the same
// sequence even when a parameter is unused on one of them); reduce() launches the rest and waits.
// A parameter whose gradient is accumulated twice in one armed backward (shared weights across
// recomputed segments) makes reduce() throw. Gradient accumulation: gradients add up in the
// buckets over the micro-steps; arm() and reduce() on the final one only.
//
// ZeRO-2 (ReducerOptions::owners set): each bucket holds the parameters of one owner rank only and
// is reduced (summed) to that rank instead of all-reduced. The owner's buckets are persistent; a
// bucket another rank owns gets its memory when its first gradient arrives (a pre-accumulation hook
// installs the views, so autograd still writes straight into it), and its gradients are dropped
// from the parameters when it is launched. In the armed backward that memory is one of a few
// persistent staging slots (ReducerOptions::staging_slots): a slot is taken over from the earliest
// launched bucket it holds once that bucket's reduce has finished, by a wait on the device stream
// (no host poll), so other ranks' gradients take at most staging_slots buckets of memory, at the
// same addresses every step, and the round can be captured in a CUDA graph. A bucket that finds
// every slot still filling, and every bucket outside the armed backward (accumulation micro-steps,
// no overlap), gets fresh memory, freed after its reduce.
//
// ZeroPartition (ZeRO-1/2): each parameter belongs to one rank, which alone keeps its optimizer
// state and updates it; sync_parameters() then copies every parameter from its owner in flat
// buckets (per owner, in parameter order, one broadcast each; see sync_buckets), not one
// collective per parameter. The caller must clear the gradients of ALL parameters before the next
// step (the sharded optimizer's zero_grad only sees its own): GradReducer::zero_grad().
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "dist/group.h"

namespace dtune::dist {

struct ReducerOptions {
    std::size_t bucket_bytes = 25u << 20;  // DDP's default bucket_cap_mb=25
    // ZeRO-2: the rank that keeps each parameter's reduced gradient (index = parameter); empty:
    // every rank keeps every gradient (all-reduce). Contiguous runs make few buckets (see
    // ZeroLayout::kContiguous).
    std::vector<int> owners;
    // ZeRO-2: staging slots for other ranks' buckets in the armed backward (see above).
    std::size_t staging_slots = 4;
};

class GradReducer {
  public:
    GradReducer(Group& group, std::vector<at::Tensor> params, ReducerOptions options = {});
    ~GradReducer();  // removes the hooks
    GradReducer(const GradReducer&) = delete;
    GradReducer& operator=(const GradReducer&) = delete;

    // Averages every parameter's gradient over the ranks (no-op for one process).
    void reduce();
    // Launches buckets from the hooks during the armed backward (no-op for one process).
    void enable_overlap();
    // The next backward is the last before reduce(): its hooks launch buckets.
    void arm();
    // Copy-in (all-reduce only, not ZeRO-2): zero_grad() leaves the parameters without grads
    // instead of zeroing the buckets, so autograd hands backward's fresh gradients over (summing
    // micro-steps itself) and each is copied into its view when its bucket launches: one copy per
    // gradient instead of the buckets' zeroing plus an in-place add. The parameters' grads are the
    // views again from the launch on, as without it. Not for steps whose gradients must sit at
    // fixed addresses across several CUDA graphs (graphed gradient accumulation).
    // DTUNE_DDP_GRAD_COPY=1 in the trainer.
    void set_copy_in(bool on);
    // Direct: no buckets of this rank's own. Each bucket's gradients are all-reduced where backward
    // left them, in one grouped collective with the bucket's used flags
    // (Group::all_reduce_coalesced_async), so there is neither a copy nor a zeroing pass, and no
    // second copy of the gradients in memory. ZeRO-2: the owner reduces its buckets that way
    // (Group::reduce_coalesced_async), while the other ranks send the same bucket from its staged
    // flat, as views; so no rank holds a persistent gradient buffer. zero_grad() leaves the
    // parameters without grads, as with copy-in; a parameter this rank did not use joins with
    // zeros. Frees the buckets when turned on. The same restriction on graphed gradient
    // accumulation as copy-in.
    // DTUNE_DDP_GRAD_COPY=direct in the trainer.
    void set_direct(bool on);
    // Zeroes every persistent bucket in place and points each parameter's grad at its view again
    // (ZeRO-2: other ranks' parameters get no grad); starts a new accumulation round.
    void zero_grad();
    // After a CUDA graph capture broke off mid-round (gradient accumulation, train::GraphedStep):
    // forgets the collectives the capture recorded (they never ran) and the round's launch state,
    // but keeps the buckets' contents (the gradients summed so far) and which parameters were used,
    // and points every grad at its view again. No-op for one process.
    void abandon_round();
    // Hands the gradients back to autograd for good (the graphed step keeps its own static
    // gradients): hooks removed, buckets no longer referenced here; grads are left as they are.
    void release_gradients();
    // Whether the parameters' grads are views of this reducer's buckets (world size > 1 and not
    // released).
    bool owns_gradients() const { return owns_; }

    // Buckets the hooks launched while backward ran, in the last reduce() (tests, logs).
    std::size_t overlapped_buckets() const { return last_overlapped_; }
    // Parameter indices per bucket, in launch order (for tests and logs).
    const std::vector<std::vector<std::size_t>>& buckets() const { return buckets_; }
    // Bucket `b`'s flat tensor, [gradients | one used flag per parameter]; undefined for a ZeRO-2
    // bucket of another rank outside backward (tests).
    const at::Tensor& bucket_tensor(std::size_t b) const { return flats_[b]; }
    // ZeRO-2: buckets of other ranks dropped while backward ran (their staging slot taken over),
    // in the last reduce() (tests, logs).
    std::size_t released_early() const { return last_released_early_; }
    // ZeRO-2: bytes of the staging slots allocated so far (tests, logs).
    std::size_t staging_bytes() const;
    // Used-count reads back to the host in the last reduce(): 0 when this rank used every
    // parameter of its kept buckets, else 1 (tests).
    std::size_t host_reads() const { return last_host_reads_; }

  private:
    bool sharded() const { return !bucket_owner_.empty(); }
    bool persistent(std::size_t b) const { return !sharded() || bucket_owner_[b] == group_.rank(); }
    void materialise(std::size_t b);
    void install_views(std::size_t b);
    void stage(std::size_t b);
    void drop_foreign(std::size_t b);
    void adopt_grad(std::size_t k);
    void launch_direct(std::size_t bucket);
    void fill_used_flags(std::size_t bucket, at::Tensor& flags);
    void resolve_unused();
    void remove_hooks();

    void on_grad_arriving(std::size_t param);
    void on_grad_ready(std::size_t param);
    void launch(std::size_t bucket);
    void reset_round();

    Group& group_;
    std::vector<at::Tensor> params_;
    std::vector<std::vector<std::size_t>> buckets_;
    std::vector<int> bucket_owner_;   // ZeRO-2: the rank each bucket is reduced to; empty otherwise
    std::vector<long> bucket_numel_;  // per bucket: gradient elements (the flags follow)
    std::vector<std::size_t> bucket_of_;
    std::vector<long> offset_;       // per parameter: where its gradient starts in its bucket
    std::vector<at::Tensor> views_;  // per parameter: its gradient's view (undefined: bucket absent)
    std::vector<at::Tensor> flats_;  // per bucket: [numel + n] (ZeRO-2 foreign: while in use only)
    std::vector<std::pair<std::size_t, unsigned>> pre_hooks_;  // ZeRO-2: (parameter, hook position)
    std::vector<at::Tensor> slots_;  // ZeRO-2: staging slots (bytes), allocated on first use
    std::vector<long> slot_bucket_;  // per slot: the bucket it holds this round, -1 for none
    std::vector<char> staged_;       // per bucket: its flat is a staging slot this round
    long slot_bytes_ = 0;            // the largest foreign bucket, gradients and flags
    bool owns_ = false;
    bool copy_in_ = false;
    bool direct_ = false;
    std::vector<at::Tensor> flags_;  // direct: per bucket, one used flag per parameter [n]
    bool averaged_ = false;          // the backend averaged the last launched bucket (NCCL): no division
    // Round state (guarded by mutex_: hooks run on autograd threads).
    bool overlap_ = false;
    bool armed_ = false;
    std::mutex mutex_;
    std::vector<char> used_;              // per parameter: a gradient arrived this round (any micro-step)
    std::vector<int> fired_;              // per parameter: hook calls in the armed backward
    std::vector<std::size_t> remaining_;  // per bucket: parameters not ready yet
    std::vector<char> launched_;          // per bucket: its collective was started this round
    std::size_t next_launch_ = 0;
    std::vector<std::unique_ptr<Pending>> works_;
    std::string twice_;  // a parameter whose hook fired twice this round
    std::size_t hook_launches_ = 0, last_overlapped_ = 0;
    std::size_t released_early_ = 0, last_released_early_ = 0;
    std::size_t last_host_reads_ = 0;
};

// Averages the gradients of `params` over the ranks in flat all-reduces of at most `bucket_bytes`
// with no host synchronisation, so it can run inside a CUDA graph capture (the graphed
// data-parallel step). An undefined gradient counts as zeros and is left undefined; every rank must
// see the same parameters used (true when one graph is replayed everywhere).
void all_reduce_gradients_flat(Group& group, const std::vector<at::Tensor>& params,
                               std::size_t bucket_bytes = std::size_t{64} << 20);

// Copies rank `root`'s values into every rank's parameters (start of training: identical weights),
// in flat buckets of at most `bucket_bytes` (one broadcast each).
void broadcast_parameters(Group& group, const std::vector<at::Tensor>& params, int root = 0,
                          std::size_t bucket_bytes = std::size_t{64} << 20);

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
    // The broadcasts sync_parameters issues, in order: per owner rank (0..N-1), its parameters in
    // parameter order cut into runs of one dtype and device of at most `bucket_bytes` (a larger
    // parameter alone). The same on every rank.
    std::vector<std::vector<std::size_t>> sync_buckets(const std::vector<at::Tensor>& params,
                                                       std::size_t bucket_bytes = kSyncBucketBytes) const;
    // After each rank stepped its own parameters: one broadcast per sync bucket from its owner
    // (bit-exact copies). A bucket of several parameters goes through a flat staging tensor kept
    // between calls (at most bucket_bytes per dtype and device); a lone parameter is broadcast in
    // place when it is contiguous.
    void sync_parameters(Group& group, const std::vector<at::Tensor>& params,
                         std::size_t bucket_bytes = kSyncBucketBytes);

    static constexpr std::size_t kSyncBucketBytes = std::size_t{64} << 20;

  private:
    void assign_contiguous(const std::vector<at::Tensor>& params, int world_size);
    std::vector<int> owner_;
    std::vector<at::Tensor> staging_;  // sync_parameters: one flat buffer per dtype and device
};

}  // namespace dtune::dist
