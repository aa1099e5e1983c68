// See attention_stash.h.
#include "models/common/attention_stash.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "models/common/unit_hooks.h"

#ifdef DTUNE_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace dtune::models {
namespace {

std::atomic<int64_t> g_default_budget{-1};  // < 0: the environment's

}  // namespace

int64_t AttentionStash::budget_from_environment() {
    const char* v = std::getenv("DTUNE_ATTENTION_STASH_GIB");
    if (v == nullptr || *v == '\0') {
        // A sixteenth of the machine's memory, shared by the node's ranks (LOCAL_WORLD_SIZE, which
        // dtune launch sets and dist/env.cpp checks; anything else counts as one rank here).
        const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
        const char* ranks = std::getenv("LOCAL_WORLD_SIZE");
        const long local = ranks != nullptr ? std::strtol(ranks, nullptr, 10) : 1;
        const int64_t machine = pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
        return machine / 16 / std::max<long>(local, 1);
    }
    errno = 0;
    char* end = nullptr;
    const double gib = std::strtod(v, &end);
    DTUNE_CHECK_AS(UsageError, errno == 0 && end != v && *end == '\0' && gib >= 0 && gib < 1e6,
                   "DTUNE_ATTENTION_STASH_GIB=", v,
                   " is not a size: give the pinned host memory in GiB for checkpointed blocks' attention "
                   "outputs (0 recomputes them instead; unset: a sixteenth of the machine's memory, shared "
                   "by the node's "
                   "ranks)");
    return static_cast<int64_t>(gib * 1024.0 * 1024.0 * 1024.0);
}

void AttentionStash::set_default_budget(int64_t bytes) {
    g_default_budget.store(bytes);
}

#ifdef DTUNE_WITH_CUDA
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What cuDNN's attention forward returns besides the output, for its backward.
struct CudnnAux {
    at::Tensor lse, cum_q, cum_k, seed, offset;
    int64_t max_q = 0, max_k = 0;
};

struct AuxHolder : torch::CustomClassHolder {
    CudnnAux aux;
};

// The attention with a saved output: forward returns it, backward is cuDNN's, reading the output and
// its log-sum-exp. The output gradient is packed densely in the output's [B, S, H, d] order first:
// a single block's cat([attention, mlp]) hands a slice of wider rows, which cuDNN's backward reads
// out of bounds (torch 2.11; flux_transformer.cpp's DenseOutputGrad).
struct StashedAttention : torch::autograd::Function<StashedAttention> {
    static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const at::Tensor& out, c10::intrusive_ptr<AuxHolder> aux) {
        ctx->save_for_backward({q, k, v, out});
        ctx->saved_data["aux"] = c10::IValue::make_capsule(aux);
        return out.view_as(out);
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        const auto holder = c10::static_intrusive_pointer_cast<AuxHolder>(ctx->saved_data["aux"].toCapsule());
        const CudnnAux& a = holder->aux;
        const at::Tensor g = grads[0].transpose(1, 2).contiguous().transpose(1, 2);
        auto [dq, dk, dv] = at::_scaled_dot_product_cudnn_attention_backward(
            g, saved[0], saved[1], saved[2], saved[3], a.lse, a.seed, a.offset, at::Tensor(), a.cum_q,
            a.cum_k, a.max_q, a.max_k, /*dropout_p=*/0.0, /*is_causal=*/false);
        return {dq, dk, dv, at::Tensor(), at::Tensor()};
    }
};

constexpr int kCudnnAttention = 3;  // at::_fused_sdp_choice's code for cuDNN's kernel

}  // namespace

