// Optimizers over plain at::Tensor parameters (no torch::optim), with state as a flat name -> tensor
// map for safetensors checkpoints, and gradient clipping.
//
// Invariants: parameters are leaf tensors updated in place under no-grad; a parameter whose grad is
// undefined is skipped (its state untouched); state keys are "<param name>.<state key>", e.g.
// "unet.conv_in.weight.exp_avg", and load_state_dict() accepts exactly what state_dict() wrote.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dtune::train {

using TensorMap = std::map<std::string, at::Tensor>;

struct ParamGroup {
    std::vector<std::string> names;  // unique across all groups: the state map's keys
    std::vector<at::Tensor> params;
    double lr = 1e-4;
    double weight_decay = 0.0;
};

class Optimizer {
  public:
    explicit Optimizer(std::vector<ParamGroup> groups);
    virtual ~Optimizer() = default;
    Optimizer(const Optimizer&) = delete;
    Optimizer& operator=(const Optimizer&) = delete;

    virtual const char* name() const = 0;
    // One update of every parameter that has a gradient.
    virtual void step() = 0;
    // Drops the gradients (set to undefined, like torch's set_to_none). With several ranks the
    // gradients are views of dist::GradReducer's buckets: DataParallel::after_step() zeroes the
    // buckets in place and makes the views the grads again (one fill per bucket, not one per
    // parameter), so dropping them here costs nothing and frees nothing.
    void zero_grad();

    std::vector<ParamGroup>& param_groups() { return groups_; }
    const std::vector<ParamGroup>& param_groups() const { return groups_; }
    // Sets every group's lr (use per-group base rates x LRSchedule::multiplier for mixed groups).
    void set_lr(double lr);

    // Copies of the per-parameter state, "<name>.<key>" -> tensor.
    virtual TensorMap state_dict() const;
    // Replaces the state. Throws DataError naming the key when a key names no parameter, or a
    // tensor's shape does not match the parameter's state it replaces.
    virtual void load_state_dict(const TensorMap& state);

    // CUDA graphs (GraphedStep). After use_device_lr(), step() reads its learning rate (and whatever
    // else changes per step) from device tensors that upload_lr() refreshes outside any capture, so
    // a captured step() replays correctly; after_step() does the host-side rest once the (replayed
    // or eager) step is queued. The caller runs set_lr, upload_lr, the step, after_step in that
    // order. Optimizers that cannot be captured keep these no-ops (cuda_graph_blocker refuses them).
    virtual void use_device_lr() {}
    virtual void upload_lr() {}
    virtual void after_step() {}
    // Generators step() draws from: a capture must register them to advance them on every replay.
    virtual std::vector<at::Generator> generators() const { return {}; }
    // fp16 loss scaling (loss_scaler.h): `found_inf` is a [] float32 on the parameters' device,
    // exactly 1 when this step's gradients overflowed, rewritten before every step() at the same
    // address. Returns true when step() from now on skips itself on the device when it is 1
    // (parameters and every state tensor, step counts included, left as they were; no host read);
    // false (the default): the caller must read the flag and not call step() on an overflow.
    virtual bool skip_step_on_overflow(const at::Tensor& /*found_inf*/) { return false; }
    // grad_clip_method value: returns true when step() clamps each gradient element to [-clip, clip]
    // itself as it reads it (from then on, for every step), so the caller skips its own clamp
    // (clip_grad_value: two passes over every gradient). The gradients keep their unclamped values.
    virtual bool clamp_gradients_in_step(double /*clip*/) { return false; }

  protected:
    // The state of one parameter, created on first use.
    TensorMap& state_of(const std::string& name) { return state_[name]; }

    std::vector<ParamGroup> groups_;
    std::map<std::string, TensorMap> state_;
};

// ---- AdamW ------------------------------------------------------------------------------------

struct AdamWOptions {
    double beta1 = 0.9;  // adam_beta1 / adam_beta2 / adam_epsilon: SimpleTuner's defaults
    double beta2 = 0.999;
    double eps = 1e-8;
    // Use at::_fused_adamw_ when every parameter of a group shares device and floating dtype (what
    // torch.optim.AdamW(fused=True) runs); otherwise, or when false, a per-tensor loop.
    bool fused = true;
};

