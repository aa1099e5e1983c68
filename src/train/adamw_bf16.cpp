// SimpleTuner's adamw_bf16 as whole-bucket kernels with no host synchronisation (see optimizer.h).
//
// Per element, one step (g the bf16 gradient, p the bf16 weight; SR = stochastic rounding to bf16,
// "bf16" = ordinary bf16 arithmetic, c = -lr * sqrt(1 - beta2^t)):
//   m <- bf16(beta1 m);  m <- SR(g + (1 - beta1) m)        (textbook: SR(m + (1 - beta1) g))
//   v <- bf16(bf16(beta2 v) + (1 - beta2) g^2);  d <- bf16(bf16(sqrt v) + eps)
//   shift <- SR(shift + c m / d)
//   p' <- SR(p + shift);  shift <- SR(bf16(p - p') + shift)   (compensated: p' + shift ~ p + shift_old)
//   when the parameter's decay is due: shift <- bf16(shift - decay p')
// which is SimpleTuner's AdamWBF16._make_step with its add_stochastic_ / addcdiv_stochastic_.
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <utility>

#include "core/error.h"
#include "core/fused_env.h"
#include "train/optimizer.h"

#ifdef DTUNE_WITH_CUDA_KERNELS
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <mutex>

#include "train/cuda/adamw_bf16_kernel.h"
#endif

