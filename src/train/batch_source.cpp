// Synthetic and image-folder batch sources, and the placeholder text embedder (see batch_source.h).
#include "train/batch_source.h"

#include <cmath>

#include "core/error.h"
#include "core/log.h"
#include "data/captions.h"
#include "data/dataset_config.h"
#include "data/sampler.h"
#include "data/storage.h"
#include "io/image.h"
#include "io/image_tensor.h"

namespace dtune::train {

// ---- placeholder text embedder ----------------------------------------------------------------

HashedTextEmbedder::HashedTextEmbedder(int64_t tokens, int64_t dim, int64_t pooled_dim)
    : tokens_(tokens), dim_(dim), pooled_dim_(pooled_dim) {}

PromptEmbedding HashedTextEmbedder::encode(const std::string& caption) {
    at::Generator g = at::detail::createCPUGenerator(data::mix64(data::hash64(caption)) >> 1);
    PromptEmbedding e;
    e.prompt = at::randn({tokens_, dim_}, g, at::kFloat);  // [77, D]
    e.pooled = at::randn({pooled_dim_}, g, at::kFloat);    // [P]
    return e;
}

// ---- synthetic --------------------------------------------------------------------------------

SyntheticBatchSource::SyntheticBatchSource(SyntheticBatchOptions options) : options_(options) {}

TrainBatch SyntheticBatchSource::next(at::Generator& generator) {
    const auto& o = options_;
    const auto cpu = at::TensorOptions().dtype(at::kFloat);
    // Drawn for the global batch of world_size * B rows; this rank keeps rows [rank*B, (rank+1)*B).
    const int64_t rows = o.batch_size * o.world_size, lo = o.batch_size * o.rank, hi = lo + o.batch_size;
    auto draw = [&](std::vector<int64_t> shape) {
        shape.insert(shape.begin(), rows);
        return at::randn(shape, generator, at::kFloat).slice(0, lo, hi).to(o.device);
    };
    TrainBatch b;
    b.latents = draw({o.latent_channels, o.latent_size, o.latent_size});  // [B, C, h, w]
    b.prompt_embeds = draw({o.tokens, o.dim});                            // [B, 77, D]
    b.pooled_embeds = draw({o.pooled_dim});                               // [B, P]
    const double s = static_cast<double>(o.pixel_size);
    b.time_ids = at::tensor({s, s, 0.0, 0.0, s, s}, cpu).repeat({o.batch_size, 1}).to(o.device);  // [B, 6]
    for (int64_t i = lo; i < hi; ++i) {
        b.paths.push_back(str("synthetic:", served_, ":", i));
        b.captions.push_back(str("synthetic caption ", served_, ":", i));
    }
    ++served_;
    return b;
}

PromptEmbedding SyntheticBatchSource::empty_prompt() {
    return {at::zeros({options_.tokens, options_.dim}, at::kFloat),
            at::zeros({options_.pooled_dim}, at::kFloat)};
}

nlohmann::json SyntheticBatchSource::state() const {
    return {{"kind", "synthetic"}, {"served", served_}, {"batch_size", options_.batch_size}};
}

void SyntheticBatchSource::load_state(const nlohmann::json& state) {
    DTUNE_CHECK_AS(UsageError, state.value("kind", "") == "synthetic", "checkpoint batch state ",
                   state.dump(),
                   " is not a synthetic source's; resume with the data configuration it was written with");
    served_ = state.at("served").get<int64_t>();
}

// ---- image folder -----------------------------------------------------------------------------

namespace {

data::ResolutionType parse_resolution_type(const std::string& name) {
    if (name == "pixel") return data::ResolutionType::kPixel;
    if (name == "area") return data::ResolutionType::kArea;
    if (name == "pixel_area") return data::ResolutionType::kPixelArea;
    throw UsageError(str("resolution_type \"", name, "\" is not one of pixel, area, pixel_area"));
}

// The square edge in pixels for a dataset: pixel sizes as written, areas in megapixels as the
// side of that area snapped to the 64-pixel grid.
int square_edge(const data::DatasetConfig& d) {
    if (d.resolution_type_as_written == data::ResolutionType::kArea) {
        const double side = std::sqrt(d.resolution_as_written * 1e6);
        return std::max(64, static_cast<int>(std::lround(side / 64.0)) * 64);
    }
    return static_cast<int>(std::lround(d.resolution_as_written));
}

class ImageFolderSource final : public BatchSource {
  public:
    ImageFolderSource(const ImageFolderOptions& o, LatentEncoder encoder,
                      std::shared_ptr<TextEmbedder> embedder)
        : options_(o), encoder_(std::move(encoder)), embedder_(std::move(embedder)) {
        data::GlobalDataArgs args;
        args.output_dir = o.output_dir;
        args.resolution = o.resolution;
        args.resolution_type = parse_resolution_type(o.resolution_type);
        args.train_batch_size = o.batch_size;
        backends_ = data::load_data_backend_config(o.data_backend_config, args);
        for (const auto& w : backends_.warnings) log::warn() << o.data_backend_config.string() << ": " << w;
        for (const auto& d : backends_.datasets)
            if (d.dataset_type == data::DatasetType::kImage) {
                dataset_ = &d;
                break;
            }
        DTUNE_CHECK_AS(UsageError, dataset_, o.data_backend_config.string(),
                       " has no image dataset; add an entry with \"type\": \"local\" and instance_data_dir");
        DTUNE_CHECK_AS(UsageError, dataset_->type == data::StorageType::kLocal,
                       o.data_backend_config.string(), ": dataset ", dataset_->id,
                       " is not local; only local image folders are trained on for now");
        storage_ = data::make_storage(*dataset_);
        files_ = storage_->list_files(dataset_->instance_data_dir, {".png", ".jpg", ".jpeg", ".webp"});
        const int global_batch = o.batch_size * o.world_size;
        DTUNE_CHECK_AS(DataError, static_cast<int>(files_.size()) >= global_batch, "dataset ", dataset_->id,
                       " (", dataset_->instance_data_dir, ") has ", files_.size(),
                       " images, fewer than train_batch_size ", o.batch_size, " x ", o.world_size,
                       " rank(s); add images or lower train_batch_size");
        edge_ = square_edge(*dataset_);
        sampler_ = std::make_unique<data::BucketSampler>(
            std::map<std::string, std::vector<std::string>>{{"1.0", files_}}, global_batch, dataset_->repeats,
            o.seed, dataset_->id);
        log::info() << "dataset " << dataset_->id << ": " << files_.size() << " images at " << edge_ << "x"
                    << edge_ << ", latents encoded on the fly (vae_cache_disable)";
    }

