// Flip geometry and crop_aspect-random epoch plans (see sample_variants.h).
#include "data/sample_variants.h"

#include <random>

#include "data/sampler.h"

namespace dtune::data {

bool rebuckets_per_epoch(const DatasetConfig& config) {
    return config.crop && config.crop_aspect == CropAspect::kRandom;
}

int mirrored_crop_left(const SamplePlan& plan) {
    return plan.resize_size.width - plan.crop_left - plan.target.width;
}

std::string geometry_key(const SamplePlan& plan) {
    return std::to_string(plan.target.width) + "x" + std::to_string(plan.target.height) + "_" +
           std::to_string(plan.resize_size.width) + "x" + std::to_string(plan.resize_size.height);
}

uint64_t sample_epoch_seed(uint64_t seed, const std::string& dataset, const std::string& path,
                           int64_t epoch) {
    uint64_t s = mix64(seed ^ hash64(dataset));
    s = mix64(s ^ hash64(path));
    return mix64(s ^ static_cast<uint64_t>(epoch));
}

SamplePlan epoch_plan(const BucketSettings& settings, const SamplePlan& indexed, uint64_t seed,
                      const std::string& dataset, const std::string& path, int64_t epoch,
                      const AspectResolutionMap& pins) {
    std::mt19937_64 aspect_rng(sample_epoch_seed(seed, dataset, path, epoch));
    const double aspect = choose_crop_aspect(settings, indexed.original, aspect_rng);
    AspectResolutionMap local = pins;
    // The geometry (sizes) does not depend on the generator; plan once to learn it, then draw the
    // crop from a generator seeded by it, so one image in one geometry is always the same crop.
    std::mt19937_64 probe(0);
    const SamplePlan shape = plan_sample_for_aspect(settings, indexed.original, aspect, probe, &local);
    std::mt19937_64 crop_rng(mix64(sample_epoch_seed(seed, dataset, path, -1) ^ hash64(geometry_key(shape))));
    local = pins;
    return plan_sample_for_aspect(settings, indexed.original, aspect, crop_rng, &local);
}

EpochBuckets rebucket_epoch(const BucketSettings& settings, const std::map<std::string, SamplePlan>& indexed,
                            uint64_t seed, const std::string& dataset, int64_t epoch,
                            const AspectResolutionMap& pins) {
    EpochBuckets out;
    for (const auto& [path, plan] : indexed) {  // std::map: sorted, so every list is sorted too
        SamplePlan p = epoch_plan(settings, plan, seed, dataset, path, epoch, pins);
        const std::string key = bucket_key(p.aspect);
        // The same test as the bucket index's on the key's text, so both passes drop the same keys.
        if (!bucket_in_aspect_range(settings, std::stod(key))) {
            out.dropped[key].push_back(path);
            continue;
        }
        out.buckets[key].push_back(path);
        out.plans.emplace(path, p);
    }
    return out;
}

AspectResolutionMap load_aspect_pins(const DatasetConfig& config, const std::string& output_dir) {
    AspectResolutionMap pins(config.resolution);
    if (config.resolution_type == ResolutionType::kArea && !output_dir.empty()) pins.load(output_dir);
    return pins;
}

}  // namespace dtune::data