namespace dtune::train {

namespace {

constexpr double kDecayThreshold = 5e-3;  // SimpleTuner's AdamWBF16.decay_threshold

// bf16 from float32: the int32 `noise` in [0, 2^16) is added to the float's bit pattern and the low
// 16 bits dropped, so the result is one of x's two bf16 neighbours, the one further from zero with
// probability (|x| - |lower|) / ulp: E[result] = x. The final conversion is exact (low bits zero).
at::Tensor round_stochastic(const at::Tensor& x32, const at::Tensor& noise) {
    at::Tensor bits = noise.add(x32.contiguous().view(at::kInt));
    bits.bitwise_and_(-65536);  // 0xFFFF0000: sign, exponent and the bf16 mantissa
    return bits.view(at::kFloat).to(at::kBFloat16);
}

at::Tensor draw_noise(int64_t n, at::Generator& generator, const at::Tensor& like) {
    return at::randint(0, 1 << 16, {n}, generator, like.options().dtype(at::kInt));  // [n]
}

#ifdef DTUNE_WITH_CUDA_KERNELS
// The Philox state for one fused-kernel call that consumes `increment` numbers per element, as
// torch's own CUDA random kernels take it (graph-safe: inside a capture, pointers read at replay).
cuda::PhiloxArgs philox_args(at::Generator& generator, uint64_t increment) {
    auto* impl = at::check_generator<at::CUDAGeneratorImpl>(generator);
    const std::lock_guard<std::mutex> lock(generator.mutex());
    const at::PhiloxCudaState state = impl->philox_cuda_state(increment);
    cuda::PhiloxArgs a;
    a.captured = state.captured_;
    if (state.captured_) {
        a.seed_ptr = state.seed_.ptr;
        a.offset_ptr = state.offset_.ptr;
        a.offset_intragraph = state.offset_intragraph_;
    } else {
        a.seed = state.seed_.val;
        a.offset = state.offset_.val;
    }
    return a;
}
#endif

}  // namespace

void copy_stochastic_(at::Tensor& target, const at::Tensor& source, at::Generator& generator) {
    DTUNE_CHECK(source.scalar_type() == at::kFloat, "stochastic rounding reads float32; got ",
                source.scalar_type());
    const at::Tensor flat = source.contiguous().view(-1);
    target.copy_(round_stochastic(flat, draw_noise(flat.numel(), generator, flat)).view(source.sizes()));
}

struct AdamWBF16::Bucket {
    std::vector<size_t> members;  // indices into the group's params, in order
    int64_t numel = 0;
    at::Tensor exp_avg, exp_avg_sq, shift;  // [numel] bf16; the members' state tensors are views
    size_t scale = 0;                       // index into Plan::scales
};

struct AdamWBF16::Plan {
    std::vector<size_t> active;  // the parameters packed (those with gradients)
    std::vector<Bucket> buckets;
    // (a member, [] float32 on the weights' device): -lr * sqrt(1 - beta2^t) for buckets whose
    // members share that member's step count.
    std::vector<std::pair<size_t, at::Tensor>> scales;
    std::vector<std::pair<size_t, double>> due;  // (parameter, decay) to subtract after this step
    // fp16 skipping (found_inf_), all float64 on the group's device: the steps taken per `scales`
    // entry, the accumulated decay per active parameter, and this step's lr and lr * weight_decay.
    std::vector<at::Tensor> counts;  // [] per scales entry
    std::vector<size_t> scale_of;    // per active position: its scales entry
    at::Tensor decays;               // [active]
    at::Tensor lr, decay_step;       // []
};

AdamWBF16::AdamWBF16(std::vector<ParamGroup> groups, at::Generator generator, AdamWBF16Options options)
    : Optimizer(std::move(groups)), generator_(std::move(generator)), options_(options) {
    for (const auto& g : groups_) {
        for (size_t i = 0; i < g.params.size(); ++i) {
            DTUNE_CHECK_AS(UsageError, g.params[i].scalar_type() == at::kBFloat16,
                           "optimizer adamw_bf16 needs bf16 ", "weights but \"", g.names[i], "\" is ",
                           g.params[i].scalar_type(), "; use optimizer adamw for fp32 master weights");
        }
        host_.emplace_back(g.params.size());
    }
    DTUNE_CHECK_AS(UsageError, options_.bucket_elements >= 0,
                   "adamw_bf16 bucket_elements must not be negative");
    plans_.resize(groups_.size());
}

AdamWBF16::~AdamWBF16() = default;

std::vector<size_t> AdamWBF16::active_params(size_t group) const {
    std::vector<size_t> active;
    const auto& params = groups_[group].params;
    for (size_t i = 0; i < params.size(); ++i)
        if (params[i].grad().defined()) active.push_back(i);
    return active;
}

void AdamWBF16::pack(size_t group, const std::vector<size_t>& active) {
    ParamGroup& g = groups_[group];
    host_[group] = current_host(group);  // fp16: the counts the old plan kept on the device
    std::vector<Host>& host = host_[group];
    // New parameters start their decay counters at random points (drawn together, read back once)
    // so their decays do not all land on the same step.
    std::vector<size_t> fresh;
    for (size_t k : active)
        if (!host[k].started) fresh.push_back(k);
    if (!fresh.empty()) {
        const auto where = at::TensorOptions().dtype(at::kDouble).device(generator_.device());
        const at::Tensor starts = at::rand({static_cast<int64_t>(fresh.size())}, generator_, where).cpu();
        for (size_t i = 0; i < fresh.size(); ++i)
            host[fresh[i]] =
                Host{true, 0.0, starts[static_cast<int64_t>(i)].item<double>() * kDecayThreshold};
    }
    auto plan = std::make_unique<Plan>();
    plan->active = active;
    // Buckets: consecutive parameters with one step count and device, at most bucket_elements each
    // (a larger parameter gets a bucket of its own).
    std::map<std::pair<double, std::string>, size_t> scale_of;
    for (size_t k : active) {
        const at::Tensor& p = g.params[k];
        const auto key = std::make_pair(host[k].step, p.device().str());
        auto [it, added] = scale_of.emplace(key, plan->scales.size());
        if (added) plan->scales.emplace_back(k, at::zeros({}, p.options().dtype(at::kFloat)));
        plan->scale_of.push_back(it->second);
        Bucket* b = plan->buckets.empty() ? nullptr : &plan->buckets.back();
        const int64_t cap = options_.bucket_elements > 0 ? options_.bucket_elements
                            : p.is_cuda()                ? int64_t{1} << 26
                                                         : int64_t{1} << 20;
        if (!b || b->scale != it->second || b->numel + p.numel() > cap) {
            b = &plan->buckets.emplace_back();
            b->scale = it->second;
        }
        b->members.push_back(k);
        b->numel += p.numel();
    }
    if (found_inf_.defined() && !active.empty()) {  // fp16: the counts move to the device
        const c10::Device device = g.params[active.front()].device();
        const auto f64 = at::TensorOptions().dtype(at::kDouble);
        std::vector<double> decays;
        for (size_t k : active) {
            DTUNE_CHECK(g.params[k].device() == device, "adamw_bf16 with mixed_precision fp16: \"",
                        g.names[k], "\" is on ", g.params[k].device().str(), " but \"",
                        g.names[active.front()], "\" on ", device.str(),
                        "; put a group's parameters on one device");
            decays.push_back(host[k].accumulated_decay);
        }
        for (const auto& [member, scale] : plan->scales)
            plan->counts.push_back(at::full({}, host[member].step, f64.device(device)));
        plan->decays = at::tensor(decays, f64).to(device);  // [active]
        plan->lr = at::empty({}, f64.device(device));
        plan->decay_step = at::empty({}, f64.device(device));
    }
    // Flat state per bucket; existing state (earlier steps, a loaded checkpoint) is copied in and the
    // per-parameter tensors become views, so state_dict() writes the same layout as before.
    for (Bucket& b : plan->buckets) {
        const std::pair<const char*, at::Tensor*> states[] = {
            {"exp_avg", &b.exp_avg}, {"exp_avg_sq", &b.exp_avg_sq}, {"shift", &b.shift}};
        for (const auto& [key, flat_out] : states) {
            std::vector<at::Tensor> parts;
            for (size_t k : b.members) {
                const at::Tensor& p = g.params[k];
                TensorMap& st = state_of(g.names[k]);
                const auto it = st.find(key);
                parts.push_back(it != st.end() ? it->second.to(p.device(), at::kBFloat16).reshape(-1)
                                               : at::zeros({p.numel()}, p.options()));
            }
            at::Tensor flat = at::cat(parts);  // [numel] bf16
            parts.clear();
            int64_t offset = 0;
            for (size_t k : b.members) {
                const at::Tensor& p = g.params[k];
                state_of(g.names[k])[key] = flat.narrow(0, offset, p.numel()).view(p.sizes());
                offset += p.numel();
            }
            *flat_out = flat;
        }
    }
    plans_[group] = std::move(plan);
}

void AdamWBF16::prepare(size_t group) {
    Plan& plan = *plans_[group];
    const ParamGroup& g = groups_[group];
    std::vector<Host>& host = host_[group];
    plan.due.clear();
    if (!plan.counts.empty()) {  // fp16: the step counts itself on the device (device_scales)
        plan.lr.fill_(g.lr);
        plan.decay_step.fill_(g.weight_decay * g.lr);  // the host path's increment, to the bit
        return;
    }
    for (size_t k : plan.active) {
        Host& h = host[k];
        h.step += 1;
        h.accumulated_decay += g.weight_decay * g.lr;
        if (h.accumulated_decay > kDecayThreshold) {
            plan.due.emplace_back(k, h.accumulated_decay);
            h.accumulated_decay = 0;  // SimpleTuner: acc -= (acc > threshold) * acc
        }
    }
    // A fill is a kernel with the value as its argument: no synchronisation, and outside a capture.
    for (auto& [member, scale] : plan.scales)
        scale.fill_(-g.lr * std::sqrt(1 - std::pow(options_.beta2, host[member].step)));
}

std::vector<AdamWBF16::Host> AdamWBF16::current_host(size_t group) const {
    std::vector<Host> host = host_[group];
    const Plan* plan = plans_[group].get();
    if (!plan || plan->counts.empty()) return host;
    const at::Tensor counts = at::stack(plan->counts).cpu(), decays = plan->decays.cpu();  // outside captures
    for (size_t j = 0; j < plan->active.size(); ++j) {
        Host& h = host[plan->active[j]];
        h.step = counts[static_cast<int64_t>(plan->scale_of[j])].item<double>();
        h.accumulated_decay = decays[static_cast<int64_t>(j)].item<double>();
    }
    return host;
}

// -lr * sqrt(1 - beta2^t) for t = count + 1, as prepare() computes it on the host (float64, then
// rounded to float32 by the copy as by fill_).
void AdamWBF16::device_scales(size_t group) {
    Plan& plan = *plans_[group];
    for (size_t i = 0; i < plan.scales.size(); ++i) {
        const at::Tensor t = plan.counts[i].add(1);
        plan.scales[i].second.copy_(at::rsub(at::pow(options_.beta2, t), 1).sqrt_().mul_(plan.lr).neg_());
    }
}

// After the buckets: counts += 1 - found_inf; each accumulator likewise gains lr * wd, and one past
// the threshold is subtracted from the shift (times the new weight) and restarts at 0, all masked
// on the device. An overflowed step adds nothing, so no accumulator comes due.
void AdamWBF16::device_counts_and_decays(size_t group) {
    Plan& plan = *plans_[group];
    ParamGroup& g = groups_[group];
    const at::Tensor taken = at::rsub(found_inf_.to(plan.decays.device(), at::kDouble), 1);
    for (const at::Tensor& c : plan.counts) c.add_(taken);
    const at::Tensor acc = plan.decays.add(plan.decay_step * taken);  // [active]
    const at::Tensor due = acc.gt(kDecayThreshold);
    const at::Tensor alpha = at::where(due, acc, 0.0).neg_().to(at::kFloat);  // [active]: -decay or 0
    plan.decays.copy_(at::where(due, at::zeros_like(acc), acc));
    for (size_t j = 0; j < plan.active.size(); ++j) {
        const size_t k = plan.active[j];
        const auto i = static_cast<int64_t>(j);
        at::Tensor& shift = state_of(g.names[k]).at("shift");
        const at::Tensor decayed =
            at::addcmul(shift.to(at::kFloat), g.params[k].to(at::kFloat), alpha.select(0, i))
                .to(at::kBFloat16);
        shift.copy_(at::where(due.select(0, i), decayed, shift));
    }
}

bool AdamWBF16::skip_step_on_overflow(const at::Tensor& found_inf) {
    found_inf_ = found_inf;
    for (auto& plan : plans_) plan.reset();  // repacked with device counts at the next step
    return true;
}

void AdamWBF16::update_bucket(ParamGroup& g, Bucket& b, const at::Tensor& scale) {
    const double b1 = options_.beta1, b2 = options_.beta2;
#ifdef DTUNE_WITH_CUDA_KERNELS
    if (options_.fused_kernel && fused_kernels_allowed() && b.exp_avg.is_cuda() &&
        generator_.device().is_cuda()) {
        // Each member's gradient and weight are read where they are when both are contiguous bf16
        // on the bucket's device (the usual case); otherwise the bucket goes through flat copies.
        bool in_place = true;
        for (size_t k : b.members) {
            const at::Tensor& p = g.params[k];
            const at::Tensor& grad = p.grad();
            in_place = in_place && p.is_contiguous() && grad.is_contiguous() &&
                       grad.scalar_type() == at::kBFloat16 && grad.device() == b.exp_avg.device() &&
                       p.device() == b.exp_avg.device();
        }
        std::vector<std::pair<const void*, void*>> spans;  // (gradient, weight) per member
        at::Tensor flat_grad, flat_weight;
        if (in_place) {
            for (size_t k : b.members)
                spans.emplace_back(g.params[k].grad().const_data_ptr(), g.params[k].mutable_data_ptr());
        } else {
            std::vector<at::Tensor> grads, weights;
            for (size_t k : b.members) {
                grads.push_back(g.params[k].grad().reshape(-1).to(at::kBFloat16));
                weights.push_back(g.params[k].reshape(-1));
            }
            flat_grad = at::cat(grads).to(b.exp_avg.device());
            flat_weight = at::cat(weights).to(b.exp_avg.device());  // this step's own copy, updated in place
            spans.emplace_back(flat_grad.const_data_ptr(), flat_weight.mutable_data_ptr());
        }
        cuda::AdamWBF16Args args;
        args.beta1 = static_cast<float>(b1);
        args.beta2 = static_cast<float>(b2);
        args.one_minus_beta1 = static_cast<float>(1 - b1);
        args.one_minus_beta2 = static_cast<float>(1 - b2);
        args.eps = static_cast<float>(options_.eps);
        args.simpletuner_momentum = options_.simpletuner_momentum;
        args.scale = scale.const_data_ptr<float>();
        args.grad_clamp = static_cast<float>(grad_clamp_);
        const at::Tensor found_inf =
            found_inf_.defined() ? found_inf_.to(b.exp_avg.device(), at::kFloat) : at::Tensor();
        if (found_inf.defined()) args.found_inf = found_inf.const_data_ptr<float>();
        const c10::cuda::CUDAGuard guard(b.exp_avg.device());
        const cuda::PhiloxArgs rng = philox_args(generator_, 4);
        void* stream = c10::cuda::getCurrentCUDAStream(b.exp_avg.device().index()).stream();
        cuda::AdamWBF16Chunks batch;
        auto flush = [&] {
            const int err = cuda::adamw_bf16_chunks_step(batch, b.exp_avg.mutable_data_ptr(),
                                                         b.exp_avg_sq.mutable_data_ptr(),
                                                         b.shift.mutable_data_ptr(), args, rng, stream);
            DTUNE_CHECK(err == 0, "adamw_bf16: fused CUDA kernel launch failed (CUDA error ", err, ")");
            batch.count = 0;
        };
        // Chunks of at most kAdamWBF16ChunkElements, in bucket order; one launch per full batch.
        int64_t offset = 0;
        for (size_t i = 0; i < spans.size(); ++i) {
            const int64_t numel = in_place ? g.params[b.members[i]].numel() : b.numel;
            for (int64_t start = 0; start < numel; start += cuda::kAdamWBF16ChunkElements) {
                cuda::AdamWBF16Chunk& c = batch.chunk[batch.count++];
                c.grad = static_cast<const char*>(spans[i].first) + start * 2;  // bf16: 2 bytes
                c.weight = static_cast<char*>(spans[i].second) + start * 2;
                c.offset = offset + start;
                c.numel = std::min(cuda::kAdamWBF16ChunkElements, numel - start);
                if (batch.count == cuda::kAdamWBF16MaxChunks) flush();
            }
            offset += numel;
        }
        if (batch.count > 0) flush();
        if (!in_place) {
            int64_t at = 0;
            for (size_t k : b.members) {
                at::Tensor& p = g.params[k];
                p.copy_(flat_weight.narrow(0, at, p.numel()).view(p.sizes()));
                at += p.numel();
            }
        }
        return;
    }
#endif
    std::vector<at::Tensor> params, flat_grads, flat_params;
    for (size_t k : b.members) {
        params.push_back(g.params[k]);
        flat_grads.push_back(g.params[k].grad().reshape(-1));
        flat_params.push_back(g.params[k].reshape(-1));
    }
    at::Tensor grad = at::cat(flat_grads);  // [n] bf16
    if (grad_clamp_ > 0) grad.clamp_(-grad_clamp_, grad_clamp_);
    const at::Tensor before = at::cat(flat_params);  // [n] bf16
    auto write_back = [&](const at::Tensor& after) {
        std::vector<at::Tensor> views;
        int64_t offset = 0;
        for (const at::Tensor& p : params) {
            views.push_back(after.narrow(0, offset, p.numel()).view(p.sizes()));
            offset += p.numel();
        }
        at::_foreach_copy_(params, views);
    };
    auto sr = [&](const at::Tensor& x32) {
        return round_stochastic(x32, draw_noise(b.numel, generator_, x32));
    };

    // The new m, v, shift and weights, written back at the end; fp16: only where found_inf is 0.
    const at::Tensor skip = found_inf_.defined() ? found_inf_.to(b.exp_avg.device()).ne(0) : at::Tensor();
    auto kept = [&](const at::Tensor& old, const at::Tensor& updated) {
        return skip.defined() ? at::where(skip, old, updated) : updated;
    };
    const at::Tensor m_decayed = b.exp_avg.mul(b1);  // bf16
    const at::Tensor g32 = grad.to(at::kFloat);
    const at::Tensor m32 = options_.simpletuner_momentum ? g32.add(m_decayed.to(at::kFloat), 1 - b1)
                                                         : m_decayed.to(at::kFloat).add_(g32, 1 - b1);
    const at::Tensor m = sr(m32);
    // In place without the flag (kept() then hands the bucket's own v back; copy_ to itself is a no-op).
    const at::Tensor v =
        (skip.defined() ? b.exp_avg_sq.mul(b2) : b.exp_avg_sq.mul_(b2)).addcmul_(grad, grad, 1 - b2);
    const at::Tensor denom = v.sqrt().add_(options_.eps);  // bf16, as SimpleTuner computes it
    const at::Tensor shift =
        sr(m.to(at::kFloat).div_(denom.to(at::kFloat)).mul_(scale).add_(b.shift.to(at::kFloat)));
    // Move the representable part of the shift into the weight; keep what rounding lost in the shift.
    const at::Tensor after = sr(shift.to(at::kFloat).add_(before.to(at::kFloat)));  // [n] bf16
    const at::Tensor kept_shift = sr(before.sub(after).to(at::kFloat).add_(shift.to(at::kFloat)));
    b.exp_avg.copy_(kept(b.exp_avg, m));
    b.exp_avg_sq.copy_(kept(b.exp_avg_sq, v));
    b.shift.copy_(kept(b.shift, kept_shift));
    write_back(kept(before, after));
}

void AdamWBF16::apply_decays(size_t group) {
    Plan& plan = *plans_[group];
    ParamGroup& g = groups_[group];
    for (const auto& [k, decay] : plan.due) state_of(g.names[k])["shift"].add_(g.params[k], -decay);
    plan.due.clear();
}

void AdamWBF16::step() {
    at::NoGradGuard no_grad;
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
        const std::vector<size_t> active = active_params(gi);
        if (device_lr_) {
            DTUNE_CHECK(plans_[gi] != nullptr,
                        "internal: adamw_bf16 under use_device_lr() needs upload_lr() "
                        "before each step");
            if (active != plans_[gi]->active) {
                for (size_t k : plans_[gi]->active)
                    DTUNE_CHECK(groups_[gi].params[k].grad().defined(), "adamw_bf16 with cuda_graph: \"",
                                groups_[gi].names[k],
                                "\" has no gradient this step, but a captured step updates a fixed set "
                                "of parameters; set cuda_graph false");
            }
        } else {
            if (active.empty()) continue;
            if (!plans_[gi] || plans_[gi]->active != active) pack(gi, active);
            prepare(gi);
        }
        Plan& plan = *plans_[gi];
        if (!plan.counts.empty()) device_scales(gi);  // fp16
        for (Bucket& b : plan.buckets) update_bucket(groups_[gi], b, plan.scales[b.scale].second);
        if (!plan.counts.empty()) device_counts_and_decays(gi);
        if (!device_lr_) apply_decays(gi);  // host-decided decays (none under fp16)
    }
}

