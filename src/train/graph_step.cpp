// CUDA-graph capture and replay of the optimizer step (see graph_step.h).
#include "train/graph_step.h"

#ifdef DTUNE_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/Event.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <ATen/core/grad_mode.h>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/log.h"

namespace dtune::train {

// Persistent gradients for accumulation (graph_step.h): one zeroed flat buffer per dtype and device,
// allocated once; every parameter's grad is a view of it, so backward accumulates in place at the
// same addresses in every graph and eager micro-step.
class GraphedStep::Gradients {
  public:
    explicit Gradients(const std::vector<at::Tensor>& params) : params_(params) {
        at::NoGradGuard no_grad;
        std::vector<std::pair<at::ScalarType, at::Device>> kinds;  // per flat buffer
        std::vector<int64_t> sizes;                                // per flat buffer: elements
        std::vector<std::size_t> flat_of(params_.size());
        std::vector<int64_t> offset(params_.size());
        for (std::size_t k = 0; k < params_.size(); ++k) {
            const std::pair<at::ScalarType, at::Device> kind{params_[k].scalar_type(), params_[k].device()};
            std::size_t f = 0;
            while (f < kinds.size() && kinds[f] != kind) ++f;
            if (f == kinds.size()) kinds.push_back(kind), sizes.push_back(0);
            flat_of[k] = f;
            offset[k] = sizes[f];
            sizes[f] += params_[k].numel();
        }
        for (std::size_t f = 0; f < kinds.size(); ++f)
            flats_.push_back(
                at::zeros({sizes[f]}, at::TensorOptions().dtype(kinds[f].first).device(kinds[f].second)));
        for (std::size_t k = 0; k < params_.size(); ++k)
            views_.push_back(
                flats_[flat_of[k]].narrow(0, offset[k], params_[k].numel()).view(params_[k].sizes()));
        attach(params);
    }

    // Makes every parameter's grad its view again (the optimizer's zero_grad and the trainer's
    // after_step drop them); a grad found in its place (someone else's) is copied in first.
    void attach(const std::vector<at::Tensor>& params) {
        DTUNE_CHECK(params.size() == params_.size(), "cuda_graph: gradient accumulation got ", params.size(),
                    " trainable parameters after ", params_.size(), "; they must stay the same for the run");
        at::NoGradGuard no_grad;
        for (std::size_t k = 0; k < params_.size(); ++k) {
            DTUNE_CHECK(
                params[k].is_same(params_[k]), "cuda_graph: trainable parameter #", k,
                " changed during the run; gradient accumulation keeps its gradient at a fixed address");
            const at::Tensor& g = params_[k].grad();
            if (g.is_same(views_[k])) continue;
            if (g.defined()) views_[k].copy_(g);
            params_[k].mutable_grad() = views_[k];
        }
    }

    // The end of an optimizer step: zeroed in place (inside a capture: recorded in the graph).
    void clear() {
        {
            at::NoGradGuard no_grad;
            for (at::Tensor& flat : flats_) flat.zero_();
        }
        attach(params_);
    }

