// `dtune train --config config.json [--key value ...]`: SimpleTuner-compatible training.
// Exit codes: 0 done, 2 bad config, 3 bad data/model files, 4 stopped by a signal after saving.
#include <cstdio>

#include "cli/command.h"
#include "core/error.h"
#include "core/log.h"
#include "report/observers.h"
#include "train/config.h"
#include "train/signals.h"
#include "train/trainer.h"

namespace dtune::cli {
namespace {

int run_train(const std::vector<std::string>& args) {
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
    train::Trainer trainer(std::move(config));
    report::add_observers(trainer);  // TensorBoard, validation, eval loss, report.html
    const train::TrainResult result = trainer.run();
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
           "override the file. Every option below uses SimpleTuner's name and default. A SimpleTuner\n"
           "option dtune does not implement yet is an error unless it is left at its default; an unknown\n"
           "key is an error naming the closest known one. config.toml is not supported yet.\n\n"
           "Writes to output_dir: config.resolved.json, metrics.jsonl (step, loss, lr, grad_norm,\n"
           "img_per_s, samples_seen, gpu_memory_gib), checkpoint-<step>/ every checkpoint_step_interval\n"
           "steps (the newest checkpoints_total_limit kept), pipeline/unet/ at the end, report.html\n"
           "(rewritten at each checkpoint), validation_images/ (with validation_prompt), eval.jsonl (with\n"
           "a dataset_type eval dataset) and logs/ (report_to tensorboard). A run resumes from the newest\n"
           "complete checkpoint (resume_from_checkpoint latest); incomplete ones are skipped.\n"
           "Ctrl-C or SIGTERM saves a checkpoint and exits with code 4; a second signal exits at once.\n"
           "Now: full fine-tunes of the SDXL UNet, latents encoded on the fly (vae_cache_disable), and a\n"
           "placeholder text embedding until the CLIP text encoders land.\n\n"
           "Options:\n" +
           train::options_help();
}

}  // namespace

DTUNE_REGISTER_COMMAND(train, "train", "train an SDXL model from SimpleTuner's config.json", train_usage(),
                       run_train);

}  // namespace dtune::cli
