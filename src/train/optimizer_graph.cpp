// Captured steps of Lion, SGD and Adafactor: their use_device_lr() paths (see DeviceLr in
// optimizer.h). The host-lr paths are in optimizer.cpp and stay as they were; these run the same
// ops in the same order, only their per-step scalars read from [] tensors, and on the CPU in float32
// give the same bits (tests/train/test_optimizer_graph.cpp: a product with a scalar tensor rounds like
// one with a host number, and addcmul_(x, s) like add_(x, alpha)). On CUDA the multi-tensor norms
// (Adafactor) may sum in another order than the per-tensor ones.
//
// Invariants: step() allocates no state and reads nothing back; upload_lr() (outside any capture)
// makes every parameter's state and refills the scalars; after_step() moves host counts forward.
// fp16 (OverflowSkip): each chunk's update goes into copies of its weights and state, written back
// with at::where(skip, old, new), so an overflowed replay leaves them as they were; the counts that
// an overflow must not advance live on the device then.
// Temporaries are made per chunk of at most kChunkElements parameter elements, so a full fine-tune
// needs about one chunk of extra memory, not one more copy of the weights.
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "core/error.h"
#include "train/optimizer.h"

namespace dtune::train {

namespace {

constexpr int64_t kChunkElements = int64_t{1} << 26;  // fp32: 256 MiB of temporaries per chunk

// The device of a group's parameters; a captured step keeps its scalars there.
c10::Device group_device(const ParamGroup& g, const char* optimizer) {
    const c10::Device device = g.params.front().device();
    for (size_t i = 1; i < g.params.size(); ++i)
        DTUNE_CHECK(g.params[i].device() == device, optimizer, " with device-side learning rates: \"",
                    g.names[i], "\" is on ", g.params[i].device().str(), " but \"", g.names.front(), "\" on ",
                    device.str(), "; put a group's parameters on one device");
    return device;
}

// Refills -lr and 1 - lr wd (created on first use: upload_lr() runs outside any capture).
void fill_lr(DeviceLr& s, const ParamGroup& g, c10::Device device) {
    if (!s.neg_lr.defined()) {
        const auto options = at::TensorOptions().dtype(at::kFloat).device(device);
        s.neg_lr = at::empty({}, options);
        s.decay = at::empty({}, options);
    }
    s.neg_lr.fill_(-g.lr);  // the float32 value the host path's double rounds to
    s.decay.fill_(1 - g.lr * g.weight_decay);
}

void require_gradients(const ParamGroup& g, const char* optimizer) {
    for (size_t i = 0; i < g.params.size(); ++i)
        DTUNE_CHECK(g.params[i].grad().defined(), optimizer, " with cuda_graph: \"", g.names[i],
                    "\" has no gradient this step, but a captured step updates a fixed set of parameters; "
                    "set cuda_graph false");
}

// A captured-path step() of SGD or Adafactor: its scalars were uploaded for this step (`uploaded`),
// and every parameter has a gradient.
void check_device_step(bool uploaded, const std::vector<ParamGroup>& groups, const char* optimizer) {
    DTUNE_CHECK(uploaded, "internal: ", optimizer,
                " under use_device_lr() needs upload_lr() before each step and after_step() after it");
    for (const ParamGroup& g : groups) require_gradients(g, optimizer);
}

std::vector<size_t> all_of(const ParamGroup& g) {
    std::vector<size_t> all(g.params.size());
    std::iota(all.begin(), all.end(), size_t{0});
    return all;
}

// `members` in order, cut into runs of at most kChunkElements elements (a larger parameter alone).
std::vector<std::vector<size_t>> chunks_of(const ParamGroup& g, const std::vector<size_t>& members) {
    std::vector<std::vector<size_t>> out;
    int64_t filled = 0;
    for (size_t k : members) {
        const int64_t n = g.params[k].numel();
        if (out.empty() || (filled + n > kChunkElements && !out.back().empty())) {
            out.emplace_back();
            filled = 0;
        }
        out.back().push_back(k);
        filled += n;
    }
    return out;
}

// fp16 (OverflowSkip): [] bool on `device`, true when this step overflowed; undefined without the flag.
at::Tensor skip_flag(const OverflowSkip& skip, c10::Device device) {
    return skip.on() ? skip.found_inf.to(device).ne(0) : at::Tensor();
}

// 1 - found_inf in `dtype` on `device`: what a device-side count advances by.
at::Tensor taken(const OverflowSkip& skip, c10::Device device, at::ScalarType dtype) {
    return at::rsub(skip.found_inf.to(device, dtype), 1);
}

// The tensors a step updates in place: `targets` themselves, or (`skip` defined) copies of them that
// commit() writes back.
std::vector<at::Tensor> work_on(const std::vector<at::Tensor>& targets, const at::Tensor& skip) {
    if (!skip.defined()) return targets;
    std::vector<at::Tensor> copies;
    copies.reserve(targets.size());
    for (const at::Tensor& t : targets) copies.push_back(t.clone());
    return copies;
}

// targets = skip ? targets : updated, element for element; nothing to do when they are the same.
void commit(const std::vector<at::Tensor>& targets, const std::vector<at::Tensor>& updated,
            const at::Tensor& skip) {
    if (!skip.defined()) return;
    for (size_t i = 0; i < targets.size(); ++i) targets[i].copy_(at::where(skip, targets[i], updated[i]));
}

}  // namespace

// ---- Lion ---------------------------------------------------------------------------------------

void Lion::upload_lr() {
    at::NoGradGuard no_grad;
    lr_.resize(groups_.size());
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
        const ParamGroup& g = groups_[gi];
        if (g.params.empty()) continue;
        const c10::Device device = group_device(g, "optimi-lion");
        for (size_t i = 0; i < g.params.size(); ++i) {
            TensorMap& st = state_of(g.names[i]);
            if (!st.count("exp_avg")) st["exp_avg"] = at::zeros_like(g.params[i]);
        }
        fill_lr(lr_[gi], g, device);
    }
}

