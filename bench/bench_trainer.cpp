// bench_trainer: the training step of `dtune train`, measured through the real Trainer, with
// synthetic batches in place of the dataset (issue #18: the bench drives the trainer, so the two
// cannot drift apart). The network is loaded as `dtune train` loads it (dtype, quantisation, the
// family's keys), every option is `dtune train`'s with SimpleTuner's default, and the loop is
// Trainer::run(): what differs is only where the batch comes from (random latents and embeddings of
// the family's shapes, drawn once and served in turn, so no host work per step).
// Usage (GPU machine):
//   bench_trainer --model_family flux|sdxl --pretrained_model_name_or_path DIR --output_dir DIR
//       [--res 1024] [any `dtune train` option, e.g. --model_type lora --lora_rank 16 ...]
// Prints one JSON line: the median ms/step over the second half of max_train_steps (from
// img_per_s in metrics.jsonl, as tools/gpu/flux_train.sh reads `dtune train`'s) and the peak GPU
// memory of the steps.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/log.h"
#include "train/batch_source.h"
#include "train/config.h"
#include "train/trainer.h"

namespace {

using namespace dtune;

nlohmann::json read_json(const std::filesystem::path& file) {
    std::ifstream in(file);
    DTUNE_CHECK_AS(DataError, in.good(), file.string(),
                   " is missing; bench_trainer reads the network's widths from it");
    return nlohmann::json::parse(in);
}

// The conditioning shapes `dtune train` feeds the family's network at `res` pixels (square), from
// the network's config.json: Flux packs 2×2 latent patches (in_channels / 4 latent channels), T5
// states of joint_attention_dim and the CLIP-L pooled vector; SDXL's UNet cross-attends to
// cross_attention_dim and adds the pooled text embedding to six 256-wide time-id embeddings.
train::SyntheticBatchOptions family_shapes(const train::TrainConfig& config, int64_t res) {
    train::SyntheticBatchOptions o;
    o.batch_size = config.integer("train_batch_size");
    o.latent_size = res / 8;
    o.pixel_size = res;
    o.distinct_batches = 4;
    const std::filesystem::path dir = config.text("pretrained_model_name_or_path");
    if (config.text("model_family") == "flux") {
        const auto c = read_json(dir / "transformer" / "config.json");
        o.latent_channels = c.at("in_channels").get<int64_t>() / 4;
        o.tokens = config.text("model_flavour") == "schnell" ? 256 : 512;  // T5 sequence length
        o.dim = c.at("joint_attention_dim").get<int64_t>();
        o.pooled_dim = c.at("pooled_projection_dim").get<int64_t>();
    } else {
        const auto c = read_json(dir / "unet" / "config.json");
        o.latent_channels = c.at("in_channels").get<int64_t>();
        o.dim = c.at("cross_attention_dim").get<int64_t>();
        o.pooled_dim = c.at("projection_class_embeddings_input_dim").get<int64_t>() - 6 * 256;
    }
    return o;
}

int run(int argc, char** argv) {
    int64_t res = 1024;
    std::vector<std::string> words;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--res" && i + 1 < argc) {
            res = std::stoll(argv[++i]);
        } else {
            words.push_back(a);
        }
    }
    train::TrainConfig config = train::TrainConfig::load({}, words);
    const std::filesystem::path out = config.text("output_dir");
    train::SyntheticBatchOptions shapes = family_shapes(config, res);
    // Where the trainer will train: the CPU when asked for or when there is no GPU (device auto).
    const bool cpu = config.text("device") == "cpu" || !at::hasCUDA();
    shapes.device = c10::Device(cpu ? c10::kCPU : c10::kCUDA);
    train::Trainer trainer(std::move(config), std::make_unique<train::SyntheticBatchSource>(shapes));
    const train::TrainResult result = trainer.run();

    std::vector<double> img_per_s;
    double peak = 0;
    std::ifstream metrics(out / "metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) {
        const auto row = nlohmann::json::parse(line, nullptr, false);
        if (!row.is_object() || !row.contains("loss") || !row.contains("img_per_s")) continue;
        img_per_s.push_back(row.at("img_per_s").get<double>());
        peak = std::max(peak, row.value("gpu_memory_gib", 0.0));
    }
    DTUNE_CHECK(!img_per_s.empty(), "no step rows in ", (out / "metrics.jsonl").string());
    std::vector<double> half(img_per_s.begin() + static_cast<std::ptrdiff_t>(img_per_s.size() / 2),
                             img_per_s.end());
    std::sort(half.begin(), half.end());
    const std::size_t n = half.size();
    const double median = n % 2 ? half[n / 2] : 0.5 * (half[n / 2 - 1] + half[n / 2]);
    const nlohmann::json line{{"bench", "trainer"},
                              {"steps", result.global_step},
                              {"batch", shapes.batch_size},
                              {"res", res},
                              {"ms_per_step_median", std::round(10000.0 * shapes.batch_size / median) / 10.0},
                              {"peak_gpu_gib", peak},
                              {"final_loss", result.last_loss}};
    std::printf("%s\n", line.dump().c_str());
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        return run(argc, argv);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_trainer: %s\n", e.what());
        return 1;
    }
}
