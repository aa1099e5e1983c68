// The training loop: from a resolved TrainConfig to trained weights, with checkpoints, exact resume,
// metrics and a clean stop on SIGINT/SIGTERM. The model comes through its family (family/model_family.h:
// model_family, or the folder's model_index.json). model_type full trains every weight; model_type lora
// injects LoRA/DoRA adapters and trains only those (set_trainable_parameters, adapters.h); EMA
// (ema.h), fp16 loss scaling (loss_scaler.h) and the exports (export.h) live in trainer_extras.cpp.
//
// The loop reads like a table of contents:
//   for each optimizer step: accumulate micro-batches (batch -> caption dropout -> micro_step ->
//   backward), clip, set the LR, optimizer step, metrics, checkpoint; stop cleanly when asked.
// The host never waits for a step to read its loss: a step's loss, gradient norm and (several
// ranks) the ranks' agreement come back one step later (train/readback.h), and its metrics row
// and on_step_metrics are written then, with that step's own values.
// Invariant: in deterministic mode on the CPU, N steps straight and N/2 + resume + N/2 give
// bit-identical weights (all randomness from checkpointed generators; the batch source resumes
// at the exact next batch).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "family/model_family.h"
#include "train/batch_source.h"
#include "train/callbacks.h"
#include "train/config.h"
#include "train/data_parallel.h"
#include "train/ema.h"
#include "train/optimizer.h"
#include "train/readback.h"
#include "train/step.h"

namespace dtune::dist {
struct DistEnv;
}
namespace dtune::fs {
class DirLock;
}

namespace dtune::train {

class DataParallel;
class GraphedStep;
class LoRATraining;
class LossScaler;
struct LossScalerOptions;
struct CheckpointContents;
struct LoadedCheckpoint;
class RunLog;

struct NamedTensor {
    std::string name;
    at::Tensor tensor;
};

// kGpuFault: the GPU circuit breaker stopped every rank (no checkpoint saved at the stop).
enum class TrainOutcome { kCompleted, kInterrupted, kGpuFault };

struct TrainResult {
    TrainOutcome outcome = TrainOutcome::kCompleted;
    int64_t global_step = 0;
    double last_loss = 0;
    std::optional<std::filesystem::path> resumed_from;
    int fault_rank = -1;  // kGpuFault: the rank whose node reported the fault, and its GPU index
    int fault_gpu = -1;
};

class Trainer {
  public:
    // Loads the family's network (and, for the image source, its encoders) from
    // pretrained_model_name_or_path and builds the batch source from data_backend_config.
    explicit Trainer(TrainConfig config);
    // With a model, objective and batch source given (tests, benchmarks); the family is the
    // config's model_family.
    Trainer(TrainConfig config, std::unique_ptr<family::Denoiser> model, family::TrainingObjective objective,
            std::unique_ptr<BatchSource> source);
    // The network loaded from pretrained_model_name_or_path exactly as the first constructor does
    // (dtype, quantisation, the family's keys), batches from `source` (bench/bench_trainer.cpp).
    Trainer(TrainConfig config, std::unique_ptr<BatchSource> source);
    ~Trainer();

    // The LoRA hook: these tensors (leaf, requires_grad) are optimized and checkpointed instead of
    // every model parameter. Call before run().
    void set_trainable_parameters(std::vector<NamedTensor> params);

    // Trains until max_train_steps (or the epochs) are done or a stop is requested.
    TrainResult run();

    // Observers (metrics, report, validation, webhooks, health); called in the order added.
    void add_callback(std::shared_ptr<TrainCallback> callback);