void Lion::step_device() {
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
        if (groups_[gi].params.empty()) continue;
        DTUNE_CHECK(gi < lr_.size() && lr_[gi].neg_lr.defined(),
                    "internal: lion under use_device_lr() needs upload_lr() before each step");
        require_gradients(groups_[gi], "optimi-lion");
    }
    for (size_t gi = 0; gi < groups_.size(); ++gi) step_group(gi);
}

void Lion::step_group(size_t gi) {
    ParamGroup& g = groups_[gi];
    if (g.params.empty()) return;
    const at::Tensor skip = skip_flag(skip_, g.params.front().device());
    for (const auto& chunk : chunks_of(g, all_of(g))) {
        std::vector<at::Tensor> params, grads, moments;
        for (size_t k : chunk) {
            params.push_back(g.params[k]);
            grads.push_back(g.params[k].grad());
            moments.push_back(state_of(g.names[k]).at("exp_avg"));
        }
        std::vector<at::Tensor> new_params = work_on(params, skip), new_moments = work_on(moments, skip);
        if (g.weight_decay != 0) at::_foreach_mul_(new_params, lr_[gi].decay);
        std::vector<at::Tensor> update = at::_foreach_lerp(moments, grads, 1 - options_.beta1);
        at::_foreach_sign_(update);
        // -lr x sign is exact, so adding it rounds once, like add_(sign, -lr).
        at::_foreach_mul_(update, lr_[gi].neg_lr);
        at::_foreach_add_(new_params, update);
        at::_foreach_lerp_(new_moments, grads, 1 - options_.beta2);
        commit(params, new_params, skip);
        commit(moments, new_moments, skip);
    }
}

// ---- SGD ----------------------------------------------------------------------------------------

// The cohorts of one group: parameters with a momentum buffer (loaded, or stepped before) and those
// without, which get a zero buffer now and start at their first captured step.
void SGD::prepare_device(size_t gi) {
    const ParamGroup& g = groups_[gi];
    std::vector<Cohort>& cohorts = cohorts_[gi];
    if (options_.momentum == 0) {
        cohorts.push_back({true, all_of(g), {}, {}});
        return;
    }
    Cohort started, fresh;
    started.started = true;
    for (size_t i = 0; i < g.params.size(); ++i) {
        TensorMap& st = state_of(g.names[i]);
        if (st.count("momentum_buffer")) {
            started.members.push_back(i);
        } else {
            st["momentum_buffer"] = at::zeros_like(g.params[i]);
            fresh.members.push_back(i);
        }
    }
    const auto options = at::TensorOptions().dtype(at::kFloat).device(group_device(g, "torch-sgd"));
    for (Cohort* c : {&started, &fresh}) {
        if (c->members.empty()) continue;
        c->keep = at::empty({}, options);
        c->take = at::empty({}, options);
        if (skip_.on()) c->started_flag = at::full({}, c->started ? 1.0 : 0.0, options);
        cohorts.push_back(std::move(*c));
    }
}

