// evaluation_type clip (SIMPLETUNER.md §9): the CLIP score of validation images against their
// prompts, as SimpleTuner's CLIPModelEvaluator computes it with torchmetrics' clip_score: the
// image (its 8-bit pixels as floats in [0, 255]) through CLIPImageProcessor's steps and the CLIP
// vision tower, the prompt through the tokenizer (77 tokens) and the text tower, both projected and
// normalised; score = max(100 · cos, 0). Per validation run each prompt (shortname) is scored on its
// last image, rounded to 4 decimals, and the run logs clip/min, clip/max, clip/mean and clip/std
// (population) over the prompts, as SimpleTuner's Validation.evaluate_images does.
//
// The model is pretrained_evaluation_model_name_or_path: a local transformers CLIPModel folder
// (config.json, model.safetensors, the tokenizer files), or a hub id found in the Hugging Face
// cache; dtune downloads nothing, and a hub id with no local copy is refused at start.
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "io/image.h"
#include "models/clip/clip_model.h"
#include "models/clip/clip_tokenizer.h"

namespace dtune::report {

// A local folder for `name_or_path`: the path itself when it is a folder, else the hub id's newest
// snapshot in the Hugging Face cache (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub). nullopt
// when neither exists.
std::optional<std::filesystem::path> find_hub_folder(const std::string& name_or_path);

class CLIPScorer {
  public:
    // Loads the model and tokenizer from `dir` (see the file comment); DataError naming it.
    CLIPScorer(const std::filesystem::path& dir, c10::Device device);
    // max(100 · cos(image, prompt), 0) for one image.
    double score(const io::RgbImage& image, const std::string& prompt);

  private:
    models::CLIPModel model_{nullptr};
    models::CLIPTokenizer tokenizer_;
    c10::Device device_;
};

// {"clip/min", "clip/max", "clip/mean", "clip/std"} over the per-prompt scores (empty: null).
nlohmann::json clip_stats(const std::map<std::string, double>& scores);

}  // namespace dtune::report
