// LoRA training setup and adapter files (see adapters.h).
#include "train/adapters.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/module.h>

#include <mutex>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "family/model_family.h"

namespace dtune::train {
namespace {

constexpr const char* kTargetsHelp =
    "give peft_lora_target_modules as a JSON list of module-name suffixes, e.g. "
    "[\"to_k\", \"to_q\", \"to_v\", \"to_out.0\"], or the path to a JSON file holding such a list";

std::vector<std::string> targets_from_array(const nlohmann::json& list, const std::string& where) {
    std::vector<std::string> out;
    for (const auto& item : list) {
        DTUNE_CHECK_AS(UsageError, item.is_string() && !item.get<std::string>().empty(), where,
                       " holds a non-string or empty entry ", item.dump(), "; ", kTargetsHelp);
        out.push_back(item.get<std::string>());
    }
    DTUNE_CHECK_AS(UsageError, !out.empty(), where, " is an empty list; ", kTargetsHelp);
    return out;
}

}  // namespace

std::vector<std::string> parse_lora_targets(const nlohmann::json& value,
                                            const std::vector<std::string>& defaults) {
    if (value.is_null()) return defaults;
    if (value.is_array()) return targets_from_array(value, "peft_lora_target_modules");
    DTUNE_CHECK_AS(UsageError, value.is_string(), "peft_lora_target_modules = ", value.dump(),
                   " is not a list; ", kTargetsHelp);
    const std::string text = value.get<std::string>();
    if (text.empty() || text == "None" || text == "null") return defaults;
    nlohmann::json parsed = nlohmann::json::parse(text, nullptr, false);
    if (!parsed.is_discarded()) {
        DTUNE_CHECK_AS(UsageError, parsed.is_array(), "peft_lora_target_modules = ", text,
                       " is JSON but not a list; ", kTargetsHelp);
        return targets_from_array(parsed, "peft_lora_target_modules");
    }
    DTUNE_CHECK_AS(UsageError, std::filesystem::is_regular_file(text), "peft_lora_target_modules = \"", text,
                   "\" is neither a JSON list nor an existing file; ", kTargetsHelp);
    parsed = nlohmann::json::parse(fs::read_file(text), nullptr, false);
    DTUNE_CHECK_AS(UsageError, !parsed.is_discarded() && parsed.is_array(), "peft_lora_target_modules file ",
                   text, " does not hold a JSON list; ", kTargetsHelp);
    return targets_from_array(parsed, str("peft_lora_target_modules file ", text));
}

models::LoRAConfig lora_config_from(const TrainConfig& config, const family::ModelFamily& family) {
    models::LoRAConfig c;
    c.rank = config.integer("lora_rank");
    c.alpha = config.opt_real("lora_alpha").value_or(0.0);  // None: alpha = rank
    c.dropout = config.real("lora_dropout");
    c.init = models::parse_lora_init(config.text("lora_init_type"));
    c.use_dora = config.flag("use_dora");
    c.target_modules =
        parse_lora_targets(config.raw("peft_lora_target_modules"), family.lora_targets(config));
    // The initial adapters follow the run's seed (like SimpleTuner's seeding before PEFT injection).
    if (auto seed = config.opt_integer("seed")) c.init_seed = static_cast<uint64_t>(*seed) ^ 0x4c6f5241ULL;
    DTUNE_CHECK_AS(UsageError, config.text("lora_type") == "standard", "lora_type ", config.text("lora_type"),
                   " is not implemented by dtune; use lora_type standard (PEFT-style LoRA/DoRA)");
    return c;
}

LoRATraining::LoRATraining(torch::nn::Module& model, const TrainConfig& config,
                           const family::ModelFamily& family)
    : adapters_(models::inject_lora(model, lora_config_from(config, family))),
      format_(models::parse_lora_format(config.text("lora_format"))),
      dropout_(config.real("lora_dropout") > 0),
      prefix_(family.denoiser_folder()) {
    const std::string init = config.text("init_lora");
    if (init.empty()) return;
    DTUNE_CHECK_AS(UsageError, std::filesystem::is_regular_file(init), "init_lora \"", init,
                   "\" is not a file; point it at a pytorch_lora_weights.safetensors (diffusers, PEFT or "
                   "ComfyUI/kohya keys) or leave it empty");
    const auto report = models::load_lora(adapters_, init);
    log::info() << "init_lora: started from " << init << " (" << report.modules_loaded << " modules, "
                << report.format << " keys)";
}

void LoRATraining::begin_forward(at::Generator& generator, bool on_device, int rank, int world_size) {
    if (cast_dtype_) adapters_.refresh_cast_factors(*cast_dtype_);
    if (!dropout_) return;
    if (on_device) {
        adapters_.draw_dropout_seed(rank, world_size);
        return;
    }
    uint64_t seed = 0;
    {
        std::lock_guard<std::mutex> lock(generator.mutex());
        seed = generator.get<at::CPUGeneratorImpl>()->random64();
    }
    adapters_.set_dropout_seed(seed, rank, world_size);
}

void LoRATraining::save(const std::filesystem::path& file) const {
    models::save_lora(adapters_, file, format_, std::nullopt, prefix_);
}

void LoRATraining::load_exact(const std::filesystem::path& file) {
    // The file's alphas are this run's (possibly float32-rounded for kohya's .alpha): keep ours.
    std::vector<double> alphas;
    for (const auto& e : adapters_.entries()) alphas.push_back(e.layer->alpha());
    models::load_lora(adapters_, file);
    for (std::size_t i = 0; i < alphas.size(); ++i) adapters_.entries()[i].layer->set_alpha(alphas[i]);
}

}  // namespace dtune::train