void SGD::upload_lr() {
    at::NoGradGuard no_grad;
    lr_.resize(groups_.size());
    cohorts_.resize(groups_.size());
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
        const ParamGroup& g = groups_[gi];
        if (g.params.empty()) continue;
        if (cohorts_[gi].empty()) prepare_device(gi);
        fill_lr(lr_[gi], g, group_device(g, "torch-sgd"));
        for (Cohort& c : cohorts_[gi]) {
            if (!c.keep.defined()) continue;  // no momentum
            if (c.started_flag.defined()) {   // fp16: started unless every step so far overflowed
                c.keep.fill_(options_.momentum).mul_(c.started_flag);  // momentum or 0, exactly
                c.take.fill_(1 - options_.dampening);
                c.take.copy_(at::where(c.started_flag.ne(0), c.take, 1.0));
                continue;
            }
            c.keep.fill_(c.started ? options_.momentum : 0.0);
            c.take.fill_(c.started ? 1 - options_.dampening : 1.0);
        }
    }
    uploaded_ = true;
}

void SGD::after_step() {
    if (!uploaded_) return;
    for (auto& cohorts : cohorts_)
        for (Cohort& c : cohorts) c.started = true;
    uploaded_ = false;
}

bool SGD::Cohort::has_started() const {
    return started_flag.defined() ? started_flag.item<float>() != 0.0f : started;
}

bool SGD::skip_step_on_overflow(const at::Tensor& found_inf) {
    DTUNE_CHECK(cohorts_.empty(),
                "internal: torch-sgd's skip_step_on_overflow() comes before its first step");
    skip_.found_inf = found_inf;
    return true;
}

void SGD::step_device() {
    check_device_step(uploaded_ && cohorts_.size() == groups_.size(), groups_, "torch-sgd");
    for (size_t gi = 0; gi < groups_.size(); ++gi) step_group(gi);
}

void SGD::step_group(size_t gi) {
    ParamGroup& g = groups_[gi];
    if (g.params.empty()) return;
    const at::Tensor& neg_lr = lr_[gi].neg_lr;
    const c10::Device device = g.params.front().device();
    const at::Tensor skip = skip_flag(skip_, device);
    for (const Cohort& c : cohorts_[gi]) {
        for (const auto& chunk : chunks_of(g, c.members)) {
            std::vector<at::Tensor> params, grads, buffers;
            for (size_t k : chunk) {
                params.push_back(g.params[k]);
                grads.push_back(g.params[k].grad());
                if (c.keep.defined()) buffers.push_back(state_of(g.names[k]).at("momentum_buffer"));
            }
            std::vector<at::Tensor> new_params = work_on(params, skip), new_buffers = work_on(buffers, skip);
            std::vector<at::Tensor> d =
                g.weight_decay != 0 ? at::_foreach_add(grads, params, g.weight_decay) : grads;
            if (c.keep.defined()) {
                // buf = keep buf + take d: d itself at the first step (the buffer is zero), else
                // momentum buf + (1 - dampening) d, rounded as mul_ then add_(d, 1 - dampening).
                at::_foreach_mul_(new_buffers, c.keep);
                for (size_t j = 0; j < new_buffers.size(); ++j) new_buffers[j].addcmul_(d[j], c.take);
                d = options_.nesterov ? at::_foreach_add(d, new_buffers, options_.momentum) : new_buffers;
            }
            for (size_t j = 0; j < new_params.size(); ++j) new_params[j].addcmul_(d[j], neg_lr);
            commit(params, new_params, skip);
            commit(buffers, new_buffers, skip);
        }
        // fp16: a cohort starts at its first step that did not overflow.
        if (c.started_flag.defined())
            c.started_flag.copy_(at::maximum(c.started_flag, taken(skip_, device, at::kFloat)));
    }
}

TensorMap SGD::state_dict() const {
    TensorMap out = Optimizer::state_dict();
    for (size_t gi = 0; gi < cohorts_.size(); ++gi)
        for (const Cohort& c : cohorts_[gi])
            if (!c.has_started())
                for (size_t k : c.members) out.erase(groups_[gi].names[k] + ".momentum_buffer");
    return out;
}

void SGD::load_state_dict(const TensorMap& state) {
    Optimizer::load_state_dict(state);
    cohorts_.clear();  // the next upload_lr() sorts the loaded buffers from the missing ones
}

