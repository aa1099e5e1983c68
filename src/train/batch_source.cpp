// The synthetic batch source (see batch_source.h).
#include "train/batch_source.h"

#include "core/error.h"

namespace dtune::train {

// ---- synthetic --------------------------------------------------------------------------------

SyntheticBatchSource::SyntheticBatchSource(SyntheticBatchOptions options) : options_(options) {}

TrainBatch SyntheticBatchSource::next(at::Generator& generator) {
    const auto& o = options_;
    const auto cpu = at::TensorOptions().dtype(at::kFloat);
    TrainBatch b;
    b.latents =
        at::randn({o.batch_size, o.latent_channels, o.latent_size, o.latent_size}, generator, at::kFloat)
            .to(o.device);
    b.prompt_embeds = at::randn({o.batch_size, o.tokens, o.dim}, generator, at::kFloat).to(o.device);
    b.pooled_embeds = at::randn({o.batch_size, o.pooled_dim}, generator, at::kFloat).to(o.device);
    const double s = static_cast<double>(o.pixel_size);
    b.time_ids = at::tensor({s, s, 0.0, 0.0, s, s}, cpu).repeat({o.batch_size, 1}).to(o.device);  // [B, 6]
    for (int64_t i = 0; i < o.batch_size; ++i) {
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

}  // namespace dtune::train
