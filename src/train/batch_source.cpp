// The synthetic batch source (see batch_source.h).
#include "train/batch_source.h"

#include "core/error.h"

namespace dtune::train {

// ---- synthetic --------------------------------------------------------------------------------

SyntheticBatchSource::SyntheticBatchSource(SyntheticBatchOptions options) : options_(options) {}

TrainBatch SyntheticBatchSource::next(at::Generator& generator) {
    const int64_t n = options_.distinct_batches;
    if (n <= 0) return draw(generator);
    const auto i = static_cast<std::size_t>(served_ % n);
    if (i >= drawn_.size()) {
        drawn_.push_back(draw(generator));
        return drawn_.back();
    }
    ++served_;
    return drawn_[i];
}

TrainBatch SyntheticBatchSource::draw(at::Generator& generator) {
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
    b.cond["prompt_embeds"] = draw({o.tokens, o.dim});                    // [B, 77, D]
    b.cond["pooled_prompt_embeds"] = draw({o.pooled_dim});                // [B, P]
    const double s = static_cast<double>(o.pixel_size);
    b.cond["time_ids"] =
        at::tensor({s, s, 0.0, 0.0, s, s}, cpu).repeat({o.batch_size, 1}).to(o.device);  // [B, 6]
    for (int64_t i = lo; i < hi; ++i) {
        b.paths.push_back(str("synthetic:", served_, ":", i));
        b.captions.push_back(str("synthetic caption ", served_, ":", i));
    }
    ++served_;
    return b;
}

PromptEmbedding SyntheticBatchSource::empty_prompt() {
    return {{"prompt_embeds", at::zeros({options_.tokens, options_.dim}, at::kFloat)},
            {"pooled_prompt_embeds", at::zeros({options_.pooled_dim}, at::kFloat)}};
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

}  // namespace dtune::train