// ---- Adafactor ----------------------------------------------------------------------------------

// Every parameter's state as the host path's first step makes it; the cohorts by step count, whose
// counts move to the host (the "step" tensors leave the state map until state_dict()).
void Adafactor::prepare_device(size_t gi) {
    const ParamGroup& g = groups_[gi];
    const c10::Device device = group_device(g, "torch-adafactor");
    std::map<double, std::vector<size_t>> by_step;
    for (size_t i = 0; i < g.params.size(); ++i) {
        const at::Tensor& p = g.params[i];
        TensorMap& st = state_of(g.names[i]);
        if (!st.count("step")) {
            st["step"] = at::zeros({}, at::kFloat);
            if (p.dim() > 1) {
                auto row = p.sizes().vec();
                row.back() = 1;
                auto col = p.sizes().vec();
                col[col.size() - 2] = 1;
                st["row_var"] = at::zeros(row, p.options());  // [..., R, 1]
                st["col_var"] = at::zeros(col, p.options());  // [..., 1, C]
            } else {
                st["variance"] = at::zeros_like(p);
            }
        }
        by_step[st.at("step").item<double>()].push_back(i);  // once per load, outside any capture
        st.erase("step");
    }
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    for (const auto& [step, members] : by_step) {
        Cohort c;
        c.step = step;
        c.rho = at::empty({}, f64.device(device));
        if (skip_.on()) {
            c.count = at::full({}, step, f64.device(device));
            c.lr = at::empty({}, f64.device(device));
        }
        for (const auto& run : chunks_of(g, members)) {
            Chunk chunk;
            chunk.members = run;
            std::vector<double> sqrt_numel, clip_scale;
            for (size_t k : run) {
                const double n = std::sqrt(static_cast<double>(g.params[k].numel()));
                sqrt_numel.push_back(n);
                clip_scale.push_back(n * options_.d);
                const TensorMap& st = state_of(g.names[k]);
                const at::ScalarType type =
                    (g.params[k].dim() > 1 ? st.at("row_var") : st.at("variance")).scalar_type();
                if (!c.weight.count(type)) c.weight[type] = at::empty({}, f64.dtype(type).device(device));
            }
            chunk.sqrt_numel = at::tensor(sqrt_numel, f64).to(device);
            chunk.clip_scale = at::tensor(clip_scale, f64).to(device);
            c.chunks.push_back(std::move(chunk));
        }
        cohorts_[gi].push_back(std::move(c));
    }
}

void Adafactor::upload_lr() {
    at::NoGradGuard no_grad;
    lr_.resize(groups_.size());
    cohorts_.resize(groups_.size());
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
        const ParamGroup& g = groups_[gi];
        if (g.params.empty()) continue;
        if (cohorts_[gi].empty()) prepare_device(gi);
        fill_lr(lr_[gi], g, group_device(g, "torch-adafactor"));
        for (Cohort& c : cohorts_[gi]) {
            if (c.count.defined()) {  // fp16: step_group() computes the step's terms from `count`
                c.lr.fill_(g.lr);
                continue;
            }
            const double t = c.step + 1;  // the coming step's count
            c.rho.fill_(std::min(g.lr, 1.0 / std::sqrt(t)));
            for (auto& [type, w] : c.weight) w.fill_(std::pow(t, options_.beta2_decay));
        }
    }
    uploaded_ = true;
}

void Adafactor::after_step() {
    if (!uploaded_) return;
    for (auto& cohorts : cohorts_)
        for (Cohort& c : cohorts) c.step += 1;  // unused under fp16 skipping (`count` instead)
    uploaded_ = false;
}

double Adafactor::Cohort::steps_taken() const {
    return count.defined() ? count.item<double>() : step;
}

bool Adafactor::skip_step_on_overflow(const at::Tensor& found_inf) {
    DTUNE_CHECK(cohorts_.empty(),
                "internal: torch-adafactor's skip_step_on_overflow() comes before its first step");
    skip_.found_inf = found_inf;
    return true;
}

void Adafactor::step_device() {
    check_device_step(uploaded_ && cohorts_.size() == groups_.size(), groups_, "torch-adafactor");
    for (size_t gi = 0; gi < groups_.size(); ++gi) step_group(gi);
}

