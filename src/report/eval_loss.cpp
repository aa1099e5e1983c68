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
#include "diffusion/training_sampling.h"
#include "family/data_encoders.h"
#include "family/model_family.h"
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

std::vector<double> flow_eval_timesteps(const diffusion::FlowMatchConfig& c, int64_t n,
                                        int64_t image_seq_len) {
    DTUNE_CHECK_AS(UsageError, n >= 1, "eval_timesteps ", n, " is invalid; use 1 or more");
    const double T = static_cast<double>(c.num_train_timesteps);
    // np.linspace(sigma_max·T, sigma_min·T, n) / T with sigma_max = 1. sigma_min is the scheduler's
    // last training sigma: float32 1/T with dynamic shifting; with a static shift that sigma is
    // already shifted, and SimpleTuner pins it back to 1/T (fix_flow_match_euler_schedule_bounds).
    const double lo = c.use_dynamic_shifting ? static_cast<double>(static_cast<float>(1.0 / T)) : 1.0 / T;
    std::optional<double> mu;
    if (c.use_dynamic_shifting) mu = diffusion::flow_match_mu(c, image_seq_len);
    std::vector<double> sigmas;
    const double step = n > 1 ? (lo * T - T) / static_cast<double>(n - 1) : 0.0;
    for (int64_t i = 0; i < n; ++i) {
        const double t = n > 1 && i == n - 1 ? lo * T : static_cast<double>(i) * step + T;
        sigmas.push_back(diffusion::flow_match_shift_sigma(c, t / T, mu));
    }
    if (c.shift_terminal) {
        const double scale = (1.0 - sigmas.back()) / (1.0 - *c.shift_terminal);
        for (double& v : sigmas) v = 1.0 - (1.0 - v) / scale;
    }
    std::vector<double> out;  // float32 sigmas, then timesteps = sigmas · T in float32 (diffusers)
    for (const double v : sigmas) {
        const float sigma = c.invert_sigmas ? 1.0f - static_cast<float>(v) : static_cast<float>(v);
        out.push_back(static_cast<double>(sigma * static_cast<float>(T)));
    }
    return out;
}

double flow_eval_loss(family::Denoiser& model, const diffusion::FlowMatchConfig& scheduler,
                      const std::vector<EvalSample>& samples, int64_t num_timesteps) {
    DTUNE_CHECK(!samples.empty(), "flow_eval_loss needs samples");
    torch::nn::Module& net = model.module();
    const bool was_training = net.is_training();
    net.eval();
    c10::InferenceMode guard;
    const auto device = net.parameters().front().device();
    const auto T = static_cast<float>(scheduler.num_train_timesteps);
    double total = 0;
    int64_t count = 0;
    for (const auto& s : samples) {
        const at::Tensor x0 = s.latents.to(at::kCPU, at::kFloat);  // [1, C, h, w]
        const int64_t h = x0.size(2), w = x0.size(3);
        DTUNE_CHECK_AS(UsageError, h % 2 == 0 && w % 2 == 0, "eval latents of ", x0.sizes(),
                       " cannot be packed 2x2; give the eval dataset a resolution that is a multiple of 16");
        // One draw per image, reused at every timestep (SimpleTuner seeds 0 before each batch).
        at::Generator gen = at::detail::createCPUGenerator(0);
        const at::Tensor noise = at::randn(x0.sizes(), gen, at::kFloat);  // [1, C, h, w]
        const at::Tensor target = noise - x0;
        family::Conditioning cond;
        for (const auto& [name, c] : s.cond) cond[name] = c.to(device);
        for (const double t : flow_eval_timesteps(scheduler, num_timesteps, (h / 2) * (w / 2))) {
            const at::Tensor ts = at::full({1}, t, at::kFloat);
            const at::Tensor noisy = diffusion::flow_noisy_latents(x0, noise, ts / T);  // sigma = t / T
            const at::Tensor pred = model.forward(noisy.to(device), ts.to(device), cond);
            total += (pred.to(at::kCPU, at::kFloat) - target).pow(2).mean().item<double>();
            ++count;
        }
    }
    if (was_training) net.train();
    return total / static_cast<double>(count);
}

diffusion::FlowMatchConfig flow_eval_scheduler(const family::TrainingObjective& objective) {
    DTUNE_CHECK_AS(UsageError, objective.flow_scheduler.has_value(),
                   "eval loss of a flow-matching model takes its fixed sigmas from the model folder's "
                   "scheduler/scheduler_config.json (FlowMatchEulerDiscreteScheduler), and this folder has "
                   "none: add it, or set eval_loss_disable true");
    diffusion::FlowMatchConfig c = *objective.flow_scheduler;
    // flow_schedule_auto_shift: SimpleTuner zeroes flow_schedule_shift, so the folder's own shift
    // (and dynamic shifting) stay; otherwise the static training shift replaces the folder's.
    if (!objective.flow.auto_shift && objective.flow.shift && *objective.flow.shift > 0)
        c.shift = *objective.flow.shift;
    return c;
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
    const family::TrainingObjective& objective = trainer.objective();
    if (objective.flow_matching())
        flow_ = flow_eval_scheduler(objective);
    else
        schedule_.emplace(objective.ddpm("eval loss (eval datasets)"));
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
    if (schedule_)
        prediction_ =
            config.is_null("prediction_type")
                ? schedule_->config().prediction_type
                : diffusion::parse_prediction_type(config.text("prediction_type"), "prediction_type");
    log::info() << "eval loss: " << samples_.size() << " image(s) x " << options_.num_timesteps
                << " timesteps";
}

double EvalLossCallback::evaluate(train::Trainer& trainer, int64_t step) {
    last_step_ = step;
    if (samples_.empty()) prepare(trainer);
    double loss = 0;
    if (flow_) {
        loss = flow_eval_loss(trainer.model(), *flow_, samples_, options_.num_timesteps);
    } else {
        const auto ts = trailing_timesteps(schedule_->num_train_timesteps(), options_.num_timesteps);
        loss = eval_loss(trainer.model(), *schedule_, prediction_, samples_, ts, trainer.step_options().loss);
    }
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
    if (options_.interval <= 0 || report.step % options_.interval != 0) return;
    const std::shared_ptr<void> whole_weights = trainer.whole_weights();  // zero_stage 3: every rank gathers
    if (trainer.is_main_process()) evaluate(trainer, report.step);
}

void EvalLossCallback::on_train_end(train::Trainer& trainer, const train::TrainResult& result) {
    // zero_stage 3 with a LoRA: the base is still sharded here, every rank gathers (else a no-op)
    const std::shared_ptr<void> whole_weights =
        result.outcome == train::TrainOutcome::kCompleted ? trainer.whole_weights() : nullptr;
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
