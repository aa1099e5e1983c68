// ZeRO-2 parts of DataParallel (see data_parallel.h): the global gradient norm over sharded
// gradients, the fp16 overflow agreement, and the log of what a rank holds after the reduction.
//
// Invariant: with ZeRO-2 each parameter's reduced gradient exists on its owner only, so anything
// computed from gradients that must be the same on every rank (the clipping coefficient, whether
// an fp16 step is skipped) goes through one collective here.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_foreach_norm.h>

#include "core/error.h"
#include "core/log.h"
#include "dist/group.h"
#include "dist/reducer.h"
#include "train/data_parallel.h"
#include "train/optimizer.h"

namespace dtune::train {

at::Tensor DataParallel::clip_grad_norm_async(const std::vector<at::Tensor>& params, double max_norm) {
    if (zero3_) return sharded_clip_grad_norm(params, max_norm);  // data_parallel_zero3.cpp
    if (zero_stage_ < 2) return train::clip_grad_norm_async(params, max_norm);
    at::NoGradGuard no_grad;
    const auto n = static_cast<long>(params.size());
    std::vector<at::Tensor> grads;
    std::vector<long> index;
    for (long i = 0; i < n; ++i)
        if (params[static_cast<std::size_t>(i)].grad().defined()) {
            grads.push_back(params[static_cast<std::size_t>(i)].grad());
            index.push_back(i);
        }
    // [2, N]: row 0 the norm of each gradient this rank holds, row 1 a 1 where it holds one; zeros
    // elsewhere. Every column has one contributor (its owner), so the sum over ranks is exact.
    auto table = at::zeros({2, n}, at::TensorOptions().dtype(at::kFloat).device(device_));
    if (!grads.empty()) {
        std::vector<at::Tensor> norms = at::_foreach_norm(grads, 2, at::kFloat);  // as clip_grad_norm_async
        for (auto& v : norms) v = v.to(device_, at::kFloat);
        if (index != clip_index_ || !clip_index_device_.defined()) {  // an upload: not inside a capture
            clip_index_ = index;
            clip_index_device_ = at::tensor(index, at::TensorOptions().dtype(at::kLong)).to(device_);
        }
        table[0].index_copy_(0, clip_index_device_, at::stack(norms));  // [G] into [N]
        table[1].index_fill_(0, clip_index_device_, 1.0);
    }
    group_->all_reduce_sum_(table);
    // The same [G] vector, in the same order, that clip_grad_norm_async stacks unsharded. A graphed
    // step gives every parameter a gradient: all N entries, with no data-dependent size to read back.
    const at::Tensor held = step_graphed_ ? table[0] : table[0].masked_select(table[1] > 0.5);  // [G]
    if (held.numel() == 0) return {};
    const at::Tensor total = at::linalg_vector_norm(held, 2);
    if (max_norm <= 0 || grads.empty()) return total;
    const at::Tensor coef = at::clamp_max(max_norm / (total + 1e-6), 1.0);  // scalar, on device
    for (auto& g : grads) g.mul_(coef.to(g.device(), g.scalar_type()));
    return total;
}

bool DataParallel::gradients_overflowed(bool local) {
    if (zero_stage_ < 2) return local;
    auto flag = at::full({1}, local ? 1.0 : 0.0, at::TensorOptions().dtype(at::kFloat).device(device_));
    group_->all_reduce_sum_(flag);
    return flag.cpu().item<float>() > 0;
}

// Measured, not assumed: counts the gradients the parameters actually hold after the reduction.
// tests/dist/zero2_multi_test.cpp reads this line to check that no other rank's gradient stayed.
void DataParallel::report_gradient_shard() {
    shard_reported_ = true;
    long owned = 0, owned_held = 0, foreign_held = 0;
    int64_t held_elements = 0, held_bytes = 0, all_elements = 0;
    for (std::size_t i = 0; i < params_.size(); ++i) {
        const bool mine = partition_->owner(i) == env_.rank;
        const at::Tensor& g = params_[i].grad();
        all_elements += params_[i].numel();
        owned += mine;
        if (!g.defined()) continue;
        (mine ? owned_held : foreign_held) += 1;
        held_elements += g.numel();
        held_bytes += g.numel() * static_cast<int64_t>(g.element_size());
    }
    log::info() << "ZeRO-2 rank " << env_.rank << ": after the gradient reduction this rank holds "
                << owned_held << " gradients of its " << owned << " parameters (" << held_elements << " of "
                << all_elements << " elements, " << static_cast<double>(held_bytes) / (1 << 20)
                << " MiB) and " << foreign_held << " of other ranks' parameters; "
                << reducer_->released_early() << " other ranks' buckets released during backward";
}

}  // namespace dtune::train