struct AttentionStash::State {
    struct Slot {
        std::vector<at::Tensor> buffers;  // pinned bytes, kept (captured graphs hold their addresses)
        at::Tensor host;                  // the saved output's view into one of them
        CudnnAux aux;
        bool valid = false;  // saved by the forward, not yet fetched
        uint64_t call = 0;   // the checkpointed() call whose forward saved it (unit_hooks.h)
        at::Tensor fetched;  // on its way back (prefetch), until attend takes it
        uint64_t fetched_call = 0;
        at::cuda::CUDAEvent arrived;
    };
    std::mutex mutex;
    int64_t budget = 0, held = 0, saved = 0, reused = 0;
    std::vector<std::unique_ptr<Slot>> slots;
    std::optional<c10::cuda::CUDAStream> side;
    at::cuda::CUDAEvent ready, copied;  // compute → side, side → compute
    at::Tensor pending;                 // an output the side stream may still be reading

    c10::cuda::CUDAStream side_stream(c10::DeviceIndex device) {
        if (!side || side->device_index() != device) side = c10::cuda::getStreamFromPool(false, device);
        return *side;
    }

    // The current stream waits for the last device-to-host copy; its output may then be freed.
    void settle(const c10::cuda::CUDAStream& compute) {
        if (!pending.defined()) return;
        copied.block(compute);
        pending.reset();
    }

    // Drops the slot's output on its way back, after the current stream waits for its copy (the
    // memory may be reused by the current stream's next allocation).
    void drop_fetched(Slot& s) {
        if (!s.fetched.defined()) return;
        s.arrived.block(c10::cuda::getCurrentCUDAStream(s.fetched.device().index()));
        s.fetched.reset();
    }

    // A pinned buffer of at least `bytes` among the slot's, or a new one within the budget.
    at::Tensor buffer_for(Slot& s, int64_t bytes) {
        for (const at::Tensor& b : s.buffers)
            if (b.numel() >= bytes) return b;
        if (held + bytes > budget) return {};
        at::Tensor b = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
        held += bytes;
        s.buffers.push_back(b);
        return b;
    }

    void save(Slot& s, const at::Tensor& out, CudnnAux aux) {
        s.valid = false;
        if (!out.is_non_overlapping_and_dense()) return;
        const int64_t bytes = out.numel() * static_cast<int64_t>(out.element_size());
        const at::Tensor buffer = buffer_for(s, bytes);
        if (!buffer.defined()) return;
        const auto compute = c10::cuda::getCurrentCUDAStream(out.device().index());
        const auto copy = side_stream(out.device().index());
        settle(compute);
        s.host = buffer.narrow(0, 0, bytes).view(out.scalar_type()).as_strided(out.sizes(), out.strides());
        ready.record(compute);
        ready.block(copy);
        C10_CUDA_CHECK(
            cudaMemcpyAsync(s.host.data_ptr(), out.data_ptr(), bytes, cudaMemcpyDeviceToHost, copy));
        copied.record(copy);
        pending = out;
        s.aux = std::move(aux);
        s.valid = true;
        s.call = checkpoint_call();
        ++saved;
    }

    // Only for the recomputation of the call that saved it: were a slot saved twice before a backward
    // (two forwards of one model, one loss), the earlier call's recomputation computes its own.
    void fetch(Slot& s, const at::TensorOptions& on) {
        if (!s.valid || s.call != checkpoint_call()) return;
        s.valid = false;
        const auto compute = c10::cuda::getCurrentCUDAStream(on.device().index());
        const auto copy = side_stream(on.device().index());
        settle(compute);
        s.fetched = at::empty_strided(s.host.sizes(), s.host.strides(), on.dtype(s.host.scalar_type()));
        s.fetched_call = s.call;
        ready.record(compute);  // the new allocation's earlier users are done
        ready.block(copy);
        const int64_t bytes = s.host.numel() * static_cast<int64_t>(s.host.element_size());
        C10_CUDA_CHECK(
            cudaMemcpyAsync(s.fetched.data_ptr(), s.host.data_ptr(), bytes, cudaMemcpyHostToDevice, copy));
        s.arrived.record(copy);
    }
};

AttentionStash::AttentionStash() : state_(std::make_unique<State>()) {
    const int64_t fixed = g_default_budget.load();
    state_->budget = fixed >= 0 ? fixed : budget_from_environment();
}

AttentionStash::~AttentionStash() = default;