void AdamWBF16::upload_lr() {
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
        if (!plans_[gi]) {  // before the first step: every parameter will have a gradient
            std::vector<size_t> all(groups_[gi].params.size());
            for (size_t i = 0; i < all.size(); ++i) all[i] = i;
            pack(gi, all);
        }
        prepare(gi);
    }
}

void AdamWBF16::after_step() {
    at::NoGradGuard no_grad;
    for (size_t gi = 0; gi < groups_.size(); ++gi)
        if (plans_[gi]) apply_decays(gi);
}

TensorMap AdamWBF16::state_dict() const {
    TensorMap out = Optimizer::state_dict();
    const auto cpu = at::TensorOptions().dtype(at::kDouble);
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
        const std::vector<Host> host = current_host(gi);  // fp16: with the device counts
        for (size_t k = 0; k < host.size(); ++k) {
            const Host& h = host[k];
            if (!h.started) continue;
            out[groups_[gi].names[k] + ".step"] = at::scalar_tensor(h.step, cpu);
            out[groups_[gi].names[k] + ".accumulated_decay"] = at::scalar_tensor(h.accumulated_decay, cpu);
        }
    }
    return out;
}

void AdamWBF16::load_state_dict(const TensorMap& state) {
    Optimizer::load_state_dict(state);  // checks every key names a parameter and every shape fits
    std::map<std::string, std::pair<size_t, size_t>> where;
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
        for (size_t k = 0; k < groups_[gi].names.size(); ++k) where[groups_[gi].names[k]] = {gi, k};
        host_[gi].assign(groups_[gi].params.size(), Host{});
    }
    for (auto& [name, entries] : state_) {
        for (const char* key : {"exp_avg", "exp_avg_sq", "shift", "step", "accumulated_decay"})
            DTUNE_CHECK_AS(DataError, entries.count(key), "optimizer state of \"", name, "\" has no ", key,
                           "; the checkpoint was not written by adamw_bf16 (resume with the optimizer it "
                           "was trained with)");
        const auto [gi, k] = where.at(name);
        host_[gi][k] =
            Host{true, entries["step"].item<double>(), entries["accumulated_decay"].item<double>()};
        entries.erase("step");
        entries.erase("accumulated_decay");
    }
    for (auto& plan : plans_) plan.reset();  // repack (the loaded tensors are copied in) at the next step
}

}  // namespace dtune::train