    // The trained network and its family.
    family::Denoiser& model() { return *model_; }
    const family::ModelFamily& model_family() const { return *family_; }
    const family::TrainingObjective& objective() const { return objective_; }
    int64_t total_steps() const { return total_steps_; }
    int64_t global_step() const { return global_step_; }
    const TrainConfig& config() const { return config_; }
    // What every step runs with: noise, timestep sampling, loss options (set up by the constructor).
    const StepOptions& step_options() const { return step_options_; }
    // Tests only: fixed flow-matching noise and sigmas (StepOptions::fixed_flow_draws). Before run().
    // How steps are read back (default: ReadbackOptions::from_env()). Before run().
    void set_readback_options(ReadbackOptions options) { readback_ = options; }
    void set_fixed_flow_draws(FlowDrawFn draws) { step_options_.fixed_flow_draws = std::move(draws); }
    // Tests only: the fp16 loss scaler's settings (torch.amp.GradScaler's defaults otherwise), e.g.
    // a scale that overflows. Before run(); no effect unless mixed_precision is fp16.
    void set_loss_scaler_options(const LossScalerOptions& options);
    // Appends a row {"step": step, ...fields} to metrics.jsonl now (rank 0): what an observer
    // measures about a step after its row was written (validation's CLIP scores). Usable until the
    // end of on_train_end.
    void append_metrics_row(int64_t step, const nlohmann::json& fields);
    const std::filesystem::path& output_dir() const { return output_dir_; }
    c10::Device device() const { return device_; }
    const std::vector<NamedTensor>& trainable_parameters() const { return trainable_; }
    // Rank 0 writes shared files (checkpoints, outputs, reports); 0 when not distributed.
    bool is_main_process() const { return rank_ == 0; }
    // The bytes one checkpoint of this run writes, estimated before the first step: the trainable
    // weights (whole, under ZeRO-3 too), the optimizer state (AdamW 2x the weights, adamw_bf16 3x in
    // bf16, Lion 1x; SGD without momentum and Adafactor's factored moments count as none) and the
    // EMA copy, and their safetensors headers. The random states and JSON files are left out.
    int64_t estimated_checkpoint_bytes() const;
    int64_t trainable_bytes() const;  // the trainable tensors' bytes
    int rank() const { return rank_; }
    int local_rank() const;
    int world_size() const;
    // With use_ema: puts the EMA weights into the model until the guard ends (validation with EMA
    // weights); without EMA (or before run() starts) a no-op guard. Do not train while it lives.
    EMAWeightsGuard use_ema_weights();
    // ZeRO-3: the whole weights are in the model until the guard ends (gathered from every rank:
    // every rank must call this at the same point, as callbacks run on every rank). Otherwise, or
    // when they are already whole, a guard that does nothing.
    std::shared_ptr<void> whole_weights();
    const EMAModel* ema() const { return ema_.get(); }
    // model_type lora: the injected adapters (nullptr for a full fine-tune).
    LoRATraining* lora() { return lora_.get(); }
    // cuda_graph: the graphed step when the run allows it (nullptr: eager; trainer_graph.cpp).
    const GraphedStep* graphed_step() const { return graph_.get(); }
    // cuda_graph's setting (auto | true | false) and, when a run that could have used graphs trains
    // eagerly, why (empty otherwise). metrics.jsonl and report.html carry both.
    struct GraphStatus {
        std::string requested;
        std::string fallback;
    };
    const GraphStatus& graph_status() const { return graph_status_; }

  private:
    TrainResult run_loop();
    void init_common();
    void build_optimizer();
    // The configured optimizer over `groups` (on the training device, or the CPU copies when offloaded).
    std::unique_ptr<Optimizer> make_optimizer(std::vector<ParamGroup> groups) const;
    void resume();
    StepScalars train_one_step();
    // The end of step global_step_ (the loop's table of contents): its scalars queued for the
    // host (PendingStep), the steps due read back, the agreement of the ranks for the next step.
    void queue_step(StepScalars scalars, StepReport report, bool writes_row);
    // Reads back the queued steps up to `step`, oldest first: non-finite loss check, metrics row,
    // on_step_metrics. Before a checkpoint, a row of an observer, and at the end, `step` is the
    // current one. `wait` false: only those already read (after an error: no wait on a collective).
    void read_back_steps(int64_t step, bool wait = true);
    void read_back_step(PendingStep& p);
    // Writes the rows of steps already read back after an error (never throws).
    void read_back_after_error() noexcept;
    // The next micro-batch; a failure to fetch it is remembered for save_after_fetch_error.
    TrainBatch next_batch(int64_t micro);
    // After a batch could not be fetched (a deleted image, an unreadable cache entry) at a step
    // boundary, nothing of the step has run yet: saves a checkpoint when the weights are finite
    // and there is something new to save. Never throws (the data error is what the run reports).
    void save_after_fetch_error() noexcept;
    void save(const std::string& why);
    void append_metrics(const StepReport& report, const nlohmann::json& fields);
    void write_final_outputs();
    void init_data_parallel(const dist::DistEnv& env);
    // trainer_zero3.cpp: what zero_stage 3 cannot run with (UsageError naming the key), attaching
    // the model to data parallelism (sharded or not), and the sharded weights' resume.
    void check_zero3_support() const;
    void attach_data_parallel();
    void load_sharded_weights(const std::filesystem::path& file,
                              const std::map<std::string, at::Tensor>& by_name);
    // DTUNE_INJECT_POINT=zero3_gather (tests): arms DTUNE_INJECT_STEP_ERROR at this step's 3rd
    // all-gather; false when the failure belongs at the step's start.
    bool arm_gather_fault_injection();
    std::optional<bool> inject_at_gather_;  // DTUNE_INJECT_POINT, read once
    // A full fine-tune's weights from a checkpoint: every trainable tensor present, with the model's
    // shape and dtype, and finite (DataError naming the file and the tensor otherwise).
    void load_full_weights(const LoadedCheckpoint& ckpt);
    void load_optimizer_state(const LoadedCheckpoint& ckpt);
    // A full fine-tune's weights in a checkpoint: "<denoiser folder>/diffusion_pytorch_model.safetensors".
    std::string weights_file() const {
        return std::string(family_->denoiser_folder()) + "/diffusion_pytorch_model.safetensors";
    }
    // trainer_extras.cpp: LoRA adapters, EMA, fp16 loss scaling and the exports.
    void init_extras();
    // base_model_precision: quantises the frozen network in place (before LoRA injection), once.
    void quantize_base_model();
    // The constructors' shared start (trainer.cpp): pretrained_model_name_or_path checked, then the
    // network loaded as `dtune train` loads it.
    void check_model_dir();
    void load_network();
    // The network of model_dir_: from the quantized_model_cache file when one matches, else loaded
    // (and, with a cache folder, quantised and written there by the main process).
    std::unique_ptr<family::Denoiser> load_base_model(const models::ComponentLoadOptions& load,
                                                      bool main_process);
    void start_ema();
    // Main process, before the first step: logs the estimated checkpoint size, and warns when
    // output_dir's file system has less room than one checkpoint plus the final weights.
    void check_output_space() const;
    // fp16: a read-back step's [found_inf, scale, skipped] (the last values of `v`, queued by
    // queue_step from LossScaler::update) into its metrics row (loss_scale, skipped_steps), and a
    // log line when its optimizer step was skipped.
    void read_back_loss_scale(PendingStep& p, const std::vector<double>& v);
    void save_extras(CheckpointContents& c);
    void load_extras(const LoadedCheckpoint& ckpt);
    bool load_lora_weights(const LoadedCheckpoint& ckpt);
    void write_model_outputs();
    // trainer_graph.cpp: cuda_graph (the whole optimizer step as one CUDA graph per batch shape).
    void init_graph();
    StepScalars train_graphed_step(double lr);
    // The hooks both step paths run (step.h): LoRA's dropout seed and the regularisation switch.
    StepHooks step_hooks();
    // metrics.jsonl's CUDA-graph fields for this row (none for a CPU run or cuda_graph false).
    void add_graph_fields(nlohmann::json& row);

