#!/usr/bin/env python3
"""Reference data for true classifier-free guidance on Flux in tests/validate/test_flux_pipeline.cpp:
diffusers' FluxPipeline on the tiny Flux pipeline (tools/ref/tiny_flux_pipeline.py) with
negative_prompt and true_cfg_scale > 1, i.e. two transformer passes per step,
noise = neg + true_cfg_scale * (pos - neg), on top of [dev]'s embedded guidance.

Writes tests/data/ref/flux_true_cfg_io.safetensors, for tiny_flux_pipeline.REQUEST (seed 0, 3 steps,
guidance 3.5) with negative_prompt "blurry, low quality" and true_cfg_scale 4.0:
  latents [1, 16, 6, 4]  the final latents (unpacked, still scaled and shifted)
  image   [1, 3, 48, 32] in [0, 1]
The same request with true_cfg_scale 1.0 is checked here to give the plain image (one pass; the
negative prompt is not used), as the test checks for dtune.

Usage: python3 tools/ref/gen_flux_true_cfg_ref.py <shared fixtures dir> [out_dir]   (default tests/data/ref)
"""
import os
import sys

from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_flux_pipeline  # noqa: E402

NEGATIVE = "blurry, low quality"
SCALE = 4.0


def main(fixtures, out):
    pipe = tiny_flux_pipeline.load(out, fixtures)
    _, plain = tiny_flux_pipeline.run(pipe)
    _, off = tiny_flux_pipeline.run(pipe, negative_prompt=NEGATIVE, true_cfg_scale=1.0)
    assert (off - plain).abs().max() == 0, "true_cfg_scale 1 must be the single-pass image"
    latents, image = tiny_flux_pipeline.run(pipe, negative_prompt=NEGATIVE, true_cfg_scale=SCALE)
    effect = float((image - plain).abs().max())
    assert effect > 0.005, effect
    save_file({"latents": latents, "image": image}, os.path.join(out, "flux_true_cfg_io.safetensors"))
    print("true CFG", SCALE, "changes the image by up to", effect)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "tests/data/ref")