    TrainBatch next(at::Generator& generator) override {
        auto batch = sampler_->next();
        while (!batch) {
            if (!sampler_->next_pass()) sampler_->begin_epoch(sampler_->state().epoch + 1);
            batch = sampler_->next();
        }
        TrainBatch b;
        std::vector<at::Tensor> images, prompts, pooled, time_ids;
        // The sampler serves the global batch; this rank loads rows [lo, hi) but draws the caption
        // choice of every row, so the generator advances as in one process.
        const size_t lo = static_cast<size_t>(options_.rank * options_.batch_size);
        const size_t hi = lo + static_cast<size_t>(options_.batch_size);
        for (size_t row = 0; row < batch->samples.size(); ++row) {
            const std::string& path = batch->samples[row];
            const auto captions = data::resolve_captions(*dataset_, *storage_, path);
            // Several captions: one chosen with the step's generator (deterministic on resume).
            const auto pick =
                at::randint(static_cast<int64_t>(captions.size()), {1}, generator).item<int64_t>();
            if (row < lo || row >= hi) continue;
            auto [image, ids] = load(path);
            images.push_back(image);
            time_ids.push_back(ids);
            const std::string& caption = captions[static_cast<size_t>(pick)];
            const PromptEmbedding e = embedder_->encode(caption);
            prompts.push_back(e.prompt);
            pooled.push_back(e.pooled);
            b.paths.push_back(path);
            b.captions.push_back(caption);
        }
        const at::Tensor pixels = at::stack(images).to(options_.device);  // [B, 3, H, W]
        b.latents = encoder_(pixels, generator);                          // [B, C, H/f, W/f]
        b.prompt_embeds = at::stack(prompts).to(options_.device);         // [B, 77, D]
        b.pooled_embeds = at::stack(pooled).to(options_.device);          // [B, P]
        b.time_ids = at::stack(time_ids).to(options_.device);             // [B, 6]
        return b;
    }