int64_t AttentionStash::add_slot() {
    const std::lock_guard<std::mutex> lock(state_->mutex);
    state_->slots.push_back(std::make_unique<State::Slot>());
    return static_cast<int64_t>(state_->slots.size()) - 1;
}

void AttentionStash::prefetch(int64_t slot) {
    const std::lock_guard<std::mutex> lock(state_->mutex);
    State::Slot& s = *state_->slots.at(static_cast<size_t>(slot));
    if (!s.valid || !in_recompute() || s.call != checkpoint_call()) return;
    state_->drop_fetched(s);
    state_->fetch(s, s.aux.lse.options());
}

at::Tensor AttentionStash::attend(int64_t slot, const at::Tensor& q, const at::Tensor& k,
                                  const at::Tensor& v) {
    const bool takes = state_->budget > 0 && q.is_cuda() &&
                       (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf) &&
                       at::_fused_sdp_choice(q, k, v) == kCudnnAttention;
    if (!takes) return at::scaled_dot_product_attention(q, k, v);
    const std::lock_guard<std::mutex> lock(state_->mutex);
    State::Slot& s = *state_->slots.at(static_cast<size_t>(slot));
    if (checkpoint_call() != 0 && !in_recompute() && !at::GradMode::is_enabled()) {
        auto r = at::_scaled_dot_product_cudnn_attention(q, k, v, std::nullopt, /*compute_log_sumexp=*/true);
        CudnnAux aux;
        aux.lse = std::get<1>(r), aux.cum_q = std::get<2>(r), aux.cum_k = std::get<3>(r);
        aux.max_q = std::get<4>(r).expect_int(), aux.max_k = std::get<5>(r).expect_int();
        aux.seed = std::get<6>(r), aux.offset = std::get<7>(r);
        state_->save(s, std::get<0>(r), std::move(aux));
        return std::get<0>(r);
    }
    if (in_recompute() && at::GradMode::is_enabled()) {
        // Another call's prefetched output is dropped; without a prefetch the copy starts now.
        if (s.fetched.defined() && s.fetched_call != checkpoint_call()) state_->drop_fetched(s);
        if (!s.fetched.defined()) state_->fetch(s, q.options());
        if (s.fetched.defined()) {
            s.arrived.block(c10::cuda::getCurrentCUDAStream(q.device().index()));
            at::Tensor out = std::move(s.fetched);
            s.fetched.reset();
            const bool fits = out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() &&
                              out.device() == q.device();
            if (fits) {
                auto holder = c10::make_intrusive<AuxHolder>();
                holder->aux = s.aux;
                s.aux = {};
                ++state_->reused;
                return StashedAttention::apply(q, k, v, out, holder);
            }
        }
    }
    return at::scaled_dot_product_attention(q, k, v);
}

void AttentionStash::flush() {
    const std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->pending.defined())
        state_->settle(c10::cuda::getCurrentCUDAStream(state_->pending.device().index()));
}

#else  // CPU-only build: SDPA, nothing kept.

struct AttentionStash::State {
    int64_t slots = 0;
};

AttentionStash::AttentionStash() : state_(std::make_unique<State>()) {}
AttentionStash::~AttentionStash() = default;

int64_t AttentionStash::add_slot() {
    return state_->slots++;
}

void AttentionStash::prefetch(int64_t) {}

at::Tensor AttentionStash::attend(int64_t, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    return at::scaled_dot_product_attention(q, k, v);
}

void AttentionStash::flush() {}

#endif

#ifdef DTUNE_WITH_CUDA
int64_t AttentionStash::budget() const {
    return state_->budget;
}

int64_t AttentionStash::saved() const {
    const std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->saved;
}

int64_t AttentionStash::reused() const {
    const std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->reused;
}

int64_t AttentionStash::host_bytes() const {
    const std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->held;
}
#else
int64_t AttentionStash::budget() const {
    return 0;
}

int64_t AttentionStash::saved() const {
    return 0;
}

int64_t AttentionStash::reused() const {
    return 0;
}

int64_t AttentionStash::host_bytes() const {
    return 0;
}
#endif

}  // namespace dtune::models
