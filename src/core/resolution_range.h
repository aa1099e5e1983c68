// The training resolutions dtune accepts, shared by config.json's `resolution` fallback and every
// multidatabackend.json entry so both refuse the same values with the same words. Header-only.
//
// pixel and pixel_area give the edge in pixels, area gives megapixels (edge² / 1e6). Below one
// 64-pixel bucket step nothing survives the alignment (a 7-pixel target became an error about the
// first image); above 8192 pixels (67 megapixels) SDXL's VAE alone needs more memory than any GPU
// has, and the sizes derived from it overflow.
#pragma once

#include <iomanip>
#include <sstream>
#include <string>

#include "core/error.h"

namespace dtune {

inline constexpr double kMinResolutionEdge = 64;
inline constexpr double kMaxResolutionEdge = 8192;

// "" when `value` is a usable resolution for `resolution_type` ("pixel", "area" or "pixel_area"),
// else what is wrong and the allowed range, to follow "key = value".
inline std::string resolution_range_problem(double value, const std::string& resolution_type) {
    const bool area = resolution_type == "area";
    const double lo = area ? kMinResolutionEdge * kMinResolutionEdge / 1e6 : kMinResolutionEdge;
    const double hi = area ? kMaxResolutionEdge * kMaxResolutionEdge / 1e6 : kMaxResolutionEdge;
    if (value >= lo && value <= hi) return "";
    std::ostringstream range;
    range << std::setprecision(10) << lo << " to " << hi;
    return str("is outside the range resolution_type=", resolution_type, " allows: ", range.str(),
               area ? " megapixels (an edge of 64 to 8192 pixels, squared, / 1e6)"
                    : " pixels (the edge; for megapixels use resolution_type=area)");
}

}  // namespace dtune
