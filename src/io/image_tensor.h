// RgbImage ⇄ at::Tensor, and the whole per-sample preparation (decode → resize → crop → flip →
// normalise) that feeds the VAE. Normalisation is ToTensor() + Normalize(0.5, 0.5): [-1, 1].
#pragma once

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <string>
#include <string_view>

#include "io/image.h"

namespace dtune::io {

// [3, H, W] float32 in [-1, 1].
at::Tensor to_tensor(const RgbImage& image);
// From a [3, H, W] float tensor in [-1, 1] (clamped), e.g. a decoded validation image.
RgbImage from_tensor(const at::Tensor& chw);

// Geometry of one sample, computed by the bucket plan (data layer).
struct PrepareSpec {
    int resize_width = 0;  // resize the decoded (orientation-corrected) image to this first
    int resize_height = 0;
    int crop_top = 0;
    int crop_left = 0;
    int crop_width = 0;
    int crop_height = 0;
    bool flip = false;
};

// Decodes and prepares; DataError naming the file when it is corrupt or unreadable, or when the
// resize size is above max_image_pixels() (checked before reading; callers skip the sample and
// list it in their report).
RgbImage prepare_image(const std::filesystem::path& path, const PrepareSpec& spec);
at::Tensor prepare_image_tensor(const std::filesystem::path& path, const PrepareSpec& spec);
// The same from the encoded bytes of an image read elsewhere (an S3 object); `name` goes into errors.
RgbImage prepare_image_bytes(std::string_view bytes, const std::string& name, const PrepareSpec& spec);
at::Tensor prepare_image_tensor_bytes(std::string_view bytes, const std::string& name,
                                      const PrepareSpec& spec);

}  // namespace dtune::io
