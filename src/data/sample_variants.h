// Sample variants that change from draw to draw or epoch to epoch: random horizontal flips and
// `crop_aspect: random` re-bucketing (SIMPLETUNER.md §3, §4 epoch rollover). Torch-free.
//
// Flips: a draw is mirrored when the top bit of the loader's per-sample generator says so (the
// generator is seeded by seed, dataset, epoch, batch and position, see train/dataset_source.h), so
// a resumed run mirrors exactly what an uninterrupted one would. The pixels are cropped at the
// planned offsets and then mirrored; the SDXL crop coordinate becomes the crop's left edge in the
// mirrored resized image: resize_width - crop_left - crop_width (mirrored_crop_left). diffusers'
// SDXL script writes `x1 = image.width - x1` after cropping, i.e. crop_width - crop_left, which is
// not the mirrored offset; dtune uses the geometric one (see README, "random_flip").
//
// crop_aspect random: each epoch every image draws its aspect from crop_aspect_buckets (weighted
// when weights are given) with a generator seeded by (seed, dataset, path, epoch); the crop
// offsets come from a generator seeded by (seed, dataset, path, geometry), the geometry being the
// target and resize sizes the aspect leads to (two aspects can lead to one bucket with different
// resize sizes), so one image in one geometry is always the same crop and its cached latent,
// named by geometry_key, is reused across epochs. An epoch's buckets pass the filters the bucket
// index applies to its own draw: a bucket whose key is outside minimum/maximum_aspect_ratio is
// dropped (SIMPLETUNER.md §3.3), so the images drawn into it sit that epoch out and draw again the
// next; max_upscale_threshold already limits the draw itself (choose_crop_aspect).
// Invariants: every function here is pure (same inputs, same output, on every rank and machine);
// an image's epoch plan does not depend on which other images are in the dataset.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "data/buckets.h"

namespace dtune::data {

// Whether the dataset re-buckets every epoch (crop true and crop_aspect random).
bool rebuckets_per_epoch(const DatasetConfig& config);

// The SDXL crop-left coordinate of a mirrored draw: the crop's left edge in the mirrored image.
int mirrored_crop_left(const SamplePlan& plan);

// "<target w>x<h>_<resize w>x<h>": what names a crop_aspect-random cache entry (the crop offsets
// are a function of it, see above).
std::string geometry_key(const SamplePlan& plan);

// A 64-bit seed for one decision about one sample (path) in one epoch of one dataset.
uint64_t sample_epoch_seed(uint64_t seed, const std::string& dataset, const std::string& path, int64_t epoch);

// The plan of one image in `epoch` of a crop_aspect-random dataset (see the header comment).
// `indexed` is its bucket-index plan (for the original size); `pins` the aspect→size map the run
// loaded (copied per call, so the plan never depends on other images).
SamplePlan epoch_plan(const BucketSettings& settings, const SamplePlan& indexed, uint64_t seed,
                      const std::string& dataset, const std::string& path, int64_t epoch,
                      const AspectResolutionMap& pins);

struct EpochBuckets {
    std::map<std::string, std::vector<std::string>> buckets;  // bucket key → paths (sorted)
    std::map<std::string, SamplePlan> plans;                  // path → this epoch's plan (served paths)
    // Bucket key → paths drawn into a bucket outside minimum/maximum_aspect_ratio this epoch.
    std::map<std::string, std::vector<std::string>> dropped;
};

// Every image of `indexed` (path → index plan) planned for `epoch` and grouped by bucket, buckets
// outside minimum/maximum_aspect_ratio moved to `dropped`.
EpochBuckets rebucket_epoch(const BucketSettings& settings, const std::map<std::string, SamplePlan>& indexed,
                            uint64_t seed, const std::string& dataset, int64_t epoch,
                            const AspectResolutionMap& pins);

// The aspect→size map bucketing used for `config` (area resolutions pin sizes in output_dir;
// other resolution types have none): empty when there is no file.
AspectResolutionMap load_aspect_pins(const DatasetConfig& config, const std::string& output_dir);

}  // namespace dtune::data
