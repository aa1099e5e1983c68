// The attention outputs of gradient-checkpointed blocks, kept in pinned host memory from the forward
// to the recomputation in backward, so that the recomputation skips the attention kernel (the one
// costly op of a block that reads nothing a checkpoint keeps: its projections are recomputed anyway,
// for their LoRA gradients).
//
// A checkpointed block drops its activations in the forward and recomputes them in backward; its
// attention forward (cuDNN's fused kernel) then runs twice a step. With a stash, the first forward
// runs the kernel with its log-sum-exp, copies the output to the host on a side stream (the output
// is needed again only in backward, so the copy hides behind the next blocks), and keeps the
// log-sum-exp (S floats per head) on the GPU. The recomputation starts the copy back when the block
// begins, before its projections, and hands the attention backward the saved output and statistics:
// the same bits the kernel gave, so gradients equal those of the recomputing path that sees the
// same forward kernel. GPU memory is unchanged (one output in flight each way); host memory holds
// one output per checkpointed attention (28 MiB a block for Flux.1 at 1024², batch 1).
//
// A kept output is tagged with the checkpointed() call that made it (unit_hooks.h's checkpoint_call)
// and only that call's recomputation takes it: should one slot be saved twice before a backward (two
// forwards into one loss), the earlier call recomputes its attention.
//
// It applies on CUDA to bf16/fp16 attention without mask or dropout where SDPA picks cuDNN's kernel;
// elsewhere attend() is SDPA. Copies and waits are stream-ordered (events, no host waits), so a step
// captured as a CUDA graph replays them. Host buffers are never freed while the stash lives (graphs
// hold their addresses) and are bounded by a budget: DTUNE_ATTENTION_STASH_GIB (default: a
// sixteenth of physical memory divided among the node's ranks, LOCAL_WORLD_SIZE; 0 turns the stash
// off). Outputs beyond it are recomputed.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

namespace dtune::models {

class AttentionStash {
  public:
    AttentionStash();
    ~AttentionStash();
    AttentionStash(const AttentionStash&) = delete;
    AttentionStash& operator=(const AttentionStash&) = delete;

    // A slot for one attention module (its output, one at a time).
    int64_t add_slot();
    // At the start of a checkpointed block's recomputation: starts the copy back of `slot`'s output,
    // if the forward saved one.
    void prefetch(int64_t slot);
    // softmax(q kᵀ / √d) v for q, k, v [B, H, S, d], as at::scaled_dot_product_attention (no mask, no
    // dropout, the default scale), saving or reusing `slot`'s output where the stash applies.
    at::Tensor attend(int64_t slot, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
    // Makes the current stream wait for the copies still reading GPU outputs (end of a forward).
    void flush();

    // Outputs saved and recomputations that reused one, since construction (tests, logs).
    int64_t saved() const;
    int64_t reused() const;
    // Pinned host bytes held, and the most it may hold.
    int64_t host_bytes() const;
    int64_t budget() const;

    // The budget in bytes from DTUNE_ATTENTION_STASH_GIB (UsageError on a bad value) or the default.
    static int64_t budget_from_environment();
    // Overrides the budget of stashes constructed from now on (tests; negative: the environment's).
    static void set_default_budget(int64_t bytes);

  private:
    struct State;
    std::unique_ptr<State> state_;
};

}  // namespace dtune::models
