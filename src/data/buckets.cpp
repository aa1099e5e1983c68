// Bucket math. The formulas follow SimpleTuner's MultiaspectImage / TrainingSample at commit
// bc8e6ab (checked row by row against tests/data/ref/crop_geometry.json, written by
// tools/ref/crop_geometry.py from SimpleTuner's own code); the places where dtune deliberately
// differs are marked "Deviation" with the reason.
#include "data/buckets.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "core/fs.h"

namespace dtune::data {

double python_round(double value, int digits) {
    // glibc's printf rounds the exact binary value correctly with ties to even, which is what
    // CPython's round(x, n) does (it also works on the exact value).
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*f", digits, value);
    return std::strtod(buf, nullptr);
}

std::string python_float_str(double value) {
    char buf[64];
    auto [end, ec] = std::to_chars(buf, buf + sizeof buf, value);
    std::string s(buf, end);
    if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // 'n' covers inf/nan
    return s;
}

int round_to_multiple(double value, int multiple) {
    const double steps = std::nearbyint(value / multiple);  // default rounding mode: half to even
    const int rounded = static_cast<int>(steps) * multiple;
    return std::max(rounded, multiple);
}

double aspect_of(Size size, int digits) {
    return python_round(static_cast<double>(size.width) / size.height, digits);
}

std::string bucket_key(double aspect) {
    return python_float_str(aspect);
}

std::optional<Size> AspectResolutionMap::get(double aspect) const {
    auto it = sizes_.find(bucket_key(aspect));
    if (it == sizes_.end()) return std::nullopt;
    return it->second;
}

void AspectResolutionMap::set(double aspect, Size size) {
    sizes_[bucket_key(aspect)] = size;
    dirty_ = true;
}

std::string AspectResolutionMap::file_name(double megapixels) {
    return "aspect_resolution_map-" + python_float_str(megapixels) + ".json";
}

void AspectResolutionMap::load(const std::filesystem::path& dir) {
    const auto path = dir / file_name(megapixels_);
    sizes_.clear();
    dirty_ = false;
    if (!std::filesystem::exists(path)) return;
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(fs::read_file(path));
        for (auto it = j.begin(); it != j.end(); ++it)
            sizes_[it.key()] = Size{it.value().at(0).get<int>(), it.value().at(1).get<int>()};
    } catch (const nlohmann::json::exception& e) {
        throw DataError(str(path.string(), ": not a valid aspect resolution map (", e.what(),
                            "); delete it to rebuild (bucket shapes may then change)"));
    }
}

void AspectResolutionMap::save(const std::filesystem::path& dir) {
    if (!dirty_) return;
    nlohmann::json j = nlohmann::json::object();
    for (const auto& [key, size] : sizes_) j[key] = {size.width, size.height};
    std::filesystem::create_directories(dir);
    fs::write_file_atomic(dir / file_name(megapixels_), j.dump(2));
    dirty_ = false;
}

SizeResult size_by_pixel_edge(double aspect, int resolution, Size original, const BucketMath& math) {
    int w_target, h_target;
    if (original.width < original.height) {
        w_target = resolution;
        h_target = static_cast<int>(w_target / aspect);
    } else {
        h_target = resolution;
        w_target = static_cast<int>(h_target * aspect);
    }
    const Size target{round_to_multiple(w_target, math.alignment),
                      round_to_multiple(h_target, math.alignment)};
    // The intermediary keeps the image's exact (unrounded) aspect and covers the target: the side
    // that follows the resolution first, the other one if that leaves it short.
    const double raw = static_cast<double>(original.width) / original.height;
    Size inter;
    if (raw >= 1.0) {
        inter.height = std::max(target.height, h_target);
        inter.width = static_cast<int>(inter.height * raw);
        if (inter.width < target.width) {
            inter.width = target.width;
            inter.height = static_cast<int>(inter.width / raw);
        }
    } else {
        inter.width = std::max(target.width, w_target);
        inter.height = static_cast<int>(inter.width / raw);
        if (inter.height < target.height) {
            inter.height = target.height;
            inter.width = static_cast<int>(inter.height * raw);
        }
    }
    return {target, inter, aspect_of(target, math.rounding)};
}

