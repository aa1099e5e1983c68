// Optimizers over plain at::Tensor parameters (no torch::optim), with state as a flat name -> tensor
// map for safetensors checkpoints, and gradient clipping.
//
// Invariants: parameters are leaf tensors updated in place under no-grad; a parameter whose grad is
// undefined is skipped (its state untouched); state keys are "<param name>.<state key>", e.g.
// "unet.conv_in.weight.exp_avg", and load_state_dict() accepts exactly what state_dict() wrote.
#pragma once

#include <ATen/ATen.h>

#include <map>
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
    // Drops the gradients (set to undefined, like torch's set_to_none).
    void zero_grad();

    std::vector<ParamGroup>& param_groups() { return groups_; }
    const std::vector<ParamGroup>& param_groups() const { return groups_; }
    // Sets every group's lr (use per-group base rates x LRSchedule::multiplier for mixed groups).
    void set_lr(double lr);

    // Copies of the per-parameter state, "<name>.<key>" -> tensor.
    TensorMap state_dict() const;
    // Replaces the state. Throws DataError naming the key when a key names no parameter, or a
    // tensor's shape does not match the parameter's state it replaces.
    void load_state_dict(const TensorMap& state);

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
    // parameters' device, which upload_lr() refreshes from ParamGroup::lr outside any capture; a
    // captured step then follows LR changes without being recaptured.
    void use_device_lr() { device_lr_ = true; }
    void upload_lr();

  private:
    void step_loop(ParamGroup& group);
    bool step_fused(ParamGroup& group);

    AdamWOptions options_;
    bool device_lr_ = false;
    std::vector<at::Tensor> lr_tensors_;  // per group, [] float32 (device_lr_)
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
};

// AdamW on bf16 parameters: moments and a "shift" buffer (the part of the update bf16 could not hold)
// in bf16, every float32 -> bf16 write stochastically rounded; weight decay accumulated and applied
// once it exceeds 5e-3 (per-parameter random start). Bias correction only on the second moment, as
// SimpleTuner's AdamWBF16. All randomness from `generator`.
class AdamWBF16 : public Optimizer {
  public:
    AdamWBF16(std::vector<ParamGroup> groups, at::Generator generator, AdamWBF16Options options = {});
    const char* name() const override { return "adamw_bf16"; }
    void step() override;

  private:
    void step_param(const std::string& name, at::Tensor& p, const at::Tensor& grad, double lr, double wd);

    at::Generator generator_;
    AdamWBF16Options options_;
};

// float32 -> bf16 with stochastic rounding: random low 16 bits added to the float's bit pattern, then
// truncated, so E[result] = source. Writes into `target` (bf16, same shape).
void copy_stochastic_(at::Tensor& target, const at::Tensor& source, at::Generator& generator);

// ---- Lion and SGD -------------------------------------------------------------------------------

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

  private:
    LionOptions options_;
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

  private:
    SGDOptions options_;
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

  private:
    AdafactorOptions options_;
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
// torch.nn.utils.clip_grad_value_: clamps every gradient element to [-clip, clip].
void clip_grad_value(const std::vector<at::Tensor>& params, double clip);

}  // namespace dtune::train