void Adafactor::step_group(size_t gi) {
    ParamGroup& g = groups_[gi];
    if (g.params.empty()) return;
    const c10::Device device = g.params.front().device();
    const at::Tensor skip = skip_flag(skip_, device);
    for (const Cohort& c : cohorts_[gi]) {
        if (c.count.defined()) {
            // fp16: the terms upload_lr() fills from a host count, from the device count, in float64
            // (sqrt and the division are correctly rounded, as on the host).
            const at::Tensor t = c.count.add(1);  // the coming step's count
            c.rho.copy_(at::minimum(c.lr, t.sqrt().reciprocal()));
            for (const auto& [type, w] : c.weight) w.copy_(at::pow(t, options_.beta2_decay));
        }
        for (const Chunk& chunk : c.chunks) {
            std::vector<at::Tensor> params, states;  // states: the members' moments, in order
            for (size_t k : chunk.members) {
                params.push_back(g.params[k]);
                const TensorMap& st = state_of(g.names[k]);
                if (g.params[k].dim() > 1) {
                    states.push_back(st.at("row_var"));
                    states.push_back(st.at("col_var"));
                } else {
                    states.push_back(st.at("variance"));
                }
            }
            const std::vector<at::Tensor> new_params = work_on(params, skip),
                                          new_states = work_on(states, skip);
            // alpha = max(eps2, RMS(p)) x min(lr, 1/sqrt(t)), from the weights before the decay.
            at::Tensor alpha = at::stack(at::_foreach_norm(params))
                                   .to(at::kDouble)
                                   .div_(chunk.sqrt_numel)
                                   .clamp_min_(options_.eps2)
                                   .mul_(c.rho);  // [k] float64
            if (g.weight_decay != 0) at::_foreach_mul_(new_params, lr_[gi].decay);
            std::vector<at::Tensor> updates;
            for (size_t j = 0, s = 0; j < chunk.members.size(); ++j) {
                const at::Tensor& p = params[j];
                const at::Tensor grad = p.grad();
                const double eps1 = eps1_for(p.scalar_type());
                at::Tensor estimate;
                if (grad.dim() > 1) {
                    const at::Tensor& row = new_states[s++];
                    const at::Tensor& col = new_states[s++];
                    const at::Tensor& w = c.weight.at(row.scalar_type());
                    row.lerp_(at::linalg_vector_norm(grad, 2, {-1}, true).square_().div_(grad.size(-1)), w);
                    col.lerp_(at::linalg_vector_norm(grad, 2, {-2}, true).square_().div_(grad.size(-2)), w);
                    estimate = at::matmul(row, col).div_(row.mean({-2}, true).clamp_(eps1));  // [..., R, C]
                } else {
                    const at::Tensor& variance = new_states[s++];
                    variance.lerp_(grad * grad, c.weight.at(variance.scalar_type()));
                    estimate = variance.clone();
                }
                updates.push_back(estimate.clamp_(eps1 * eps1).rsqrt_().mul_(grad));
            }
            // Update clipping: divide by max(1, RMS(update) / d); the step is -alpha / that.
            const at::Tensor denom =
                at::stack(at::_foreach_norm(updates)).to(at::kDouble).div_(chunk.clip_scale).clamp_min_(1.0);
            const at::Tensor scale = alpha.div_(denom).neg_();  // [k] float64
            for (size_t j = 0; j < params.size(); ++j) new_params[j].addcmul_(updates[j], scale.select(0, j));
            commit(params, new_params, skip);
            commit(states, new_states, skip);
        }
        if (c.count.defined()) c.count.add_(taken(skip_, device, at::kDouble));
    }
}

TensorMap Adafactor::state_dict() const {
    TensorMap out = Optimizer::state_dict();
    for (size_t gi = 0; gi < cohorts_.size(); ++gi) {
        for (const Cohort& c : cohorts_[gi]) {
            const double step = c.steps_taken();
            for (const Chunk& chunk : c.chunks) {
                for (size_t k : chunk.members) {
                    const std::string& name = groups_[gi].names[k];
                    if (step > 0) {
                        out[name + ".step"] = at::full({}, step, at::kFloat);
                    } else {  // made by upload_lr() but never stepped: the host path has no state yet
                        for (const auto& [key, value] : state_.at(name)) out.erase(name + "." + key);
                    }
                }
            }
        }
    }
    return out;
}

void Adafactor::load_state_dict(const TensorMap& state) {
    Optimizer::load_state_dict(state);
    cohorts_.clear();  // the next upload_lr() takes the loaded step counts
}

}  // namespace dtune::train