// torch.optim.AdamW: decoupled weight decay p *= 1 - lr * wd, bias-corrected moments.
class AdamW : public Optimizer {
  public:
    AdamW(std::vector<ParamGroup> groups, AdamWOptions options = {});
    const char* name() const override { return "adamw"; }
    void step() override;
    const AdamWOptions& options() const { return options_; }
    // CUDA graphs: from now on the fused path reads each group's lr from a float32 tensor on the
    // parameters' device (the per-tensor loop: a float64 one, and its step counts there too), which
    // upload_lr() refreshes from ParamGroup::lr outside any capture; a captured step then follows LR
    // changes without being recaptured.
    void use_device_lr() override { device_lr_ = true; }
    void upload_lr() override;
    // Fused: found_inf goes to the kernel, which leaves the weights and moments alone, and the step
    // counts taken back (what torch.optim.AdamW(fused=True) does under GradScaler); the per-tensor
    // loop restores them on the device (at::where), also without a host read.
    bool skip_step_on_overflow(const at::Tensor& found_inf) override {
        found_inf_ = found_inf;
        return true;
    }

  private:
    void step_loop(ParamGroup& group);
    bool step_fused(ParamGroup& group);

    AdamWOptions options_;
    bool device_lr_ = false;
    at::Tensor found_inf_;                // fp16 (skip_step_on_overflow); undefined otherwise
    std::vector<at::Tensor> lr_tensors_;  // per group, [] float32 (device_lr_)
    std::vector<at::Tensor> loop_lr_;     // per group, [] float64 on its device (step_loop)
};

// ---- AdamW for bf16 weights with stochastic rounding (SimpleTuner's default `adamw_bf16`) ------

struct AdamWBF16Options {
    double beta1 = 0.9;  // SimpleTuner's adamw_bf16 defaults: betas .9/.999, eps 1e-6 (wd 1e-2 per group)
    double beta2 = 0.999;
    double eps = 1e-6;
    // SimpleTuner's update adds (1 - beta1) * exp_avg to the gradient (its add_stochastic_ swaps the
    // operands), so the first moment is grad + (1 - beta1) * beta1 * m. true reproduces that; false
    // uses the textbook m = beta1 m + (1 - beta1) grad.
    bool simpletuner_momentum = true;
    // Elements per flat bucket; 0 picks by device. CUDA: 2^26 (~35 whole-bucket kernels per bucket,
    // ~20 bytes of temporaries per element: ~1.3 GB, ~40 buckets for the SDXL UNet's 2.6e9 weights).
    // CPU: 2^20, where temporaries that stay in the allocator's and the caches' reach beat fewer ops
    // (bench_adamw_bf16: 1.28x the per-tensor loop's CPU time at 2^20, 0.96x at 2^26).
    int64_t bucket_elements = 0;
    // CUDA: each bucket's update as one fused kernel (train/cuda/adamw_bf16_kernel.cu) where it was
    // built; same formulas and rounding points, its own Philox numbers from the generator. false (or
    // no kernel built, or CPU): the whole-bucket ATen ops below.
    bool fused_kernel = true;
};

