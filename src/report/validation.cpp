// Validation during training (see validation.h).
#include "report/validation.h"

#include <cmath>
#include <cstring>
#include <map>
#include <sstream>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "family/model_family.h"
#include "models/common/pipeline_folder.h"
#include "notify/webhooks.h"
#include "report/clip_score.h"
#include "report/html_report.h"
#include "train/trainer.h"

namespace dtune::report {

std::vector<std::pair<int, int>> parse_validation_resolution(const std::string& text) {
    std::vector<std::pair<int, int>> out;
    std::stringstream ss(text);
    std::string item;
    auto bad = [&](const std::string& why) {
        return UsageError(str("validation_resolution \"", text, "\": ", why,
                              "; use sizes like \"1024x1024,1280x768\" (multiples of 8) or one number"));
    };
    while (std::getline(ss, item, ',')) {
        item.erase(0, item.find_first_not_of(' '));
        item.erase(item.find_last_not_of(' ') + 1);
        if (item.empty()) continue;
        try {
            const auto x = item.find('x');
            int w = 0, h = 0;
            if (x != std::string::npos) {
                w = std::stoi(item.substr(0, x));
                h = std::stoi(item.substr(x + 1));
            } else {
                const double v = std::stod(item);
                // SimpleTuner reads values below 128 as megapixels.
                const int side = v < 128 ? static_cast<int>(std::lround(std::sqrt(v * 1e6) / 64.0)) * 64
                                         : static_cast<int>(v);
                w = h = side;
            }
            if (w <= 0 || h <= 0 || w % 8 || h % 8)
                throw bad(str("size ", w, "x", h, " is not a multiple of 8"));
            out.emplace_back(w, h);
        } catch (const std::invalid_argument&) {
            throw bad(str("\"", item, "\" is not a size"));
        }
    }
    if (out.empty()) throw bad("no size given");
    return out;
}

std::vector<ValidationPrompt> read_prompt_library(const std::filesystem::path& file) {
    const auto j = nlohmann::json::parse(fs::read_file(file), nullptr, false);
    DTUNE_CHECK_AS(UsageError, j.is_object(), "user_prompt_library ", file.string(),
                   " is not a JSON object; write it as {\"shortname\": \"prompt\", ...}");
    std::vector<ValidationPrompt> out;
    for (const auto& [name, v] : j.items()) {
        std::string prompt;
        if (v.is_string())
            prompt = v.get<std::string>();
        else if (v.is_object() && v.contains("prompt") && v.at("prompt").is_string())
            prompt = v.at("prompt").get<std::string>();
        else
            throw UsageError(str("user_prompt_library ", file.string(), ": entry \"", name,
                                 "\" is neither a prompt string nor {\"prompt\": \"...\"}"));
        std::string shortname = name;
        for (char& c : shortname)
            if (c == '/' || c == ' ') c = '_';  // the name becomes part of a file name
        out.push_back({shortname, prompt});
    }
    return out;
}

ValidationSettings validation_settings(const train::TrainConfig& config) {
    ValidationSettings s;
    if (config.flag("validation_disable")) return s;
    if (!config.text("validation_prompt").empty())
        s.prompts.push_back({"validation", config.text("validation_prompt")});
    if (!config.text("user_prompt_library").empty()) {
        auto lib = read_prompt_library(config.text("user_prompt_library"));
        s.prompts.insert(s.prompts.end(), lib.begin(), lib.end());
    }
    if (!config.is_null("validation_negative_prompt"))
        s.negative_prompt = config.text("validation_negative_prompt");
    s.resolutions = parse_validation_resolution(config.text("validation_resolution"));
    s.guidance = config.real("validation_guidance");
    s.guidance_rescale = config.real("validation_guidance_rescale");
    s.true_cfg = config.real("validation_guidance_real");
    s.true_cfg_start_step = config.integer("validation_no_cfg_until_timestep");
    s.steps = config.integer("validation_num_inference_steps");
    DTUNE_CHECK_AS(UsageError, s.steps >= 1, "validation_num_inference_steps ", s.steps,
                   " is invalid; use 1 or more");
    const auto seed = config.opt_integer("validation_seed");
    s.seed = static_cast<uint64_t>(seed ? *seed : config.integer("seed"));
    if (!config.is_null("validation_noise_scheduler")) s.sampler = config.text("validation_noise_scheduler");
    s.num_images = static_cast<int>(config.integer("num_validation_images"));
    DTUNE_CHECK_AS(UsageError, s.num_images >= 1, "num_validation_images ", s.num_images,
                   " is invalid; use 1 or more");
    s.interval = config.integer("validation_step_interval");
    if (const auto e = config.opt_integer("validation_epoch_interval"); e && *e > 0) s.epoch_interval = *e;
    s.benchmark = !config.flag("disable_benchmark");
    s.preview = config.flag("validation_preview");
    s.preview_steps = std::max<int64_t>(1, config.integer("validation_preview_steps"));
    s.preview_model = config.text("validation_preview_model");
    if (config.text("evaluation_type") == "clip" && s.prompts.empty()) {
        log::warn() << "evaluation_type clip scores validation images, and this run has no validation prompt "
                       "(validation_prompt or user_prompt_library): nothing is scored";
    } else if (config.text("evaluation_type") == "clip") {
        const std::string name = config.text("pretrained_evaluation_model_name_or_path");
        const auto dir = find_hub_folder(name);
        DTUNE_CHECK_AS(
            UsageError, dir.has_value(), "pretrained_evaluation_model_name_or_path \"", name,
            "\" is neither a local folder nor in the Hugging Face cache, and dtune downloads nothing; "
            "run `huggingface-cli download ",
            name,
            " --local-dir clip-eval` and set pretrained_evaluation_model_name_or_path to that folder "
            "(or evaluation_type none)");
        s.clip_model = *dir;
    }
    return s;
}

std::optional<std::filesystem::path> find_preview_model(const std::string& configured,
                                                        const family::ModelFamily& family, std::string& why) {
    namespace fsys = std::filesystem;
    if (!configured.empty()) {
        if (fsys::is_regular_file(fsys::path(configured) / "config.json")) return fsys::path(configured);
        why = str("validation_preview_model \"", configured,
                  "\" is not a diffusers AutoencoderTiny folder (no config.json there)");
        return std::nullopt;
    }
    const std::string id = family.preview_decoder_id();
    if (auto cached = find_hub_folder(id)) return cached;
    const std::string local = id.substr(id.find('/') + 1);
    why = str(id, " (SimpleTuner's ", family.name(),
              " preview decoder) is not in the Hugging Face cache; download it (huggingface-cli download ",
              id, " --local-dir ", local, ") and set validation_preview_model to that folder");
    return std::nullopt;
}

io::RgbImage preview_image(const at::Tensor& decoded) {
    // [-1, 1] -> [0, 1], clamped, x255 and truncated (SimpleTuner's .mul(255).byte()).
    const at::Tensor img = (decoded[0].to(at::kCPU, at::kFloat) / 2 + 0.5).clamp(0, 1).mul(255).to(at::kByte);
    const at::Tensor hwc = img.permute({1, 2, 0}).contiguous();  // [H, W, 3]
    io::RgbImage out(static_cast<int>(hwc.size(1)), static_cast<int>(hwc.size(0)));
    std::memcpy(out.row(0), hwc.data_ptr<uint8_t>(), static_cast<size_t>(hwc.numel()));
    return out;
}

ValidationCallback::ValidationCallback(ValidationSettings settings, std::filesystem::path model_dir)
    : settings_(std::move(settings)), model_dir_(std::move(model_dir)) {}

ValidationCallback::~ValidationCallback() = default;

void ValidationCallback::on_train_start(train::Trainer& trainer) {
    // The base model's images: only on a fresh start (after a resume the UNet is already trained).
    if (settings_.benchmark && trainer.global_step() == 0) run(trainer, 0);
}

void ValidationCallback::on_step_end(train::Trainer& trainer, const train::StepReport& report) {
    const bool by_step = settings_.interval > 0 && report.step % settings_.interval == 0;
    // report.epoch counts completed epochs: validate when it reaches a new multiple of the interval.
    const bool by_epoch = settings_.epoch_interval > 0 && last_epoch_ >= 0 && report.epoch > last_epoch_ &&
                          report.epoch % settings_.epoch_interval == 0;
    last_epoch_ = report.epoch;
    if (by_step || by_epoch) run(trainer, report.step);
}

void ValidationCallback::on_train_end(train::Trainer& trainer, const train::TrainResult& result) {
    if (result.outcome == train::TrainOutcome::kCompleted && last_step_ != result.global_step)
        run(trainer, result.global_step);
}

std::vector<std::filesystem::path> ValidationCallback::run(train::Trainer& trainer, int64_t step) {
    std::vector<std::filesystem::path> written;
    std::map<std::string, double> clip_scores;  // shortname -> score (evaluation_type clip)
    last_step_ = step;
    if (settings_.prompts.empty()) return written;
    // zero_stage 3: every rank helps gather the whole weights (this runs on every rank at the same
    // step); rank 0 samples with them. A no-op otherwise.
    const std::shared_ptr<void> whole_weights = trainer.whole_weights();
    if (!trainer.is_main_process()) return written;
    if (!pipeline_)  // shares the trainer's network, so it samples the live weights
        pipeline_ = trainer.model_family().load_sampler(model_dir_, trainer.model(), {trainer.device()});
    const auto dir = trainer.output_dir() / "validation_images";
    std::filesystem::create_directories(dir);
    torch::nn::Module& net = trainer.model().module();
    // With use_ema the EMA weights generate (as SimpleTuner validates); restored when this returns.
    const train::EMAWeightsGuard ema_weights = trainer.use_ema_weights();
    const bool was_training = net.is_training();
    net.eval();
    try {
        for (const auto& p : settings_.prompts) {
            for (const auto& [w, h] : settings_.resolutions) {
                validate::GenerationRequest r;
                r.prompt = {p.prompt};
                if (settings_.negative_prompt)
                    r.negative_prompt = std::vector<std::string>{*settings_.negative_prompt};
                r.width = w, r.height = h;
                r.steps = settings_.steps;
                r.guidance_scale = settings_.guidance;
                r.guidance_rescale = settings_.guidance_rescale;
                r.true_cfg_scale = settings_.true_cfg;
                r.true_cfg_start_step = settings_.true_cfg_start_step;
                r.sampler = settings_.sampler;
                r.seed = settings_.seed;
                r.num_images_per_prompt = settings_.num_images;
                if (settings_.preview && preview_ready(trainer)) {
                    r.on_latents = [&, w = w, h = h](const validate::StepLatents& s) {
                        const bool due = settings_.preview_steps <= 1 || s.step == 0 ||
                                         (s.step + 1) % settings_.preview_steps == 0;
                        if (due && !preview_failed_) send_preview(s, p, w, h);
                    };
                }
                const auto images = validate::to_rgb_images(pipeline_->generate(r).images);
                // evaluation_type clip: the prompt's score is its last image's (SimpleTuner's loop).
                if (!settings_.clip_model.empty() && !images.empty()) {
                    if (!clip_) clip_ = std::make_unique<CLIPScorer>(settings_.clip_model, trainer.device());
                    clip_scores[p.shortname] = std::round(clip_->score(images.back(), p.prompt) * 1e4) / 1e4;
                }
                for (size_t i = 0; i < images.size(); ++i) {
                    const auto path =
                        dir / validation_image_name(step, p.shortname, static_cast<int>(i), w, h);
                    io::write_image(path, images[i]);
                    written.push_back(path);
                    for (auto& sink : sinks_)
                        sink(step, p.shortname, static_cast<int>(i), str(w, "x", h), images[i]);
                }
            }
        }
    } catch (...) {
        if (was_training) net.train();
        throw;
    }
    if (was_training) net.train();
    log::info() << "validation at step " << step << ": " << written.size() << " image(s) in " << dir.string();
    if (const nlohmann::json stats = clip_stats(clip_scores); !stats.is_null()) {
        log::info() << "CLIP score at step " << step << ": mean " << stats.at("clip/mean").get<double>()
                    << " (min " << stats.at("clip/min").get<double>() << ", max "
                    << stats.at("clip/max").get<double>() << ") over " << clip_scores.size() << " prompt(s)";
        trainer.append_metrics_row(step, stats);
        if (notifier_) {
            nlohmann::json data = stats;
            data["step"] = step;
            notifier_->send(notify::notification(
                str("CLIP score at step ", step, ": mean ", stats.at("clip/mean").get<double>()), data));
        }
        for (auto& sink : scalar_sinks_)
            for (const auto& [tag, value] : stats.items()) sink(step, tag, value.get<double>());
    }
    return written;
}

bool ValidationCallback::preview_ready(train::Trainer& trainer) {
    if (preview_failed_) return false;
    if (preview_decoder_) return true;
    if (!notifier_) {
        log::warn() << "validation_preview is enabled but no webhook is configured; previews are disabled";
        preview_failed_ = true;
        return false;
    }
    std::string why;
    const family::ModelFamily& family = trainer.model_family();
    const auto folder = find_preview_model(settings_.preview_model, family, why);
    if (!folder) {
        log::warn() << "validation_preview: " << why << "; previews are off for this run";
        preview_failed_ = true;
        return false;
    }
    try {
        models::ComponentLoadOptions o;
        o.device = trainer.device();
        preview_decoder_ = models::load_autoencoder_tiny(*folder, o);
        // A decoder for another latent space (taesdxl's 4 channels on Flux's 16) cannot decode a
        // single step: say which one fits instead of failing at the first preview.
        const int64_t channels = (*preview_decoder_)->config().latent_channels;
        DTUNE_CHECK_AS(UsageError, channels == family.latent_channels(), folder->string(), " decodes ",
                       channels, "-channel latents and ", family.name(), " has ", family.latent_channels(),
                       "; use ", family.preview_decoder_id(),
                       " (or a copy of it) as validation_preview_model");
        log::info() << "validation_preview: decoding previews with " << folder->string() << " every "
                    << settings_.preview_steps << " sampler step(s)";
    } catch (const std::exception& e) {
        log::warn() << "validation_preview: could not load the tiny autoencoder " << folder->string() << ": "
                    << e.what() << "; previews are off for this run";
        preview_failed_ = true;
        preview_decoder_.reset();
    }
    return !preview_failed_;
}

void ValidationCallback::send_preview(const validate::StepLatents& s, const ValidationPrompt& p, int width,
                                      int height) {
    try {
        at::Tensor decoded;
        {
            c10::InferenceMode guard;
            const at::Tensor first = s.latents.narrow(0, 0, 1);  // SimpleTuner previews batch item 0
            decoded = (*preview_decoder_)->decode(first.to(first.device(), at::kFloat));
        }
        notify::PreviewFrame f;
        f.step = s.step;
        f.total_steps = s.total_steps;
        f.timestep = s.timestep;
        f.width = width;
        f.height = height;
        f.prompt = p.prompt;
        f.shortname = p.shortname;
        const io::RgbImage img = preview_image(decoded);
        notifier_->send(notify::validation_preview(
            f, notify::Image{str("preview_", p.shortname, "_", s.step + 1, ".png"), io::encode_png(img)}));
        ++previews_sent_;
    } catch (const std::exception& e) {
        log::warn() << "Disabling validation preview due to decode failure: " << e.what();
        preview_failed_ = true;
    }
}

}  // namespace dtune::report