SizeResult size_by_pixel_area(double aspect, double megapixels, Size original, const BucketMath& math,
                              AspectResolutionMap* map) {
    const int edge = round_to_multiple(static_cast<int>(std::sqrt(megapixels * 1e6)), math.alignment);
    if (aspect == 1.0 && original.width == original.height) return {{edge, edge}, {edge, edge}, 1.0};
    Size target{round_to_multiple(edge * std::sqrt(aspect), math.alignment),
                round_to_multiple(edge / std::sqrt(aspect), math.alignment)};
    // The intermediary keeps the image's exact (unrounded) aspect, whatever aspect the target has
    // (a crop_aspect bucket or 1.0 for square crops): the image is never stretched.
    const double raw = static_cast<double>(original.width) / original.height;
    Size inter = target.width < target.height ? Size{target.width, static_cast<int>(target.width / raw)}
                                              : Size{static_cast<int>(target.height * raw), target.height};
    const double bucket = aspect_of(target, math.rounding);
    if (map) {
        if (auto pinned = map->get(bucket))
            target = *pinned;
        else
            map->set(bucket, target);
    }
    if (target.width > inter.width || target.height > inter.height) {
        // SimpleTuner's growth: close the gap of the short side and grow the other one in proportion.
        int w_diff, h_diff;
        if (target.width > inter.width) {
            w_diff = target.width - inter.width;
            h_diff = static_cast<int>(w_diff / raw);
        } else {
            h_diff = target.height - inter.height;
            w_diff = static_cast<int>(h_diff * raw);
        }
        inter.width += w_diff;
        inter.height += h_diff;
    }
    // A pinned target from another image can still be larger on one side; plan_sample covers it.
    return {target, inter, bucket};
}

BucketSettings BucketSettings::from(const DatasetConfig& c, const BucketMath& math) {
    BucketSettings s;
    s.resolution_type = c.resolution_type;
    s.resolution = c.resolution;
    s.crop = c.crop;
    s.crop_style = c.crop_style;
    s.crop_aspect = c.crop_aspect;
    s.crop_aspect_buckets = c.crop_aspect_buckets;
    s.max_upscale_threshold = c.max_upscale_threshold;
    s.minimum_image_size = c.minimum_image_size;
    s.maximum_image_size = c.maximum_image_size;
    s.target_downsample_size = c.target_downsample_size;
    s.minimum_aspect_ratio = c.minimum_aspect_ratio;
    s.maximum_aspect_ratio = c.maximum_aspect_ratio;
    s.math = math;
    DTUNE_CHECK_AS(UsageError, s.resolution_type != ResolutionType::kPixelArea, "dataset '", c.id,
                   "': resolution_type pixel_area must be converted before bucketing");
    return s;
}

double BucketSettings::target_area() const {
    if (resolution_type == ResolutionType::kPixel) return resolution;
    const std::pair<double, double> snaps[] = {{0.25, 512.0 * 512},
                                               {0.5, 768.0 * 768},
                                               {1.0, 1024.0 * 1024},
                                               {2.0, 1536.0 * 1536},
                                               {4.0, 2048.0 * 2048}};
    for (const auto& [mp, pixels] : snaps)
        if (std::abs(resolution - mp) < 0.05) return pixels;
    return resolution * 1e6;
}

int BucketSettings::pixel_resolution() const {
    if (resolution_type == ResolutionType::kPixel) return static_cast<int>(resolution);
    return round_to_multiple(std::sqrt(target_area()), math.alignment);
}