// SimpleTuner's AdamWBF16 on bf16 parameters: moments and a "shift" buffer (the part of the update
// bf16 could not hold: true weight = p + shift) kept in bf16 like the weights, every float32 -> bf16
// write of m, shift and p stochastically rounded with noise from `generator`; v and the denominator
// in plain bf16 arithmetic; bias correction only on the second moment; weight decay accumulated per
// parameter (random start in [0, 5e-3)) and subtracted from the shift once it exceeds 5e-3.
//
// How it runs: the parameters with gradients are packed into flat buckets (gradients and weights
// gathered with one cat each, the bucket's m, v and shift stored flat, the per-parameter state
// tensors being views of them), and each bucket is updated by whole-bucket kernels, the weights
// written back with one multi-tensor copy: no per-parameter kernels and no host synchronisation.
// The step counts and decay accumulators are host numbers (the same for every step of a given run,
// so nothing is read back); each bucket's -lr * sqrt(1 - beta2^t) is a device scalar filled before
// the kernels. A parameter's decay, when due, is one bf16 kernel after the step (rare: every
// 5e-3 / (lr * wd) steps). Repacking (first step, after load_state_dict, or when the set of
// parameters with gradients changes) reads the new random decay starts back once.
//
// fp16 (skip_step_on_overflow, called before the first step): the step counts and decay accumulators
// move to the device (float64, per bucket's step count and per parameter), since an overflowed step
// must leave them as they were with no host read. Each step computes its -lr * sqrt(1 - beta2^t)
// there from the count (float64; pow is torch's), updates into new tensors kept only where found_inf
// is 0 (the fused kernel returns at once when it is 1), advances the counts by 1 - found_inf, and
// applies the decays that came due on the device, masked, as part of the step: one pass over the
// shift and weights of every parameter per step (their float32 multiply-add may round the last bf16
// bit of a decayed shift unlike the host path's bf16 add). The rounding noise is drawn either way.
//
// Checkpoint state per parameter, as before: exp_avg, exp_avg_sq, shift (bf16, the parameter's
// shape) and step, accumulated_decay (float64 scalars on the CPU).
class AdamWBF16 : public Optimizer {
  public:
    AdamWBF16(std::vector<ParamGroup> groups, at::Generator generator, AdamWBF16Options options = {});
    ~AdamWBF16() override;
    const char* name() const override { return "adamw_bf16"; }
    void step() override;
    TensorMap state_dict() const override;
    void load_state_dict(const TensorMap& state) override;
    // Captured steps: every parameter must have a gradient at every step (the packing is fixed).
    void use_device_lr() override { device_lr_ = true; }
    void upload_lr() override;
    void after_step() override;
    std::vector<at::Generator> generators() const override { return {generator_}; }
    bool clamp_gradients_in_step(double clip) override {
        grad_clamp_ = clip;
        return true;
    }
    bool skip_step_on_overflow(const at::Tensor& found_inf) override;

  private:
    struct Bucket;
    struct Plan;
    struct Host {  // per parameter, host-side
        bool started = false;
        double step = 0;
        double accumulated_decay = 0;
    };

    std::vector<size_t> active_params(size_t group) const;
    void pack(size_t group, const std::vector<size_t>& active);
    void prepare(size_t group);  // host bookkeeping of one step and the device scalars it needs
    void update_bucket(ParamGroup& g, Bucket& b, const at::Tensor& scale);  // scale: [] float32
    void apply_decays(size_t group);
    // fp16 skipping: one group's host state with the device counts read back (outside any capture),
    // the device terms of one step, and the counts and decays after its buckets.
    std::vector<Host> current_host(size_t group) const;
    void device_scales(size_t group);
    void device_counts_and_decays(size_t group);

    at::Generator generator_;
    AdamWBF16Options options_;
    double grad_clamp_ = 0;  // > 0: gradients read clamped to [-grad_clamp_, grad_clamp_]
    bool device_lr_ = false;
    at::Tensor found_inf_;                 // fp16 (skip_step_on_overflow): [] float32; undefined otherwise
    std::vector<std::vector<Host>> host_;  // [group][param]
    std::vector<std::unique_ptr<Plan>> plans_;  // [group]; null: pack at the next step
};

// float32 -> bf16 with stochastic rounding: random low 16 bits added to the float's bit pattern, then
// truncated, so E[result] = source. Writes into `target` (bf16, same shape).
void copy_stochastic_(at::Tensor& target, const at::Tensor& source, at::Generator& generator);

// ---- Lion and SGD -------------------------------------------------------------------------------

// Captured steps of Lion, SGD and Adafactor (optimizer_graph.cpp). After use_device_lr() every
// parameter must have a gradient at every step (a captured step updates a fixed set); their state is
// created by upload_lr(), outside any capture, and step() reads what changes per step from [] tensors
// on the group's device that upload_lr() refills (fill_: a kernel with the value as argument, no
// wait for the GPU); after_step() advances the host-side counts. No host reads, no branch that differs
// between replays. On the CPU in float32 the update is bit-identical to the host-lr path
// (tests/train/test_optimizer_graph.cpp); on bf16 / fp16 weights the lr-like scalars are rounded to
// the weights' dtype by type promotion before they multiply (the host path multiplies in float32).
struct DeviceLr {
    at::Tensor neg_lr;  // [] float32: -lr
    at::Tensor decay;   // [] float32: 1 - lr * weight_decay
};

