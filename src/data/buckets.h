// Aspect-ratio bucket math, as SimpleTuner computes it (SIMPLETUNER.md §3): the size calculators
// for `pixel` and `area` resolutions, the per-image plan (intermediary size, target size, crop
// coordinates, bucket), the first-seen aspect→resolution map, and the size filters.
//
// Invariants of a SamplePlan: target sides are multiples of the alignment (except when an
// aspect→resolution map pinned a size from a different alignment); intermediary and resize_size
// keep the original's aspect (up to integer truncation): an image is resized, never stretched;
// resize_size >= target_size on both sides, so the crop never leaves the image;
// crop_top + target.height <= resize_size.height and likewise for the width;
// bucket == round(target.w / target.h, rounding), forced 1.0 for square crops.
//
// Python semantics matter for exact shapes: round() is round-half-to-even and int() truncates;
// both are reproduced here (python_round, round_to_multiple).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <string>

#include "data/dataset_config.h"

namespace dtune::data {

struct Size {
    int width = 0;
    int height = 0;
    bool operator==(const Size&) const = default;
};

// Python's round(value, digits) for the doubles we meet (correctly rounded, ties to even).
double python_round(double value, int digits);
// Python's str(float): shortest round-trip text with ".0" for integral values ("1.0", "1.75").
std::string python_float_str(double value);
// SimpleTuner's _round_to_nearest_multiple: max(round(value / multiple) * multiple, multiple),
// with Python's half-to-even round.
int round_to_multiple(double value, int multiple);
// round(width / height, digits), the aspect of a size.
double aspect_of(Size size, int digits = 2);
// The text key a bucket has in SimpleTuner's JSON ("1.75", "1.0").
std::string bucket_key(double aspect);

// aspect (rounded, as text) → the first target size seen for it at one resolution. SimpleTuner
// persists it as output_dir/aspect_resolution_map-<MP>.json so bucket shapes never drift.
class AspectResolutionMap {
  public:
    explicit AspectResolutionMap(double megapixels = 0) : megapixels_(megapixels) {}
    std::optional<Size> get(double aspect) const;
    void set(double aspect, Size size);
    bool dirty() const { return dirty_; }
    size_t size() const { return sizes_.size(); }
    double megapixels() const { return megapixels_; }
    // "aspect_resolution_map-1.048576.json"
    static std::string file_name(double megapixels);
    // Loads the map if the file exists (a missing file is an empty map); DataError if unreadable.
    void load(const std::filesystem::path& dir);
    // Writes atomically when changed since the last load/save.
    void save(const std::filesystem::path& dir);

  private:
    double megapixels_;
    std::map<std::string, Size> sizes_;
    bool dirty_ = false;
};

struct SizeResult {
    Size target;        // what the image is cropped to
    Size intermediary;  // what the image is resized to first (keeps the original's exact aspect)
    double aspect = 1;  // round(target.w / target.h)
};

struct BucketMath {
    int alignment = 64;  // --aspect_bucket_alignment (SDXL forces 64)
    int rounding = 2;    // --aspect_bucket_rounding
};

// `pixel` resolution: the short side of the original becomes `resolution`.
SizeResult size_by_pixel_edge(double aspect, int resolution, Size original, const BucketMath& math = {});
// `area` resolution in megapixels. `map` (may be null) pins the first size seen per aspect.
SizeResult size_by_pixel_area(double aspect, double megapixels, Size original, const BucketMath& math = {},
                              AspectResolutionMap* map = nullptr);

// What the loader needs to prepare one image; persisted as the per-image metadata.
struct SamplePlan {
    Size original;
    Size intermediary;  // SimpleTuner's metadata value (SDXL's "original size" time id)
    Size resize_size;   // what the pixels are resized to before the crop (differs from intermediary
                        // only when maximum_image_size/target_downsample_size downsample first)
    Size target;
    int crop_top = 0;
    int crop_left = 0;
    double aspect = 1;  // the bucket
};

// The settings of one dataset that bucketing reads.
struct BucketSettings {
    ResolutionType resolution_type = ResolutionType::kArea;  // never kPixelArea (converted already)
    double resolution = 1.048576;
    bool crop = false;
    CropStyle crop_style = CropStyle::kRandom;
    CropAspect crop_aspect = CropAspect::kSquare;
    std::vector<CropAspectBucket> crop_aspect_buckets;
    std::optional<double> max_upscale_threshold;
    std::optional<double> minimum_image_size;
    std::optional<double> maximum_image_size;
    std::optional<double> target_downsample_size;
    std::optional<double> minimum_aspect_ratio;
    std::optional<double> maximum_aspect_ratio;
    BucketMath math;

    static BucketSettings from(const DatasetConfig& config, const BucketMath& math = {});
    // The pixel count of the resolution: for area the MP value, with 0.25/0.5/1/2/4 MP (±0.05)
    // snapped to 512²/768²/1024²/1536²/2048² (SimpleTuner's target_area); for pixel the edge.
    double target_area() const;
    // The edge of square crops: int(resolution) for pixel; for area sqrt(target_area()) rounded to
    // the alignment.
    int pixel_resolution() const;
};

// Computes the plan of one image (calculate_target_size + the crop). `rng` drives crop_aspect
// random and crop_style random. `map` may be null (no pinning).
SamplePlan plan_sample(const BucketSettings& settings, Size original, std::mt19937_64& rng,
                       AspectResolutionMap* map = nullptr);
// The crop_aspect closest/random choice alone (one draw from `rng` for random).
double choose_crop_aspect(const BucketSettings& settings, Size original, std::mt19937_64& rng);
// plan_sample with the crop aspect already chosen (crop_aspect closest/random): `rng` drives only
// the crop offsets. plan_sample(s, o, rng) == plan_sample_for_aspect(s, o, choose_crop_aspect(s, o,
// rng), rng) for those modes.
SamplePlan plan_sample_for_aspect(const BucketSettings& settings, Size original, double aspect,
                                  std::mt19937_64& rng, AspectResolutionMap* map = nullptr);

// SimpleTuner's meets_resolution_requirements on the original size. Returns empty when it passes,
// else the reason ("too small: 400x300 < minimum 512").
std::string resolution_filter_reason(const BucketSettings& settings, Size original);
// Whether a bucket survives the minimum/maximum_aspect_ratio filters.
bool bucket_in_aspect_range(const BucketSettings& settings, double bucket);

}  // namespace dtune::data
