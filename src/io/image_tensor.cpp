// RgbImage ⇄ tensor conversions and the decode/resize/crop/flip preparation of one sample.
#include "io/image_tensor.h"

#include <ATen/ATen.h>

#include "core/error.h"

namespace dtune::io {

at::Tensor to_tensor(const RgbImage& image) {
    auto hwc =
        at::from_blob(const_cast<uint8_t*>(image.pixels.data()), {image.height, image.width, 3}, at::kByte);
    // [H, W, 3] uint8 -> [3, H, W] float in [-1, 1]
    return hwc.permute({2, 0, 1}).to(at::kFloat).div_(127.5).sub_(1.0).contiguous();
}

RgbImage from_tensor(const at::Tensor& chw) {
    DTUNE_CHECK(chw.dim() == 3 && chw.size(0) == 3, "from_tensor expects [3, H, W], got ", chw.sizes());
    // [3, H, W] in [-1, 1] -> [H, W, 3] uint8
    auto hwc = chw.detach().to(at::kCPU, at::kFloat).add(1.0).mul(127.5).round().clamp(0, 255).to(at::kByte);
    hwc = hwc.permute({1, 2, 0}).contiguous();
    RgbImage out(static_cast<int>(chw.size(2)), static_cast<int>(chw.size(1)));
    std::memcpy(out.pixels.data(), hwc.data_ptr<uint8_t>(), out.pixels.size());
    return out;
}

namespace {

// Resize → crop → flip of a decoded (orientation-corrected) image; `name` goes into errors.
RgbImage finish_preparation(RgbImage image, const std::string& name, const PrepareSpec& spec) {
    if (image.width != spec.resize_width || image.height != spec.resize_height)
        image = resize_lanczos(image, spec.resize_width, spec.resize_height);
    if (spec.crop_width != image.width || spec.crop_height != image.height || spec.crop_top ||
        spec.crop_left) {
        try {
            image = crop(image, spec.crop_top, spec.crop_left, spec.crop_width, spec.crop_height);
        } catch (const DataError& e) {
            throw DataError(str(name, ": ", e.what()));
        }
    }
    if (spec.flip) image = flip_horizontal(image);
    return image;
}

// The pixel limit holds for the size the image is resized to as well as for the file itself: a
// 669-byte 100000x2 PNG passes the header check but its bucket asks for 3200000x64 (2.4 GB as
// floats). Checked before anything is read or decoded.
void check_resize_pixels(const std::string& name, const PrepareSpec& spec) {
    const int64_t pixels = static_cast<int64_t>(spec.resize_width) * spec.resize_height;
    const int64_t limit = max_image_pixels();
    if (limit > 0 && pixels > limit)
        throw DataError(
            str(name, ": its bucket resizes it to ", spec.resize_width, "x", spec.resize_height, " = ",
                pixels, " pixels, above the limit of ", limit,
                " (an extreme aspect ratio); the image is skipped. Crop it to a usual aspect "
                "ratio, set maximum_aspect_ratio, or raise DTUNE_MAX_IMAGE_PIXELS (0 = no limit)"));
}

DecodeOptions decode_options(const PrepareSpec& spec) {
    DecodeOptions options;
    options.min_width = spec.resize_width;
    options.min_height = spec.resize_height;
    return options;
}

}  // namespace

RgbImage prepare_image(const std::filesystem::path& path, const PrepareSpec& spec) {
    check_resize_pixels(path.string(), spec);
    return finish_preparation(read_image(path, decode_options(spec)), path.string(), spec);
}

RgbImage prepare_image_bytes(std::string_view bytes, const std::string& name, const PrepareSpec& spec) {
    check_resize_pixels(name, spec);
    return finish_preparation(decode_image(bytes, name, decode_options(spec)), name, spec);
}

at::Tensor prepare_image_tensor_bytes(std::string_view bytes, const std::string& name,
                                      const PrepareSpec& spec) {
    return to_tensor(prepare_image_bytes(bytes, name, spec));
}

at::Tensor prepare_image_tensor(const std::filesystem::path& path, const PrepareSpec& spec) {
    return to_tensor(prepare_image(path, spec));
}

}  // namespace dtune::io