namespace {

SizeResult run_calculator(const BucketSettings& s, double aspect, double resolution, Size original,
                          AspectResolutionMap* map) {
    if (s.resolution_type == ResolutionType::kPixel)
        return size_by_pixel_edge(aspect, static_cast<int>(resolution), original, s.math);
    return size_by_pixel_area(aspect, resolution, original, s.math, map);
}

// `size` scaled up, keeping its aspect, until `target` fits inside; unchanged when it already does.
Size cover(Size size, Size target) {
    if (size.width >= target.width && size.height >= target.height) return size;
    const double w = size.width, h = size.height;
    if (target.width / w >= target.height / h)
        return {target.width, std::max(target.height, static_cast<int>(h * target.width / w))};
    return {std::max(target.width, static_cast<int>(w * target.height / h)), target.height};
}

double select_crop_aspect(const BucketSettings& s, double image_aspect, Size original, std::mt19937_64& rng) {
    const auto& buckets = s.crop_aspect_buckets;
    DTUNE_CHECK_AS(UsageError, !buckets.empty(), "crop_aspect ", to_string(s.crop_aspect),
                   " needs crop_aspect_buckets; add a list such as [0.75, 1.0, 1.33]");
    if (s.crop_aspect == CropAspect::kClosest) {
        auto best = std::min_element(buckets.begin(), buckets.end(), [&](const auto& a, const auto& b) {
            return std::abs(a.aspect - image_aspect) < std::abs(b.aspect - image_aspect);
        });
        return best->aspect;
    }
    if (buckets.front().weight) {  // weighted random choice
        std::vector<double> weights;
        for (const auto& b : buckets) weights.push_back(*b.weight);
        std::discrete_distribution<size_t> pick(weights.begin(), weights.end());
        return buckets[pick(rng)].aspect;
    }
    std::vector<double> eligible;
    for (const auto& b : buckets) {
        if (!s.max_upscale_threshold) {
            eligible.push_back(b.aspect);
            continue;
        }
        const Size t = run_calculator(s, b.aspect, s.resolution, original, nullptr).target;
        const double limit = 1 + *s.max_upscale_threshold;
        if (t.width <= original.width * limit && t.height <= original.height * limit)
            eligible.push_back(b.aspect);
    }
    if (eligible.empty()) return 1.0;  // nothing fits: SimpleTuner falls back to a square crop
    return eligible[std::uniform_int_distribution<size_t>(0, eligible.size() - 1)(rng)];
}

// Crop offsets (top, left) of `target` inside `from` for a style.
std::pair<int, int> crop_offsets(CropStyle style, Size from, Size target, std::mt19937_64& rng) {
    const int max_left = std::max(0, from.width - target.width);
    const int max_top = std::max(0, from.height - target.height);
    switch (style) {
        case CropStyle::kCorner: return {0, 0};
        case CropStyle::kCenter: return {max_top / 2, max_left / 2};
        case CropStyle::kRandom: {
            // Deviation, kept on purpose: with crop=true SimpleTuner crops at a random place but
            // records the centre offsets (its crop helper does not return the offset it drew; its
            // comment calls the value an estimate), so SDXL's crop time id describes a crop that
            // was not taken. We record the offsets actually used. Matching would not buy parity:
            // SimpleTuner's random draw cannot be reproduced, so the pixels differ either way, and
            // only the label would become wrong. (crop=false random crops record the true offsets
            // in SimpleTuner too.) README "Dataset config" says so.
            const int left = max_left > 0 ? std::uniform_int_distribution<int>(0, max_left)(rng) : 0;
            const int top = max_top > 0 ? std::uniform_int_distribution<int>(0, max_top)(rng) : 0;
            return {top, left};
        }
    }
    return {0, 0};
}

// SimpleTuner's _should_resize_before_crop: with both keys set, every image whose size is not
// already the target resolution is resized to the downsample size first.
bool resizes_before_crop(const BucketSettings& s, Size original, Size target) {
    if (!s.crop || !s.maximum_image_size || !s.target_downsample_size) return false;
    if (s.resolution_type == ResolutionType::kPixel) {
        const int res = s.pixel_resolution();
        return original.width != res || original.height != res;
    }
    const double area = static_cast<double>(original.width) * original.height;
    return area != s.target_area() || original.width < target.width || original.height < target.height;
}

// The optional resize before the crop (maximum_image_size + target_downsample_size): the
// calculator's intermediary at target_downsample_size, raised on its short side to the target.
std::optional<Size> downsample_size(const BucketSettings& s, Size original, Size target) {
    if (!resizes_before_crop(s, original, target)) return std::nullopt;
    const double image_aspect = aspect_of(original, s.math.rounding);
    Size d = run_calculator(s, image_aspect, *s.target_downsample_size, original, nullptr).intermediary;
    if (d.width < target.width) {
        const double scale = static_cast<double>(target.width) / d.width;
        d = {target.width, static_cast<int>(d.height * scale)};
    } else if (d.height < target.height) {
        const double scale = static_cast<double>(target.height) / d.height;
        d = {static_cast<int>(d.width * scale), target.height};
    }
    return d;
}

// The crop-aspect path of plan_sample for a chosen aspect, up to (not including) the tail.
SamplePlan plan_head_for_aspect(const BucketSettings& s, Size original, double aspect,
                                AspectResolutionMap* map) {
    SamplePlan plan;
    plan.original = original;
    const SizeResult r = run_calculator(s, aspect, s.resolution, original, map);
    plan.target = r.target;
    plan.intermediary = r.intermediary;
    plan.aspect = aspect_of(plan.target, s.math.rounding);
    if (plan.aspect == 1.0) {
        const int pixel_res = s.pixel_resolution();
        plan.target = {pixel_res, pixel_res};
    }
    return plan;
}

// The shared tail: square-intermediary correction, the optional downsample, the crop offsets.
void finish_plan(const BucketSettings& s, SamplePlan& plan, std::mt19937_64& rng) {
    const int pixel_res = s.pixel_resolution();
    // SimpleTuner's correct_intermediary_square_size. Deviation: it resizes to pixel_res x pixel_res,
    // which squashes a non-square image (0.5 and 2.0 MP, whose square edge is rounded up past the
    // calculator's); we scale up keeping the aspect. Square images come out the same.
    if (plan.aspect == 1.0 && plan.intermediary.width < pixel_res)
        plan.intermediary = cover(plan.intermediary, {pixel_res, pixel_res});
    const std::optional<Size> downsampled = downsample_size(s, plan.original, plan.target);
    // Deviation: where the resize size is smaller than the crop on one side (the cases above, a
    // target_downsample_size below the resolution, a pinned bucket shape), SimpleTuner crops past
    // the image edge; we scale up keeping the aspect instead.
    plan.resize_size = cover(downsampled.value_or(plan.intermediary), plan.target);
    if (!downsampled) plan.intermediary = plan.resize_size;
    std::tie(plan.crop_top, plan.crop_left) = crop_offsets(s.crop_style, plan.resize_size, plan.target, rng);
}

}  // namespace