    // Declared first, released last: output_dir is this run's until everything else is torn down.
    std::unique_ptr<fs::DirLock> output_lock_;  // rank 0 of `dtune train` (see fs::DirLock)
    TrainConfig config_;
    std::filesystem::path output_dir_;
    std::filesystem::path model_dir_;
    c10::Device device_ = c10::Device(c10::kCPU);
    const family::ModelFamily* family_ = nullptr;
    std::unique_ptr<family::Denoiser> model_;
    family::TrainingObjective objective_;
    std::unique_ptr<BatchSource> source_;
    std::vector<NamedTensor> trainable_;
    std::unique_ptr<Optimizer> optimizer_;
    std::optional<at::Generator> generator_;            // every random draw of the step
    std::optional<at::Generator> optimizer_generator_;  // adamw_bf16's stochastic rounding
    bool offload_optimizer_ = false;                    // offload_optimizer_device cpu
    bool base_quantized_ = false;                       // base_model_precision applied
    StepOptions step_options_;
    PromptEmbedding empty_prompt_;
    int64_t global_step_ = 0;
    int64_t start_step_ = 0;  // global_step_ when this run's loop began (0, or the resumed step)
    int64_t total_steps_ = 0;
    int64_t failed_fetch_micro_ = -1;      // micro-step whose batch could not be fetched (-1: none)
    std::unique_ptr<RunLog> metrics_log_;  // metrics.jsonl (rank 0)
    std::optional<std::filesystem::path> resumed_from_;
    std::vector<std::shared_ptr<TrainCallback>> callbacks_;
    int rank_ = 0;
    std::unique_ptr<DataParallel> dp_;  // data parallelism (a no-op for one process)
    std::unique_ptr<LoRATraining> lora_;
    bool lora_cast_factors_ = true;  // DTUNE_LORA_CAST_FACTORS (step_hooks)
    std::unique_ptr<EMAModel> ema_;
    std::unique_ptr<LossScaler> scaler_;  // mixed_precision fp16
    // fp16 with an optimizer that cannot skip on the device (Optimizer::skip_step_on_overflow false):
    // the step's overflow read on the host, and the optimizer step not taken.
    bool step_overflowed_ = false;
    bool scaler_skips_on_device_ = false;  // fp16: the optimizer skips overflowed steps itself
    at::Tensor scaler_values_;             // fp16: this step's LossScaler::update(), read back with it
    // Whether the step's last micro-batch was regularisation data (SimpleTuner then logs
    // regularisation_grad_norm); the regularisation loss comes with the step's read-back.
    bool step_ended_on_regularisation_ = false;
    ReadbackOptions readback_ = ReadbackOptions::from_env();
    std::deque<PendingStep> pending_steps_;  // queued, not yet read back (oldest first)
    // Several ranks: the agreement issued at the end of each step, kept from its read-back until
    // the loop acts on it (`lag` steps later; every rank at the same step).
    std::map<int64_t, StepAgreement> agreements_;
    std::optional<StepReport> last_read_;  // the latest step read back (progress bar, last_loss)
    bool loss_failed_ = false;             // a read-back found a non-finite loss (the run is failing)
    std::unique_ptr<GraphedStep> graph_;   // cuda_graph, when the run allows it
    GraphStatus graph_status_;
    bool graph_fallback_written_ = false;  // the fallback reason went into metrics.jsonl
};

// Parses "cpu", "cuda", "cuda:N" or "auto" (CUDA when available).
c10::Device parse_train_device(const std::string& name);

}  // namespace dtune::train