// fp16 (Optimizer::skip_step_on_overflow) for Lion, SGD and Adafactor. The host-lr path runs eagerly
// and reads the flag once before its step (the trainer read it there before); the device-lr path
// reads nothing: it computes the new weights and state into copies and keeps the old values where
// the flag is 1 (at::where, exact even when the overflowed gradients hold inf or NaN), and counts
// that live on the device (SGD's buffer start, Adafactor's step) advance by 1 - found_inf. With the
// flag 0 the bits are those of the path without it (tests/train/test_optimizer_graph.cpp).
struct OverflowSkip {
    at::Tensor found_inf;  // [] float32; undefined: no fp16 loss scaling
    bool on() const { return found_inf.defined(); }
    bool overflowed_on_host() const;  // the host-lr path's read
};

struct LionOptions {
    double beta1 = 0.9;  // optimi-lion's defaults (SimpleTuner: betas .9/.99, wd 0)
    double beta2 = 0.99;
};

// Lion (Chen et al. 2023): p *= 1 - lr wd; p -= lr sign(beta1 m + (1 - beta1) g); m = beta2 m + (1 - beta2)
// g.
class Lion : public Optimizer {
  public:
    Lion(std::vector<ParamGroup> groups, LionOptions options = {});
    const char* name() const override { return "lion"; }
    void step() override;
    // Multi-tensor kernels over chunks of parameters from now on (see DeviceLr).
    void use_device_lr() override { device_lr_ = true; }
    void upload_lr() override;
    // fp16: see OverflowSkip.
    bool skip_step_on_overflow(const at::Tensor& found_inf) override {
        skip_.found_inf = found_inf;
        return true;
    }

  private:
    void step_device();  // checks every group, then step_group() for each
    void step_group(size_t group);

    LionOptions options_;
    bool device_lr_ = false;
    OverflowSkip skip_;
    std::vector<DeviceLr> lr_;  // per group (device_lr_)
};

struct SGDOptions {
    double momentum = 0.0;
    double dampening = 0.0;
    bool nesterov = false;
};

// torch.optim.SGD: coupled (L2) weight decay g += wd p; momentum buffer starts at the first gradient.
class SGD : public Optimizer {
  public:
    SGD(std::vector<ParamGroup> groups, SGDOptions options = {});
    const char* name() const override { return "sgd"; }
    void step() override;
    // Captured steps (see DeviceLr): a buffer's start is a device-side blend, buf = keep buf +
    // take d with (keep, take) = (0, 1) at a parameter's first step and (momentum, 1 - dampening)
    // after it (the buffer starts at zero), so a first step gives the same bits eager or replayed.
    void use_device_lr() override { device_lr_ = true; }
    void upload_lr() override;
    void after_step() override;
    // Buffers upload_lr() made for parameters not yet stepped are left out, as the host path has none.
    TensorMap state_dict() const override;
    void load_state_dict(const TensorMap& state) override;
    // fp16: see OverflowSkip; call it before the first step. A cohort's start is then a device flag
    // (a first step that overflowed does not start the buffers).
    bool skip_step_on_overflow(const at::Tensor& found_inf) override;

  private:
    // Parameters of one group whose buffers started together (at most two sets: loaded and new).
    struct Cohort {
        bool started = false;
        std::vector<size_t> members;
        at::Tensor keep, take;     // [] float32 on the group's device
        at::Tensor started_flag;   // fp16 skipping with momentum: [] float32, 1 once started
        bool has_started() const;  // reads started_flag (outside any capture)
    };
    void prepare_device(size_t group);
    void step_device();  // checks every group, then step_group() for each
    void step_group(size_t group);

    SGDOptions options_;
    bool device_lr_ = false;
    OverflowSkip skip_;
    bool uploaded_ = false;                     // upload_lr() since the last after_step()
    std::vector<DeviceLr> lr_;                  // per group (device_lr_)
    std::vector<std::vector<Cohort>> cohorts_;  // [group]; empty: built at the next upload_lr()
};