    int64_t batches_per_epoch() const override { return sampler_->batches_per_epoch(); }
    int64_t epoch() const override { return sampler_->state().epoch; }
    PromptEmbedding empty_prompt() override { return embedder_->encode(""); }

    nlohmann::json state() const override {
        return {{"kind", "image_folder"},
                {"dataset", dataset_->id},
                {"images", files_.size()},
                {"batch_size", options_.batch_size * options_.world_size},  // global micro-batch
                {"world_size", options_.world_size},
                {"sampler", sampler_->state().to_json()}};
    }

    void load_state(const nlohmann::json& s) override {
        DTUNE_CHECK_AS(UsageError,
                       s.value("kind", "") == "image_folder" && s.value("dataset", "") == dataset_->id,
                       "checkpoint batch state is for dataset ", s.value("dataset", "?"), ", not ",
                       dataset_->id, "; resume with the same multidatabackend.json");
        // The sampler's position is in global batches: any world size with the same global batch
        // (train_batch_size x ranks) resumes at the exact next samples.
        DTUNE_CHECK_AS(UsageError, s.at("batch_size").get<int>() == options_.batch_size * options_.world_size,
                       "the checkpoint was written with a global batch of ", s.at("batch_size").dump(),
                       " (train_batch_size x ranks), now ", options_.batch_size, " x ", options_.world_size,
                       "; resume with train_batch_size x number of processes equal to ",
                       s.at("batch_size").dump());
        sampler_->restore(data::SamplerState::from_json(s.at("sampler")));
    }

  private:
    // Shorter edge resized to the square's edge, then a centre crop. Time ids as SimpleTuner's SDXL
    // collate builds them: the intermediary (resized) size as the original size, the crop's top-left,
    // the target size.
    std::pair<at::Tensor, at::Tensor> load(const std::string& path) const {
        const io::RgbImage full = io::read_image(path);
        const double scale = static_cast<double>(edge_) / std::min(full.width, full.height);
        io::PrepareSpec spec;
        spec.resize_width = std::max(edge_, static_cast<int>(std::lround(full.width * scale)));
        spec.resize_height = std::max(edge_, static_cast<int>(std::lround(full.height * scale)));
        spec.crop_top = (spec.resize_height - edge_) / 2;
        spec.crop_left = (spec.resize_width - edge_) / 2;
        spec.crop_width = spec.crop_height = edge_;
        at::Tensor image = io::prepare_image_tensor(path, spec);  // [3, edge, edge]
        at::Tensor ids =
            at::tensor({double(spec.resize_height), double(spec.resize_width), double(spec.crop_top),
                        double(spec.crop_left), double(edge_), double(edge_)},
                       at::kFloat);  // [6]
        return {image, ids};
    }

    ImageFolderOptions options_;
    LatentEncoder encoder_;
    std::shared_ptr<TextEmbedder> embedder_;
    data::DataBackendConfig backends_;
    const data::DatasetConfig* dataset_ = nullptr;
    std::unique_ptr<data::StorageBackend> storage_;
    std::vector<std::string> files_;
    int edge_ = 0;
    std::unique_ptr<data::BucketSampler> sampler_;
};

}  // namespace

std::unique_ptr<BatchSource> make_image_folder_source(const ImageFolderOptions& options,
                                                      LatentEncoder encoder,
                                                      std::shared_ptr<TextEmbedder> embedder) {
    return std::make_unique<ImageFolderSource>(options, std::move(encoder), std::move(embedder));
}

}  // namespace dtune::train