  private:
    std::vector<at::Tensor> params_;
    std::vector<at::Tensor> flats_;  // one per (dtype, device)
    std::vector<at::Tensor> views_;  // per parameter: its gradient
};

struct GraphedStep::Entry {
    int seen = 0;         // eager steps since the last (re)start
    bool failed = false;  // capture failed: eager for good
    std::vector<double> lrs;
    double max_grad_norm = 0;
    TrainBatch inputs;  // the graph's static inputs
    StepTensors out;    // the graph's static outputs
#ifdef DTUNE_WITH_CUDA
    std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
};

namespace {

#ifdef DTUNE_WITH_CUDA

std::vector<int64_t> shape_key(const TrainBatch& b) {
    std::vector<int64_t> key;
    std::vector<const at::Tensor*> tensors{&b.latents};
    for (const auto& [name, t] : b.cond) tensors.push_back(&t);  // name order: the same for every batch
    for (const at::Tensor* t : tensors) {
        key.push_back(-1);  // separator: [2, 3] + [4] differs from [2] + [3, 4]
        if (t->defined())
            for (int64_t s : t->sizes()) key.push_back(s);
    }
    key.push_back(b.regularisation ? 1 : 0);
    return key;
}

std::vector<double> group_lrs(const Optimizer& optimizer) {
    std::vector<double> lrs;
    for (const auto& g : optimizer.param_groups()) lrs.push_back(g.lr);
    return lrs;
}

// Runs fn on `side` after the current stream's queued work, and makes the current stream wait for
// it (the stream dance CUDA graphs need: capture cannot happen on the legacy default stream).
template <typename Fn>
void on_side_stream(c10::cuda::CUDAStream side, Fn&& fn) {
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream();
    c10::Event before(c10::DeviceType::CUDA);
    before.record(current);
    before.block(side);
    {
        const c10::cuda::CUDAStreamGuard guard(side);
        fn();
    }
    c10::Event after(c10::DeviceType::CUDA);
    after.record(side);
    after.block(current);
}

// DTUNE_CUDA_GRAPH_SHARED_POOL=0: every shape's graph gets a memory pool of its own.
bool share_pool() {
    static const bool on = [] {
        const char* v = std::getenv("DTUNE_CUDA_GRAPH_SHARED_POOL");
        return !(v && std::string(v) == "0");
    }();
    return on;
}

TrainBatch static_copy(const TrainBatch& b) {
    TrainBatch s;
    s.latents = b.latents.clone();
    for (const auto& [name, t] : b.cond) s.cond[name] = t.defined() ? t.clone() : at::Tensor();
    s.regularisation = b.regularisation;
    return s;
}

void copy_into(TrainBatch& dst, const TrainBatch& src) {
    dst.latents.copy_(src.latents, /*non_blocking=*/true);
    for (auto& [name, t] : dst.cond)
        if (t.defined()) t.copy_(src.cond.at(name), true);
}

#endif

}  // namespace

GraphedStep::GraphedStep(int warmup) : warmup_(std::max(1, warmup)) {}
GraphedStep::~GraphedStep() = default;

StepTensors GraphedStep::run(family::Denoiser& model, const TrainBatch& batch,
                             const family::TrainingObjective& objective, const StepOptions& options,
                             int64_t global_step, at::Generator& generator, Optimizer& optimizer,
                             const std::vector<at::Tensor>& params, double max_grad_norm,
                             const StepHooks& hooks, int64_t micro, int64_t accum) {
    DTUNE_CHECK(accum >= 1 && micro >= 0 && micro < accum, "cuda_graph: micro-step ", micro, " of ", accum,
                " (gradient_accumulation_steps must be at least 1)");
    const bool last = micro == accum - 1;
    const bool accumulating = accum > 1;
    // Accumulating without the caller's static gradients: ours, made the grads at every call and
    // zeroed in place (after the caller's own clear) at the end of the step.
    const bool own_gradients = accumulating && !caller_gradients_;
    StepHooks with_clear;
    if (own_gradients) {
        if (!grads_)
            grads_ = std::make_unique<Gradients>(params);
        else
            grads_->attach(params);
        with_clear = hooks;
        with_clear.clear_gradients = [this, &hooks] {
            if (hooks.clear_gradients) hooks.clear_gradients();
            grads_->clear();
        };
    }
    const StepHooks& step_hooks = own_gradients ? with_clear : hooks;
    // The one step definition, run eagerly or captured.
    auto step = [&](const TrainBatch& b) {
        if (last)
            return optimizer_step_async(model, b, objective, options, global_step, generator, optimizer,
                                        params, max_grad_norm, step_hooks, accum);
        StepTensors out;
        out.loss = accumulate_gradients_async(model, b, objective, options, global_step, generator, accum,
                                              step_hooks);
        return out;
    };
    auto eager = [&] {
        if (last) ++eager_;
        return step(batch);
    };
#ifndef DTUNE_WITH_CUDA
    return eager();
#else
    if (!options.device_rng || !batch.latents.is_cuda()) return eager();
    std::vector<int64_t> key = shape_key(batch);
    key.push_back(last ? 1 : 0);  // accumulation: the micro graph and the final one
    auto& slot = entries_[key];
    if (!slot) slot = std::make_unique<Entry>();
    Entry& e = *slot;
    if (e.failed) return eager();
    // Only the final graph bakes in the LR and the clip (a micro graph has neither).
    const std::vector<double> lrs = lr_on_device_ || !last ? std::vector<double>() : group_lrs(optimizer);
    const double clip = last ? max_grad_norm : 0.0;
    if (e.graph && (e.lrs != lrs || e.max_grad_norm != clip)) {
        e.graph.reset();  // baked-in settings changed: warm up and capture again
        e.seen = 0;
    }
    // One side stream for every shape: blocks of the shared graph pool are reused only on the
    // stream they were allocated on.
    static thread_local std::optional<c10::cuda::CUDAStream> side;
    if (!side || side->device_index() != batch.latents.device().index())
        side = c10::cuda::getStreamFromPool(false, batch.latents.device().index());
    if (!e.graph && e.seen < warmup_) {
        ++e.seen;
        StepTensors out;
        on_side_stream(*side, [&] { out = eager(); });
        return out;
    }
    const char* phase = !accumulating ? "the step" : last ? "the last micro-step" : "a micro-step";
    if (!e.graph) {
        e.inputs = static_copy(batch);
        e.lrs = lrs;
        e.max_grad_norm = clip;
        // Without accumulation autograd allocates the grads inside the graph: start from none. With
        // it the grads hold the step's earlier micro-steps, which the capture (recording, not
        // running) leaves intact.
        if (!accumulating) {
            optimizer.zero_grad();
            if (hooks.clear_gradients) hooks.clear_gradients();
        }
        // The graph's private pool cannot reuse blocks the eager steps left cached; hand them back
        // first, or a large step fails its capture for want of memory that is only fragmented.
        c10::cuda::CUDACachingAllocator::emptyCache();
        const auto t0 = std::chrono::steady_clock::now();
        try {
            on_side_stream(*side, [&] {
                e.graph = std::make_unique<at::cuda::CUDAGraph>();
                // adamw_bf16's rounding noise: its generator's offset must advance on every replay.
                for (const at::Generator& gen : optimizer.generators())
                    if (gen.device().is_cuda()) e.graph->register_generator_state(gen);
                // Thread-local capture mode: the data loader's threads keep copying the next
                // batches to the GPU meanwhile; in the global mode their CUDA calls would fail and
                // break the capture (seen with several aspect buckets, where captures come mid-run).
                e.graph->capture_begin(
                    share_pool() ? c10::MempoolId_t{pool_.first, pool_.second} : c10::MempoolId_t{0, 0},
                    cudaStreamCaptureModeThreadLocal);
                try {
                    e.out = step(e.inputs);
                } catch (...) {
                    try {
                        e.graph->capture_end();
                    } catch (...) {
                    }
                    throw;
                }
                e.graph->capture_end();
            });
            const c10::MempoolId_t pool = e.graph->pool();
            const bool shared = share_pool() && (pool_.first != 0 || pool_.second != 0);
            pool_ = {pool.first, pool.second};
            log::info() << "cuda_graph: captured " << phase << " for batch shape " << batch.latents.sizes()
                        << (batch.regularisation ? " (regularisation batch)" : "") << " in "
                        << static_cast<int64_t>(std::chrono::duration<double, std::milli>(
                                                    std::chrono::steady_clock::now() - t0)
                                                    .count())
                        << " ms" << (shared ? ", sharing the first graph's memory pool" : "");
        } catch (const std::exception& err) {
            const std::string what = err.what();
            log::warn() << "CUDA graph capture of " << phase << " failed for batch shape "
                        << batch.latents.sizes() << "; it trains without a graph from now on ("
                        << what.substr(0, what.find('\n')) << ")";
            e.graph.reset();
            e.failed = true;
            // A capture that broke off never reached its epilogue: the generators it registered
            // still count as capturing. Give each a fresh state at the same seed and offset.
            std::vector<at::Generator> gens = optimizer.generators();
            gens.push_back(at::cuda::detail::getDefaultCUDAGenerator(batch.latents.device().index()));
            for (at::Generator& gen : gens) {
                if (!gen.device().is_cuda()) continue;
                at::Generator fresh = at::make_generator<at::CUDAGeneratorImpl>(gen.device().index());
                fresh.set_state(gen.get_state());
                gen.graphsafe_set_state(fresh);
            }
            if (accumulating) {
                // Nothing the capture recorded ran, so the gradients still hold the step's earlier
                // micro-steps: keep them, drop only the reducer's round (its recorded collectives).
                if (hooks.abandon_reduction) hooks.abandon_reduction();
                if (own_gradients) grads_->attach(params);
            } else {
                optimizer.zero_grad();
                if (hooks.clear_gradients) hooks.clear_gradients();
            }
            return eager();
        }
    } else {
        copy_into(e.inputs, batch);
    }
    e.graph->replay();
    if (last) {
        ++replays_;
        return e.out;
    }
    // The next micro replay of this shape overwrites the graph's loss: a copy, on the replay's stream.
    ++micro_replays_;
    StepTensors out;
    out.loss = e.out.loss.clone();
    return out;
#endif
}

}  // namespace dtune::train