// ---- Adafactor -----------------------------------------------------------------------------------

struct AdafactorOptions {
    double beta2_decay = -0.8;   // 1 - beta2_t = step^beta2_decay
    std::optional<double> eps1;  // variance floor; unset: the dtype's machine epsilon
    double eps2 = 1e-3;          // floor of the parameter RMS in the step size
    double d = 1.0;              // update clipping threshold
};

// torch.optim.Adafactor (Shazeer & Stern 2018 as torch implements it): factored second moments (row
// and column means of grad^2) for parameters of 2+ dims, a full one for vectors; relative step size
// min(lr, 1/sqrt(t)) x max(eps2, RMS(p)); decoupled weight decay; no first moment.
class Adafactor : public Optimizer {
  public:
    Adafactor(std::vector<ParamGroup> groups, AdafactorOptions options = {});
    const char* name() const override { return "adafactor"; }
    void step() override;
    // Captured steps (see DeviceLr): the step counts are host numbers per cohort (parameters with
    // the same count, which stay together since all step every time); upload_lr() fills the next
    // step's t^beta2_decay and min(lr, 1/sqrt(t)), and the RMS and update-clipping scalars are
    // computed on the device in float64, as the host path computes them on the host.
    void use_device_lr() override { device_lr_ = true; }
    void upload_lr() override;
    void after_step() override;
    // "step" comes from the cohorts; parameters not yet stepped are left out.
    TensorMap state_dict() const override;
    void load_state_dict(const TensorMap& state) override;
    // fp16: see OverflowSkip; call it before the first step. The device-lr path then keeps each
    // cohort's step count on the device and computes t^beta2_decay and min(lr, 1/sqrt(t)) there in
    // float64 (sqrt and division as the host's; pow is torch's).
    bool skip_step_on_overflow(const at::Tensor& found_inf) override;

  private:
    struct Chunk {  // parameters whose update temporaries are alive together
        std::vector<size_t> members;
        at::Tensor sqrt_numel;  // [k] float64: sqrt(numel), the RMS divisor
        at::Tensor clip_scale;  // [k] float64: sqrt(numel) x d, the update-clipping divisor
    };
    struct Cohort {
        double step = 0;  // steps taken (the host path's "step" state)
        std::vector<Chunk> chunks;
        at::Tensor rho;                               // [] float64: min(lr, 1/sqrt(t))
        std::map<at::ScalarType, at::Tensor> weight;  // [] per state dtype: 1 - beta2_t = t^beta2_decay
        at::Tensor count, lr;  // fp16 skipping: [] float64 on the device, steps taken and this step's lr
        double steps_taken() const;  // `step`, or `count` read back (outside any capture)
    };
    double eps1_for(at::ScalarType type) const;  // the variance floor for weights of `type`
    void prepare_device(size_t group);
    void step_device();  // checks every group, then step_group() for each
    void step_group(size_t group);

    AdafactorOptions options_;
    bool device_lr_ = false;
    OverflowSkip skip_;
    bool uploaded_ = false;                     // upload_lr() since the last after_step()
    std::vector<DeviceLr> lr_;                  // per group (device_lr_)
    std::vector<std::vector<Cohort>> cohorts_;  // [group]; empty: built at the next upload_lr()
};

// ---- gradient clipping --------------------------------------------------------------------------

// torch.nn.utils.clip_grad_norm_: scales all gradients by min(1, max_norm / (total + 1e-6)), where
// total is the norm_type norm of all gradients together (inf: max abs). Returns total (possibly
// non-finite: the caller decides what to do with that).
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm, double norm_type = 2.0);
// The same without reading the norm back: returns the total norm as a float32 scalar on the
// gradients' device (undefined when no parameter has a gradient), so a step never waits for the
// GPU. max_norm <= 0 only measures. Gradients sharing device and dtype are scaled by one
// multi-tensor kernel.
at::Tensor clip_grad_norm_async(const std::vector<at::Tensor>& params, double max_norm,
                                double norm_type = 2.0);
// torch.nn.utils.clip_grad_value_: clamps every gradient element to [-clip, clip] (no host sync).
void clip_grad_value(const std::vector<at::Tensor>& params, double clip);

}  // namespace dtune::train
