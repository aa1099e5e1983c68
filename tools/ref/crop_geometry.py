#!/usr/bin/env python3
"""Reference crop geometry for tests/data/test_crop_reference.cpp.

Runs SimpleTuner's own size calculators and TrainingSample preparation (multiaspect/image.py,
image_manipulation/training_sample.py and cropping.py at commit bc8e6ab) on a grid of image sizes
and dataset settings, and writes what they decide: the intermediary size (SDXL's original-size
time id), the size the pixels are resized to before the crop, the target (crop) size, the crop
offsets and the bucket. Nothing of SimpleTuner is copied here: the modules are imported from a
checkout whose path is given on the command line, with their heavy imports (torch, diffusers,
the trainingsample extension, SimpleTuner's global state) replaced by small stand-ins. The
samples are prepared from metadata only (no pixels), which takes the same size decisions.

Two small pieces are re-stated from SIMPLETUNER.md instead of imported, because their modules
pull in the whole trainer: the pixel_area conversion (factory.py `_handle_resolution_conversion`,
§3.1) and the minimum_image_size filter (metadata/backends/base.py
`meets_resolution_requirements`, §3.3).

Where SimpleTuner's geometry is unusable, dtune deviates, and the table says so per row (the
expected values are dtune's, SimpleTuner's are kept next to them):
  past_edge  the resize size is smaller than the crop on one side, so SimpleTuner would crop past
             the image edge; dtune scales the resize size up, keeping its aspect, until it covers
             the crop.
  squash     correct_intermediary_square_size resizes a non-square image to a square; dtune
             scales it up keeping its aspect instead.

Usage:
  git -C <SimpleTuner git dir> archive bc8e6ab simpletuner/helpers | tar -x -C /tmp/st
  python3 tools/ref/crop_geometry.py /tmp/st > tests/data/ref/crop_geometry.json
"""
import importlib
import json
import math
import random
import sys
import types

ALIGN = 64
ROUNDING = 2


class _State:
    """Stand-in for SimpleTuner's StateTracker: the args, the dataset config and the aspect map."""

    args = types.SimpleNamespace(aspect_bucket_alignment=ALIGN, aspect_bucket_rounding=ROUNDING)
    backend_config = {}
    aspect_resolution_map = {}

    @classmethod
    def get_args(cls):
        return cls.args

    @classmethod
    def get_model(cls):
        return None  # SDXL has no MAXIMUM_CANVAS_SIZE, so no model is needed

    @classmethod
    def get_data_backend_config(cls, _id):
        return cls.backend_config

    @classmethod
    def get_metadata_by_filepath(cls, *_):
        return None

    @classmethod
    def get_webhook_handler(cls):
        return None

    @classmethod
    def get_resolution_by_aspect(cls, dataloader_resolution, aspect):
        return cls.aspect_resolution_map.get(dataloader_resolution, {}).get(str(aspect))

    @classmethod
    def set_resolution_by_aspect(cls, dataloader_resolution, aspect, resolution):
        cls.aspect_resolution_map.setdefault(dataloader_resolution, {})[str(aspect)] = resolution


