// Eval loss (see eval_loss.h).
#include "report/eval_loss.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/InferenceMode.h>

#include <cmath>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "data/captions.h"
#include "data/dataset_config.h"
#include "data/storage.h"
#include "family/data_encoders.h"
#include "io/image.h"
#include "io/image_tensor.h"
#include "models/common/pipeline_folder.h"
#include "models/vae/autoencoder_kl.h"
#include "train/dataset_source.h"
#include "train/trainer.h"

namespace dtune::report {

std::vector<int64_t> trailing_timesteps(int64_t num_train_timesteps, int64_t n) {
    DTUNE_CHECK_AS(UsageError, n >= 1 && n <= num_train_timesteps, "eval_timesteps ", n,
                   " is invalid; use 1 to ", num_train_timesteps);
    std::vector<int64_t> out;
    const double ratio = static_cast<double>(num_train_timesteps) / static_cast<double>(n);
    // numpy's arange(T, 0, -ratio) then np.round (half to even, as std::nearbyint does).
    for (int64_t i = 0; i < n; ++i)
        out.push_back(
            static_cast<int64_t>(std::nearbyint(static_cast<double>(num_train_timesteps) - i * ratio)) - 1);
    return out;
}

double eval_loss(family::Denoiser& model, const diffusion::NoiseSchedule& schedule,
                 diffusion::PredictionType prediction, const std::vector<EvalSample>& samples,
                 const std::vector<int64_t>& timesteps, const diffusion::LossOptions& loss) {
    DTUNE_CHECK(!samples.empty() && !timesteps.empty(), "eval_loss needs samples and timesteps");
    torch::nn::Module& net = model.module();
    const bool was_training = net.is_training();
    net.eval();
    c10::InferenceMode guard;
    double total = 0;
    const auto device = net.parameters().front().device();
    for (const auto& s : samples) {
        for (const int64_t t : timesteps) {
            // SimpleTuner reseeds to 0 before every batch and timestep: the same noise each time.
            at::Generator gen = at::detail::createCPUGenerator(0);
            const at::Tensor noise = at::randn(s.latents.sizes(), gen, at::kFloat);  // [1, C, h, w]
            const at::Tensor ts = at::full({1}, t, at::kLong);
            const at::Tensor x0 = s.latents.to(at::kCPU, at::kFloat);
            const at::Tensor noisy = schedule.add_noise(x0, noise, ts);
            at::Tensor target = noise;
            if (prediction == diffusion::PredictionType::kVPrediction)
                target = schedule.velocity(x0, noise, ts);
            if (prediction == diffusion::PredictionType::kSample) target = x0;
            family::Conditioning cond;
            for (const auto& [name, c] : s.cond) cond[name] = c.to(device);
            const at::Tensor pred = model.forward(noisy.to(device), ts.to(device), cond);
            total += diffusion::diffusion_loss(pred.to(at::kCPU, at::kFloat), target, ts, prediction,
                                               &schedule, loss)
                         .item<double>();
        }
    }
    if (was_training) net.train();
    return total / static_cast<double>(samples.size() * timesteps.size());
}

EvalLossCallback::EvalLossCallback(Options options) : options_(std::move(options)) {}
EvalLossCallback::~EvalLossCallback() = default;

namespace {

int eval_edge(const data::DatasetConfig& d) {
    if (d.resolution_type_as_written == data::ResolutionType::kArea)
        return std::max(64,
                        static_cast<int>(std::lround(std::sqrt(d.resolution_as_written * 1e6) / 64.0)) * 64);
    return static_cast<int>(std::lround(d.resolution_as_written));
}

}  // namespace

// Loads the eval images (resized, centre-cropped squares), encodes them once with the model
// folder's VAE (posterior mean) and the family's text encoders (on the CPU, in float32), then frees
// the encoders.
void EvalLossCallback::prepare(train::Trainer& trainer) {
    const auto& config = trainer.config();
    // The same fallbacks as the training datasets (resolution, instance_prompt, caption_strategy...).
    data::GlobalDataArgs args = train::data_args_from_config(config);
    args.output_dir = trainer.output_dir().string();
    const auto backends = data::load_data_backend_config(options_.data_backend_config, args);
    const auto pf = models::PipelineFolder::open(options_.model_dir);
    const family::ModelFamily& fam = trainer.model_family();
    const diffusion::NoiseSchedule& schedule = trainer.objective().ddpm("eval loss (eval datasets)");
    family::DataEncoderOptions eo;
    eo.model_dir = options_.model_dir;
    eo.text_encoder_precision = family::text_encoder_precision_from(config);
    const data::DataEncoders encoders = fam.load_data_encoders(eo);
    auto vae = models::load_autoencoder_kl(pf.vae_path());
    vae->eval();
    c10::InferenceMode guard;
    for (const auto& d : backends.datasets) {
        if (d.dataset_type != data::DatasetType::kEval) continue;
        auto storage = data::make_storage(d);
        const auto files = storage->list_files(d.instance_data_dir, {".png", ".jpg", ".jpeg", ".webp"});
        const int edge = eval_edge(d);
        for (const auto& path : files) {
            if (static_cast<int64_t>(samples_.size()) >= options_.num_images) break;
            // Through the dataset's storage, so eval images in a bucket work as training images do;
            // the one read serves the size probe and the preparation (EXIF orientation applied).
            const std::string bytes = storage->read(path);
            const io::RgbImage probe = io::decode_image(bytes, path);
            const double scale = static_cast<double>(edge) / std::min(probe.width, probe.height);
            io::PrepareSpec spec;
            spec.resize_width = std::max(edge, static_cast<int>(std::lround(probe.width * scale)));
            spec.resize_height = std::max(edge, static_cast<int>(std::lround(probe.height * scale)));
            spec.crop_top = (spec.resize_height - edge) / 2;
            spec.crop_left = (spec.resize_width - edge) / 2;
            spec.crop_width = spec.crop_height = edge;
            const at::Tensor pixels =
                io::prepare_image_tensor_bytes(bytes, path, spec).unsqueeze(0);  // [1, 3, e, e]
            EvalSample s;
            s.latents = vae->scale_latents(vae->encode(pixels).mean);  // [1, C, e/f, e/f]
            const auto caption = data::resolve_captions(d, *storage, path).front();
            s.cond = encoders.text({caption});  // name → [1, ...]
            for (auto& [name, t] : s.cond)
                if (at::isFloatingType(t.scalar_type())) t = t.to(at::kFloat);
            if (encoders.sample_conditioning) {
                data::SamplePlan plan;
                plan.intermediary = plan.resize_size = {spec.resize_width, spec.resize_height};
                plan.target = {edge, edge};
                plan.crop_top = spec.crop_top;
                plan.crop_left = spec.crop_left;
                encoders.sample_conditioning(s.cond, {plan}, {false});
            }
            samples_.push_back(std::move(s));
        }
    }
    DTUNE_CHECK_AS(DataError, !samples_.empty(), options_.data_backend_config.string(),
                   ": the eval dataset has no readable images; add images or remove the eval entry");
    schedule_.emplace(schedule);
    prediction_ = config.is_null("prediction_type")
                      ? schedule_->config().prediction_type
                      : diffusion::parse_prediction_type(config.text("prediction_type"), "prediction_type");
    log::info() << "eval loss: " << samples_.size() << " image(s) x " << options_.num_timesteps
                << " timesteps";
}

double EvalLossCallback::evaluate(train::Trainer& trainer, int64_t step) {
    last_step_ = step;
    if (samples_.empty()) prepare(trainer);
    const auto ts = trailing_timesteps(schedule_->num_train_timesteps(), options_.num_timesteps);
    const double loss =
        eval_loss(trainer.model(), *schedule_, prediction_, samples_, ts, trainer.step_options().loss);
    if (!log_) log_ = std::make_unique<train::RunLog>(trainer.output_dir() / "eval.jsonl");
    log_->append({{"step", step},
                  {"eval_loss", loss},
                  {"images", samples_.size()},
                  {"timesteps", options_.num_timesteps}});
    if (sink_) sink_(step, loss);
    log::info() << "eval loss at step " << step << ": " << loss;
    return loss;
}

void EvalLossCallback::on_train_start(train::Trainer& trainer) {
    if (trainer.is_main_process())
        train::cut_log_after_step(trainer.output_dir() / "eval.jsonl", trainer.global_step());
}

void EvalLossCallback::on_step_end(train::Trainer& trainer, const train::StepReport& report) {
    if (trainer.is_main_process() && options_.interval > 0 && report.step % options_.interval == 0)
        evaluate(trainer, report.step);
}

void EvalLossCallback::on_train_end(train::Trainer& trainer, const train::TrainResult& result) {
    if (trainer.is_main_process() && result.outcome == train::TrainOutcome::kCompleted &&
        last_step_ != result.global_step)
        evaluate(trainer, result.global_step);
    if (log_) log_->finish();
}

void EvalLossCallback::on_error(train::Trainer&, const std::exception&) {
    if (log_) log_->finish_quietly();
}

std::shared_ptr<EvalLossCallback> make_eval_loss_callback(const train::TrainConfig& config) {
    if (config.flag("eval_loss_disable") || config.is_null("data_backend_config")) return nullptr;
    const std::filesystem::path file = config.text("data_backend_config");
    if (!std::filesystem::exists(file)) return nullptr;
    // Parsed as training parses it, so "disable": true and "disabled": "true" entries do not count
    // (a bad file stops here with the same message training would give).
    const auto backends = data::load_data_backend_config(file, train::data_args_from_config(config));
    bool has_eval = false;
    for (const auto& d : backends.datasets) has_eval |= d.dataset_type == data::DatasetType::kEval;
    if (!has_eval) return nullptr;
    EvalLossCallback::Options o;
    o.model_dir = config.text("pretrained_model_name_or_path");
    o.data_backend_config = file;
    const auto interval = config.opt_integer("eval_steps_interval");
    o.interval = interval ? *interval : config.integer("validation_step_interval");
    o.num_images = config.integer("num_eval_images");
    o.num_timesteps = config.integer("eval_timesteps");
    return std::make_shared<EvalLossCallback>(std::move(o));
}

}  // namespace dtune::report
