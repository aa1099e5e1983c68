// `dtune train --config config.json [--key value ...]`: SimpleTuner-compatible training.
// Exit codes: 0 done, 2 bad config, 3 bad data/model files, 4 stopped by a signal after saving,
// 75 a GPU fault (circuit breaker, or a CUDA error in a step) stopped every rank.
#include <c10/util/Exception.h>

#include <cstdio>
#include <memory>

#include "cli/command.h"
#include "core/error.h"
#include "core/interrupted.h"
#include "core/log.h"
#include "health/breaker.h"
#include "report/observers.h"
#include "train/config.h"
#include "train/run_observers.h"
#include "train/signals.h"
#include "train/simpletuner_options.h"
#include "train/trainer.h"

namespace dtune::cli {
namespace {

int run_train(const std::vector<std::string>& args) {
    if (args.size() == 1 && args[0] == "--list-options") {
        std::fputs(train::options_markdown().c_str(), stdout);  // docs/simpletuner-options.md
        return 0;
    }
    std::filesystem::path config_file;
    std::vector<std::string> overrides;
    for (std::size_t i = 0; i < args.size(); ++i) {
        if (args[i] == "--config" && i + 1 < args.size())
            config_file = args[++i];
        else if (args[i].rfind("--config=", 0) == 0)
            config_file = args[i].substr(9);
        else
            overrides.push_back(args[i]);
    }
    if (config_file.empty() && overrides.empty())
        throw UsageError(
            "dtune train needs --config config/config.json (or options on the command line); "
            "see `dtune train --help`");
    train::TrainConfig config = train::TrainConfig::load(config_file, overrides);
    train::install_stop_signal_handlers();
    std::unique_ptr<train::Trainer> built;
    try {
        built = std::make_unique<train::Trainer>(std::move(config));
    } catch (const Interrupted& e) {  // a signal during the cache build: no step ran, nothing to save
        log::info() << e.what();
        return static_cast<int>(ExitCode::kInterrupted);
    }
    train::Trainer& trainer = *built;
    auto notifier = train::add_run_observers(trainer, trainer.config());  // webhooks, GPU health
    report::add_observers(trainer, notifier);  // TensorBoard, validation (+ previews), eval loss, report.html
    train::add_notifier_closer(trainer, notifier);  // after every observer that posts
    train::TrainResult result;
    try {
        result = trainer.run();
    } catch (const Error&) {
        throw;
    } catch (const std::exception& e) {
        // A CUDA failure in a step means the GPU (or its memory) is not trustworthy: same exit as
        // the circuit breaker, so an orchestrator replaces the instance.
        const auto* torch_error = dynamic_cast<const c10::Error*>(&e);  // its what() has a backtrace
        const std::string message = torch_error ? torch_error->what_without_backtrace() : e.what();
        if (health::is_cuda_error(message))
            throw Error(str("CUDA error in training: ", message), ExitCode::kGpuFault);
        throw;
    }
    if (result.outcome == train::TrainOutcome::kGpuFault) {
        log::error() << "GPU fault (rank " << result.fault_rank << ", GPU " << result.fault_gpu
                     << " of its node) stopped training at step " << result.global_step
                     << "; replace the machine and resume from the last checkpoint";
        return static_cast<int>(ExitCode::kGpuFault);
    }
    if (result.outcome == train::TrainOutcome::kInterrupted) {
        log::info() << "stopped at step " << result.global_step << " after saving a checkpoint; run the same "
                    << "command again to resume";
        return static_cast<int>(ExitCode::kInterrupted);
    }
    log::info() << "training done: " << result.global_step << " steps, last loss " << result.last_loss;
    return 0;
}

std::string train_usage() {
    return "usage: dtune train --config config.json [--key value | --key=value | --set key=value ...]\n\n"
           "Trains from SimpleTuner's config.json (keys with or without \"--\"); command-line options\n"
           "override the file. Every option below uses SimpleTuner's name and default. Every other\n"
           "SimpleTuner option is accepted at SimpleTuner's default (or null) and is an error (\"not\n"
           "implemented by dtune\") at another value; `dtune train --list-options` prints the whole table\n"
           "(docs/simpletuner-options.md). An unknown key is an error naming the closest known one.\n"
           "config.toml with the same keys works too.\n\n"
           "Writes to output_dir: config.resolved.json, metrics.jsonl (step, loss, lr, grad_norm,\n"
           "img_per_s, samples_seen, gpu_memory_gib), report.html (rewritten at each checkpoint),\n"
           "validation_images/ (with validation_prompt), eval.jsonl (with a dataset_type eval dataset),\n"
           "logs/ (report_to tensorboard), checkpoint-<step>/ every checkpoint_step_interval steps (the "
           "newest\n"
           "checkpoints_total_limit kept) and, at the end:\n"
           "  model_type lora: pytorch_lora_weights.safetensors (also in each checkpoint; with use_ema\n"
           "    also ema/pytorch_lora_weights.safetensors). lora_format diffusers: load it with\n"
           "    pipe.load_lora_weights(\"<output_dir>\"); lora_format comfyui: copy it into\n"
           "    ComfyUI/models/loras/. Adapters: lora_rank, lora_alpha, lora_dropout, lora_init_type,\n"
           "    use_dora, init_lora, peft_lora_target_modules (JSON list, e.g. [\"to_q\",\"conv1\"]).\n"
           "  model_type full: pipeline/ (a diffusers SDXL folder: trained unet + the base model's other\n"
           "    components) and, with export_single_file, sdxl_checkpoint.safetensors (single-file SDXL\n"
           "    for ComfyUI/A1111 models/checkpoints/); with use_ema the EMA weights are exported.\n"
           "A run resumes from the newest complete checkpoint (resume_from_checkpoint latest);\n"
           "incomplete ones are skipped. Ctrl-C or SIGTERM saves a checkpoint and exits with code 4 (during\n"
           "the cache build: stops within one encoder batch, keeps the entries, saves no checkpoint); a\n"
           "second signal exits at once. At the end, webhooks get 15 s at most to deliver the last events\n"
           "(what is left is dropped with one warning); a signal during that wait ends it at once, with the\n"
           "run's exit code. output_dir is locked while a run uses it (output_dir/dtune.lock): a second run\n"
           "on it exits 2 naming the first. config.resolved.json and report.html never hold secrets:\n"
           "webhook URLs keep only their host, URL passwords and query values, auth_token and aws_* keys\n"
           "read <redacted>. mixed_precision fp16 uses dynamic loss scaling; on the CPU there is no\n"
           "autocast (bf16/fp16 compute in float32).\n"
           "Data: every enabled image dataset of data_backend_config (multidatabackend.json; type local,\n"
           "aws (read straight from the bucket: nothing is copied to local disk first), or csv: images\n"
           "listed by URL or path in csv_file, downloaded once into csv_cache_dir, captions from\n"
           "csv_caption_column) is bucketed by aspect ratio; each batch comes from one bucket of one\n"
           "dataset. A batch from an is_regularisation_data dataset trains a LoRA toward the base model's\n"
           "prediction (adapters off); a full fine-tune trains it as usual; either way its loss is logged\n"
           "as regularisation_loss. Relative paths (the model, data_backend_config, cache folders) start\n"
           "at the working directory. At start the text embeddings (both SDXL CLIP encoders, and \"\" for\n"
           "caption dropout) go to the text_embeds entry's cache_dir and the VAE latents to each\n"
           "dataset's cache_dir_vae, with a progress bar; valid entries are reused, damaged ones rebuilt\n"
           "with a warning, and the encoders are freed once everything is cached. vae_cache_disable\n"
           "encodes latents every step, vae_cache_ondemand when first needed. SDXL time ids come from\n"
           "each image's bucket metadata. A background loader prepares the next batches (2, or\n"
           "dataloader_prefetch_qlen with dataloader_prefetch).\n"
           "Loss: loss_type l2 | huber | smooth_l1 (pseudo-Huber with huber_c, per sample by\n"
           "huber_schedule snr | exponential | constant), snr_gamma (min-SNR weights), snr_weight (l2\n"
           "without snr_gamma only), timestep_bias_strategy earlier | later | range with\n"
           "timestep_bias_multiplier/_portion/_begin/_end, as SimpleTuner computes them; eval loss\n"
           "uses the same settings.\n"
           "validation_preview (with a raw webhook) sends TAESD previews of validation sampling as\n"
           "validation.image events every validation_preview_steps sampler steps; the decoder is\n"
           "validation_preview_model or madebyollin/taesdxl from the Hugging Face cache.\n"
           "base_model_precision int8-quanto | int8-torchao | fp8-quanto | fp8-torchao stores the frozen\n"
           "UNet of a LoRA/DoRA in 8 bits (half of bf16), dequantised per layer as it runs (fp8 GEMMs for\n"
           "large Linear layers on Hopper); text_encoder_1_precision / text_encoder_2_precision do the\n"
           "same for the CLIP encoders.\n"
           "evaluation_type clip scores each validation prompt's image (clip/min|max|mean|std rows in\n"
           "metrics.jsonl) with pretrained_evaluation_model_name_or_path, a local CLIPModel folder or a\n"
           "hub id in the Hugging Face cache.\n\n"
           "Options:\n" +
           train::options_help();
}

}  // namespace

DTUNE_REGISTER_COMMAND(train, "train", "train an SDXL model from SimpleTuner's config.json", train_usage(),
                       run_train);

}  // namespace dtune::cli