def _stub(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def load_simpletuner(root):
    for pkg in ("simpletuner", "simpletuner.helpers", "simpletuner.helpers.multiaspect",
                "simpletuner.helpers.image_manipulation", "simpletuner.helpers.training"):
        _stub(pkg).__path__ = [root + "/" + pkg.replace(".", "/")]
    _stub("trainingsample")
    _stub("torchvision", transforms=None)
    _stub("diffusers")
    _stub("diffusers.utils")
    _stub("diffusers.utils.export_utils", export_to_gif=None)
    _stub("simpletuner.helpers.training.multi_process", should_log=lambda: False)
    _stub("simpletuner.helpers.training.state_tracker", StateTracker=_State)
    _stub("simpletuner.helpers.image_manipulation.batched_training_samples", BatchedTrainingSamples=object)
    _stub("simpletuner.helpers.multiaspect.video", resize_video_frames=None)
    return importlib.import_module("simpletuner.helpers.image_manipulation.training_sample")


def convert_pixel_area(entry):
    """factory.py _handle_resolution_conversion (SIMPLETUNER.md §3.1), re-stated."""
    out = dict(entry)
    if out.get("resolution_type") == "pixel_area":
        out["resolution_type"] = "area"
        out["resolution"] = out["resolution"] * out["resolution"] / 1e6
        for key in ("maximum_image_size", "target_downsample_size", "minimum_image_size"):
            if out.get(key) is not None and out[key] > 0:
                out[key] = out[key] * out[key] / 1e6
    return out


def passes_minimum(cfg, w, h):
    """meets_resolution_requirements (SIMPLETUNER.md §3.3), re-stated."""
    low = cfg.get("minimum_image_size")
    if not low:
        return True
    if cfg["resolution_type"] == "pixel":
        return low <= w and low <= h
    if cfg.get("crop") and cfg.get("crop_aspect", "square") == "square":
        edge = math.floor(math.sqrt(low * 1e6))
        if not (edge <= w and edge <= h):
            return False
    return low * 1e6 <= w * h


def cover(size, target):
    """dtune's fix for both deviations: scale up keeping the aspect until target fits inside."""
    w, h = size
    tw, th = target
    if w >= tw and h >= th:
        return (w, h)
    if tw / w >= th / h:
        return (tw, max(th, int(h * tw / w)))
    return (max(tw, int(w * th / h)), th)


def crop_offsets(style, resized, target):
    if style == "corner":
        return (0, 0)
    return ((resized[1] - target[1]) // 2, (resized[0] - target[0]) // 2)


def prepare(ts_module, cfg, w, h, forced_aspect):
    """One TrainingSample.prepare() from metadata; returns SimpleTuner's sizes and dtune's."""
    seen = {}
    sample = ts_module.TrainingSample(None, "ref", image_metadata={"original_size": (w, h)})

    set_size = sample.cropper.set_intermediary_size

    def record_resize(width, height):
        seen["resize"] = (width, height)
        return set_size(width, height)

    sample.cropper.set_intermediary_size = record_resize
    squash = sample.correct_intermediary_square_size

    def record_square_fix():
        before = tuple(sample.intermediary_size)
        squash()
        if tuple(sample.intermediary_size) != before and w != h:
            seen["squashed_from"] = before
        return sample

    sample.correct_intermediary_square_size = record_square_fix
    if forced_aspect is not None:
        sample._select_random_aspect = lambda: forced_aspect
    prepared = sample.prepare()
    target = tuple(prepared.target_size)
    inter = tuple(int(v) for v in prepared.intermediary_size)
    resize = seen.get("resize", target)
    st = {"intermediary": inter, "resize": resize, "crop": tuple(prepared.crop_coordinates)}
    deviations = []
    downsampled = resize != inter
    if "squashed_from" in seen:
        deviations.append("squash")
        inter = cover(seen["squashed_from"], (sample.pixel_resolution, sample.pixel_resolution))
        if not downsampled:
            resize = inter
    if cover(resize, target) != resize:
        deviations.append("past_edge")
        resize = cover(resize, target)
        if not downsampled:
            inter = resize
    crop = tuple(prepared.crop_coordinates)
    if deviations:
        crop = crop_offsets(cfg.get("crop_style", "random"), resize, target)
    row = [w, h, forced_aspect, list(inter), list(resize), list(target), list(crop), prepared.aspect_ratio]
    if deviations:
        row.append({"deviation": deviations, "simpletuner": {k: list(v) for k, v in st.items()}})
    return row


def eligible_aspects(ts_module, w, h):
    """The crop_aspect random choices for one image (after max_upscale_threshold)."""
    sample = ts_module.TrainingSample(None, "ref", image_metadata={"original_size": (w, h)})
    return sample._trim_aspect_bucket_list()


def image_sizes():
    named = [(3000, 2000), (1344, 768), (2048, 512), (1920, 1080), (1080, 1920), (800, 1200), (1500, 1000),
             (1000, 1000), (1024, 1024), (600, 400), (400, 600), (512, 768), (768, 512), (5000, 1000),
             (1000, 5000), (1023, 1025), (4000, 3000), (3000, 4000), (1600, 900), (700, 700)]
    rng = random.Random(20261126)
    sizes = list(named)
    while len(sizes) < 90:
        w = rng.randint(300, 6000)
        h = max(200, int(w / math.exp(rng.uniform(math.log(0.25), math.log(4.0)))))
        sizes.append((w, h))
    return sizes


BUCKETS = [0.5, 0.75, 1.0, 1.33, 1.5, 2.0]
CONFIGS = [
    ("pixel_area, crop false", {"resolution": 1024, "resolution_type": "pixel_area", "crop": False,
                                "crop_style": "center"}),
    ("pixel_area, square", {"resolution": 1024, "resolution_type": "pixel_area", "crop": True,
                            "crop_aspect": "square", "crop_style": "center"}),
    ("pixel_area, square, corner", {"resolution": 1024, "resolution_type": "pixel_area", "crop": True,
                                    "crop_aspect": "square", "crop_style": "corner"}),
    ("pixel_area, preserve", {"resolution": 1024, "resolution_type": "pixel_area", "crop": True,
                              "crop_aspect": "preserve", "crop_style": "center"}),
    ("pixel_area, closest", {"resolution": 1024, "resolution_type": "pixel_area", "crop": True,
                             "crop_aspect": "closest", "crop_aspect_buckets": BUCKETS, "crop_style": "center"}),
    ("area 1.0, closest [1, 0.75, 1.23]", {"resolution": 1.0, "resolution_type": "area", "crop": True,
                                           "crop_aspect": "closest", "crop_aspect_buckets": [1.0, 0.75, 1.23],
                                           "crop_style": "center"}),
    ("pixel_area, random, threshold", {"resolution": 1024, "resolution_type": "pixel_area", "crop": True,
                                       "crop_aspect": "random", "crop_aspect_buckets": [0.75, 1.0, 1.5],
                                       "max_upscale_threshold": 0.2, "crop_style": "center"}),
    ("pixel 1024, crop false", {"resolution": 1024, "resolution_type": "pixel", "crop": False,
                                "crop_style": "center"}),
    ("pixel 1024, square", {"resolution": 1024, "resolution_type": "pixel", "crop": True,
                            "crop_aspect": "square", "crop_style": "center"}),
    ("pixel 1024, closest", {"resolution": 1024, "resolution_type": "pixel", "crop": True,
                             "crop_aspect": "closest", "crop_aspect_buckets": BUCKETS, "crop_style": "center"}),
    ("pixel 768, preserve", {"resolution": 768, "resolution_type": "pixel", "crop": True,
                             "crop_aspect": "preserve", "crop_style": "center"}),
    ("quickstart: area 1.0, square, downsample 1.0", {"resolution": 1.0, "resolution_type": "area", "crop": True,
                                                      "crop_aspect": "square", "crop_style": "center",
                                                      "minimum_image_size": 0.25, "maximum_image_size": 1.0,
                                                      "target_downsample_size": 1.0}),
    ("pixel_area, square, downsample 2048/1536", {"resolution": 1024, "resolution_type": "pixel_area",
                                                  "crop": True, "crop_aspect": "square", "crop_style": "center",
                                                  "maximum_image_size": 2048, "target_downsample_size": 1536}),
    ("pixel_area, closest, downsample 2048/1536", {"resolution": 1024, "resolution_type": "pixel_area",
                                                   "crop": True, "crop_aspect": "closest",
                                                   "crop_aspect_buckets": BUCKETS, "crop_style": "center",
                                                   "maximum_image_size": 2048, "target_downsample_size": 1536}),
    ("pixel 1024, square, downsample 2048/1536", {"resolution": 1024, "resolution_type": "pixel", "crop": True,
                                                  "crop_aspect": "square", "crop_style": "center",
                                                  "maximum_image_size": 2048, "target_downsample_size": 1536}),
    ("area 0.5, square", {"resolution": 0.5, "resolution_type": "area", "crop": True, "crop_aspect": "square",
                          "crop_style": "center"}),
    ("area 0.5, crop false", {"resolution": 0.5, "resolution_type": "area", "crop": False,
                              "crop_style": "center"}),
    ("pixel_area 768, minimum 0.5", {"resolution": 768, "resolution_type": "pixel_area", "crop": False,
                                     "crop_style": "center", "minimum_image_size": 0.5}),
    ("pixel_area, square, minimum 640", {"resolution": 1024, "resolution_type": "pixel_area", "crop": True,
                                         "crop_aspect": "square", "crop_style": "center",
                                         "minimum_image_size": 640}),
]


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: crop_geometry.py <SimpleTuner checkout holding simpletuner/helpers>")
    ts_module = load_simpletuner(sys.argv[1])
    out = {"simpletuner_commit": "bc8e6ab", "alignment": ALIGN, "rounding": ROUNDING,
           "columns": ["width", "height", "crop_aspect_choice", "intermediary", "resize", "target",
                       "crop_top_left", "bucket", "deviation (optional)"],
           "configs": []}
    for name, entry in CONFIGS:
        cfg = convert_pixel_area(entry)
        _State.backend_config = cfg
        _State.aspect_resolution_map = {}
        rows, filtered = [], []
        for w, h in image_sizes():
            if not passes_minimum(cfg, w, h):
                filtered.append([w, h])
                continue
            if cfg.get("crop_aspect") == "random":
                for aspect in eligible_aspects(ts_module, w, h) or [1.0]:
                    rows.append(prepare(ts_module, cfg, w, h, aspect))
            else:
                rows.append(prepare(ts_module, cfg, w, h, None))
        out["configs"].append({"name": name, "dataset": entry, "filtered": filtered, "rows": rows})
    json.dump(out, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
