// Validation during training (SIMPLETUNER.md §9): every validation_step_interval steps, the live
// UNet (with any LoRA layers injected into it) generates images for each validation prompt and
// resolution, saved as output_dir/validation_images/step_<N>_<shortname>_<i>_<WxH>.png. At step 0
// (not on a resume) a base-model "benchmark" set is made unless disable_benchmark; a final set is
// made at the end of training.
//
// Invariants: validation draws only from its own CPU generator seeded by validation_seed (or the
// run's seed), runs under inference mode, and puts the UNet back in training mode afterwards, so
// a run with validation trains bit-identical weights to one without. Text encoders and the VAE
// are loaded from the model folder once, on the first validation. Rank 0 only.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "io/image.h"
#include "models/vae/autoencoder_tiny.h"
#include "train/callbacks.h"
#include "train/config.h"

namespace dtune::family {
class ImageSampler;
class ModelFamily;
}  // namespace dtune::family
namespace dtune::validate {
struct StepLatents;
}  // namespace dtune::validate
namespace dtune::notify {
class Notifier;
}

namespace dtune::report {

class CLIPScorer;

struct ValidationPrompt {
    std::string shortname;  // "validation" for validation_prompt; the library's key otherwise
    std::string prompt;
};

struct ValidationSettings {
    std::vector<ValidationPrompt> prompts;
    std::optional<std::string> negative_prompt;
    std::vector<std::pair<int, int>> resolutions;  // (width, height)
    double guidance = 7.5;
    double guidance_rescale = 0.0;
    // validation_guidance_real: Flux's true CFG with the negative prompt when > 1, from sampler step
    // validation_no_cfg_until_timestep on (SimpleTuner's pipeline); other families ignore it.
    double true_cfg = 1.0;
    int64_t true_cfg_start_step = 2;
    int64_t steps = 30;
    uint64_t seed = 0;
    std::string sampler = "ddim";  // SimpleTuner's SDXL default
    int num_images = 1;
    int64_t interval = 100;      // steps; <= 0 disables interval validation
    int64_t epoch_interval = 0;  // validation_epoch_interval: after every N completed epochs (0: off)
    bool benchmark = true;       // base-model images at step 0
    // validation_preview: TAESD decodes of the sampler's latents, sent as validation.image
    // webhook events (raw targets) after the first step and every preview_steps steps after it.
    bool preview = false;
    int64_t preview_steps = 1;
    std::string preview_model;  // validation_preview_model: a diffusers AutoencoderTiny folder
    // evaluation_type clip: the CLIPModel folder (report/clip_score.h); empty: no scoring.
    std::filesystem::path clip_model;
};

// Where validation_preview's tiny autoencoder comes from: `configured` when set (a folder), else the
// family's (ModelFamily::preview_decoder_id: madebyollin/taesdxl for SDXL, madebyollin/taef1 for
// Flux) in the Hugging Face cache (HF_HUB_CACHE, HF_HOME/hub or ~/.cache/huggingface/hub). nullopt
// with `why` filled when there is none.
std::optional<std::filesystem::path> find_preview_model(const std::string& configured,
                                                        const family::ModelFamily& family, std::string& why);

// The preview PNG of latents [B, C, h, w] (item 0) through `decode` (-> [-1, 1] images), converted
// as SimpleTuner converts it: /2 + 0.5, clamped to [0, 1], x255 truncated to uint8.
io::RgbImage preview_image(const at::Tensor& decoded);

// "1024x1024,1280x768" -> sizes; a bare number N is NxN; values < 128 are megapixels (SimpleTuner),
// rounded to a square of side multiple of 64. UsageError naming validation_resolution otherwise.
std::vector<std::pair<int, int>> parse_validation_resolution(const std::string& text);
// user_prompt_library: a JSON object {shortname: prompt} (a prompt may also be {"prompt": ...}).
std::vector<ValidationPrompt> read_prompt_library(const std::filesystem::path& file);
// The settings from the config; no prompts means validation is off.
ValidationSettings validation_settings(const train::TrainConfig& config);

// Called with (step, shortname, index, "WxH", image) for every saved image (TensorBoard, webhooks).
using ValidationImageSink =
    std::function<void(int64_t, const std::string&, int, const std::string&, const io::RgbImage&)>;

class ValidationCallback final : public train::TrainCallback {
  public:
    ValidationCallback(ValidationSettings settings, std::filesystem::path model_dir);
    ~ValidationCallback() override;

    void add_sink(ValidationImageSink sink) { sinks_.push_back(std::move(sink)); }
    // Receives (step, tag, value) for scalars a validation run measures (clip/mean ...: TensorBoard).
    void add_scalar_sink(std::function<void(int64_t, const std::string&, double)> sink) {
        scalar_sinks_.push_back(std::move(sink));
    }
    // Where previews go (the run's webhooks); without one validation_preview is off, as in SimpleTuner.
    void set_notifier(std::shared_ptr<notify::Notifier> notifier) { notifier_ = std::move(notifier); }

    void on_train_start(train::Trainer& trainer) override;
    void on_step_end(train::Trainer& trainer, const train::StepReport& report) override;
    void on_train_end(train::Trainer& trainer, const train::TrainResult& result) override;

    // Generates and saves the images for `step` now; returns the files written.
    std::vector<std::filesystem::path> run(train::Trainer& trainer, int64_t step);
    int64_t previews_sent() const { return previews_sent_; }

  private:
    // Loads the tiny autoencoder on first use; false (previews off, one warning) when it cannot.
    bool preview_ready(train::Trainer& trainer);
    void send_preview(const validate::StepLatents& s, const ValidationPrompt& p, int width, int height);

    ValidationSettings settings_;
    std::filesystem::path model_dir_;
    std::unique_ptr<family::ImageSampler> pipeline_;  // the family's, around the trainer's network
    std::vector<ValidationImageSink> sinks_;
    std::shared_ptr<notify::Notifier> notifier_;
    std::vector<std::function<void(int64_t, const std::string&, double)>> scalar_sinks_;
    std::unique_ptr<CLIPScorer> clip_;
    std::optional<models::AutoencoderTiny> preview_decoder_;
    bool preview_failed_ = false;  // a load or decode failure turned previews off for the run
    int64_t previews_sent_ = 0;
    int64_t last_step_ = -1;
    int64_t last_epoch_ = -1;  // the epoch count after the previous step (-1: none seen yet)
};

}  // namespace dtune::report
