// Data-parallel gradient averaging (libtorch has no C++ DDP) and the ZeRO-1 parameter partition.
//
// GradReducer: gradients packed into buckets of ~bucket_bytes (parameters in reverse order, the
// order backward produces them; one dtype and device per bucket), each bucket all-reduced
// asynchronously as one flat tensor, then averaged and copied back. A parameter whose grad is
// undefined on a rank contributes zeros there; after the reduction its grad is defined on every
// rank iff it was defined on at least one (a per-parameter "used" count rides in the bucket), so
// all ranks stay identical. For gradient accumulation call reduce() only on the final micro-step.
//
// ZeroPartition (ZeRO-1): each parameter belongs to one rank, which alone keeps its optimizer state
// and updates it; sync_parameters() broadcasts every parameter from its owner after the step. The
// caller must clear the gradients of ALL parameters before the next step (the sharded optimizer's
// zero_grad only sees its own).
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <string>
#include <vector>

#include "dist/group.h"

namespace dtune::dist {

struct ReducerOptions {
    std::size_t bucket_bytes = 25u << 20;  // DDP's default bucket_cap_mb=25
};

class GradReducer {
  public:
    GradReducer(Group& group, std::vector<at::Tensor> params, ReducerOptions options = {});

    // Averages every parameter's gradient over the ranks (no-op for one process).
    void reduce();
    // Parameter indices per bucket, in launch order (for tests and logs).
    const std::vector<std::vector<std::size_t>>& buckets() const { return buckets_; }

  private:
    at::Tensor pack(const std::vector<std::size_t>& bucket) const;
    void unpack(const std::vector<std::size_t>& bucket, const at::Tensor& flat);

    Group& group_;
    std::vector<at::Tensor> params_;
    std::vector<std::vector<std::size_t>> buckets_;
};

// Copies rank `root`'s values into every rank's parameters (start of training: identical weights).
void broadcast_parameters(Group& group, const std::vector<at::Tensor>& params, int root = 0);

// Throws Error naming the first parameter (by `names`, else index) whose values differ between
// ranks by more than `tolerance` (max abs over elements of the difference to rank 0).
void check_parameters_identical(Group& group, const std::vector<at::Tensor>& params,
                                const std::vector<std::string>& names = {}, double tolerance = 0.0);

class ZeroPartition {
  public:
    // Greedy by size (largest first to the least-loaded rank), deterministic on every rank.
    ZeroPartition(const std::vector<at::Tensor>& params, int world_size);
    int owner(std::size_t index) const { return owner_[index]; }
    // Indices of the parameters `rank` updates, in parameter order.
    std::vector<std::size_t> owned_by(int rank) const;
    // After each rank stepped its own parameters: broadcast each parameter from its owner.
    void sync_parameters(Group& group, const std::vector<at::Tensor>& params) const;

  private:
    std::vector<int> owner_;
};

}  // namespace dtune::dist