double choose_crop_aspect(const BucketSettings& s, Size original, std::mt19937_64& rng) {
    return select_crop_aspect(s, aspect_of(original, s.math.rounding), original, rng);
}

SamplePlan plan_sample_for_aspect(const BucketSettings& s, Size original, double aspect, std::mt19937_64& rng,
                                  AspectResolutionMap* map) {
    DTUNE_CHECK_AS(DataError, original.width > 0 && original.height > 0, "image size ", original.width, "x",
                   original.height, " is empty");
    SamplePlan plan = plan_head_for_aspect(s, original, aspect, map);
    finish_plan(s, plan, rng);
    return plan;
}

SamplePlan plan_sample(const BucketSettings& s, Size original, std::mt19937_64& rng,
                       AspectResolutionMap* map) {
    DTUNE_CHECK_AS(DataError, original.width > 0 && original.height > 0, "image size ", original.width, "x",
                   original.height, " is empty");
    SamplePlan plan;
    const int pixel_res = s.pixel_resolution();
    const double image_aspect = aspect_of(original, s.math.rounding);
    if (s.crop && s.crop_aspect == CropAspect::kSquare) {
        plan.original = original;
        plan.target = {pixel_res, pixel_res};
        // The calculator at aspect 1.0 keeps the image's aspect with its short side at the square's
        // edge: 3000x2000 -> 1536x1024, then a 1024x1024 crop.
        plan.intermediary = run_calculator(s, 1.0, s.resolution, original, map).intermediary;
        plan.aspect = 1.0;
    } else {
        double aspect = image_aspect;
        if (s.crop && (s.crop_aspect == CropAspect::kClosest || s.crop_aspect == CropAspect::kRandom))
            aspect = select_crop_aspect(s, image_aspect, original, rng);
        plan = plan_head_for_aspect(s, original, aspect, map);
    }
    finish_plan(s, plan, rng);
    return plan;
}

std::string resolution_filter_reason(const BucketSettings& s, Size original) {
    if (!s.minimum_image_size) return {};
    const double min = *s.minimum_image_size;
    if (s.resolution_type == ResolutionType::kPixel) {
        if (min <= original.width && min <= original.height) return {};
        return str("too small: ", original.width, "x", original.height,
                   " has a side under minimum_image_size ", min);
    }
    const double area = static_cast<double>(original.width) * original.height;
    if (min * 1e6 > area)
        return str("too small: ", original.width, "x", original.height, " is under minimum_image_size ", min,
                   " MP");
    if (s.crop && s.crop_aspect == CropAspect::kSquare) {
        const int edge = static_cast<int>(std::floor(std::sqrt(min * 1e6)));
        if (edge > original.width || edge > original.height)
            return str("too small: ", original.width, "x", original.height, " has a side under ", edge,
                       " px (square crop of minimum_image_size ", min, " MP)");
    }
    return {};
}

bool bucket_in_aspect_range(const BucketSettings& s, double bucket) {
    if (s.minimum_aspect_ratio && bucket < *s.minimum_aspect_ratio) return false;
    if (s.maximum_aspect_ratio && bucket > *s.maximum_aspect_ratio) return false;
    return true;
}

}  // namespace dtune::data
