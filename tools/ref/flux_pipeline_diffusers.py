#!/usr/bin/env python3
"""diffusers' FluxPipeline on a Flux folder, as the reference for `dtune sample` (issue #21's full-size
parity and timing runs: tools/gpu/flux_parity.sh), and the comparison of two images.

  flux_pipeline_diffusers.py compare FOLDER --out-dir DIR [--json FILE] [sampling options]
      float32, TF32 off for matmuls and cuDNN. The text encoders run first and are freed, then the
      transformer and the VAE go to the device (as `dtune sample` does, so FLUX.1-dev fits an 80 GB card:
      T5 19 GB, then the transformer 47.6 GB). The noise is FluxPipeline's own draw from
      torch.Generator().manual_seed(seed), which is dtune's (a float32 draw on the CPU). Writes
      diffusers_fp32.png (the reference), diffusers_fp32_cudnn_tf32.png (the same latents decoded with
      cuDNN's TF32 on, libtorch's default and so what dtune's VAE convolutions run with) and
      diffusers_fp32_latents.safetensors.
  flux_pipeline_diffusers.py timing FOLDER --out-dir DIR [--json FILE] [--dtype bf16] [sampling options]
      What a user runs: FluxPipeline.from_pretrained(FOLDER, torch_dtype=bf16).to(device), then
      pipe(prompt, ...) to a PIL image, timed apart (import, load, first call, PNG written, and a second,
      warm call unless --no-warm); peak memory from torch.cuda. FluxPipeline would draw the noise in the
      pipeline's dtype and dtune draws it in float32 and casts; to keep the comparison independent of
      how torch draws bf16 numbers, the noise is drawn as dtune draws it and passed as `latents`
      (on torch 2.13's CPU the two draws agree anyway). Writes diffusers_<dtype>.png.
  flux_pipeline_diffusers.py diff A.png B.png [--json FILE] [--tag NAME]
      mean and max absolute difference in 0-255 units, the share of values off by more than 1 and 4, PSNR.

Sampling options (defaults: FLUX.1-dev's): --prompt, --seed, --width, --height, --steps 28, --guidance 3.5,
--max-sequence-length 512, --device (cuda when there is one). --json appends one JSON line to FILE.
"""
import argparse
import gc
import json
import os
import sys
import time

T_START = time.time()  # before torch is imported: "import_s" counts it

import numpy as np  # noqa: E402


def append_json(path, record):
    print(json.dumps(record), flush=True)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def image_stats(pixels):
    p = pixels.astype(np.float64)
    return {"mean": round(float(p.mean()), 3), "std": round(float(p.std()), 3), "min": int(p.min()),
            "max": int(p.max())}


def diff(args):
    from PIL import Image

    a = np.asarray(Image.open(args.a).convert("RGB")).astype(np.int16)
    b = np.asarray(Image.open(args.b).convert("RGB")).astype(np.int16)
    record = {"diff": args.tag, "a": args.a, "b": args.b}
    if a.shape != b.shape:
        record["error"] = f"shapes differ: {a.shape} vs {b.shape}"
    else:
        d = np.abs(a - b)
        mse = float((d.astype(np.float64) ** 2).mean())
        record.update({"shape": list(a.shape), "mean_abs_diff": round(float(d.mean()), 4), "max_abs_diff": int(d.max()),
                       "frac_gt1": round(float((d > 1).mean()), 6), "frac_gt4": round(float((d > 4).mean()), 6),
                       "psnr_db": round(10 * np.log10(255.0**2 / mse), 2) if mse > 0 else None,
                       "a_stats": image_stats(a), "b_stats": image_stats(b)})
        if args.max_mean is not None:
            record["pass"] = bool(record["mean_abs_diff"] <= args.max_mean)
    append_json(args.json, record)
    return 0 if record.get("pass", "error" not in record) else 1


def dtune_noise(torch, seed, height, width, channels=16):
    """dtune's initial latents: N(0, 1) [1, 16, 2*(H/16), 2*(W/16)] in float32 from a seeded CPU generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, channels, 2 * (height // 16), 2 * (width // 16), generator=g, dtype=torch.float32)


def sync(torch, device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def memory(torch, device):
    if not device.startswith("cuda"):
        return {}
    gib = 1024.0**3
    return {"max_allocated_gib": round(torch.cuda.max_memory_allocated() / gib, 2),
            "max_reserved_gib": round(torch.cuda.max_memory_reserved() / gib, 2)}


def load_to(cls, folder, dtype, dev, record, **parts):
    """The pipeline's given parts on `dev` through device_map (the weights go from the files to the device
    without a float32 copy in host memory); .to(dev) where this diffusers refuses that."""
    try:
        pipe = cls.from_pretrained(folder, torch_dtype=dtype, device_map=dev, **parts)
        record.setdefault("load_method", "device_map")
    except (ValueError, NotImplementedError, TypeError) as e:
        pipe = cls.from_pretrained(folder, torch_dtype=dtype, **parts).to(dev)
        record["load_method"] = f"to(): device_map refused ({e})"
    return pipe


def decode(pipe, torch, packed, height, width):
    """FluxPipeline.__call__'s decode, taken apart so the same latents can be decoded twice."""
    latents = pipe._unpack_latents(packed, height, width, pipe.vae_scale_factor)
    latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
    image = pipe.vae.decode(latents, return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type="pil")[0]


def compare(args):
    import torch
    from diffusers import FluxPipeline
    from safetensors.torch import save_file

    t_import = time.time()
    # The reference is plain float32: no TF32 anywhere (libtorch's defaults, which dtune keeps, are
    # matmul TF32 off and cuDNN TF32 on; the second decode below shows what the latter changes).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dtype, dev = torch.float32, args.device
    record = {"phase": "diffusers_compare", "dtype": "fp32", "device": dev, "torch": torch.__version__,
              "import_s": round(t_import - T_START, 2)}
    # 1. The prompt, with only the text encoders loaded.
    t0 = time.time()
    text = load_to(FluxPipeline, args.folder, dtype, dev, record, transformer=None, vae=None)
    sync(torch, dev)
    t1 = time.time()
    with torch.no_grad():
        prompt_embeds, pooled, _ = text.encode_prompt(args.prompt, prompt_2=None, device=dev,
                                                      max_sequence_length=args.max_sequence_length)
    sync(torch, dev)
    record.update(text_load_s=round(t1 - t0, 2), encode_s=round(time.time() - t1, 2),
                  prompt_embeds_rms=round(float(prompt_embeds.float().pow(2).mean().sqrt()), 5),
                  pooled_rms=round(float(pooled.float().pow(2).mean().sqrt()), 5))
    del text
    gc.collect()
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    # 2. Denoise with the transformer and the VAE.
    t0 = time.time()
    pipe = load_to(FluxPipeline, args.folder, dtype, dev, record, text_encoder=None, text_encoder_2=None,
                   tokenizer=None, tokenizer_2=None)
    sync(torch, dev)
    t1 = time.time()
    with torch.no_grad():
        packed = pipe(prompt_embeds=prompt_embeds, pooled_prompt_embeds=pooled, height=args.height, width=args.width,
                      num_inference_steps=args.steps, guidance_scale=args.guidance,
                      generator=torch.Generator().manual_seed(args.seed), output_type="latent").images
        sync(torch, dev)
        t2 = time.time()
        image = decode(pipe, torch, packed, args.height, args.width)
        sync(torch, dev)
        t3 = time.time()
        torch.backends.cudnn.allow_tf32 = True
        image_tf32 = decode(pipe, torch, packed, args.height, args.width)
        torch.backends.cudnn.allow_tf32 = False
    record.update(image_load_s=round(t1 - t0, 2), denoise_s=round(t2 - t1, 2), decode_s=round(t3 - t2, 2))
    os.makedirs(args.out_dir, exist_ok=True)
    png = os.path.join(args.out_dir, "diffusers_fp32.png")
    png_tf32 = os.path.join(args.out_dir, "diffusers_fp32_cudnn_tf32.png")
    image.save(png)
    image_tf32.save(png_tf32)
    latents = pipe._unpack_latents(packed, args.height, args.width, pipe.vae_scale_factor)
    save_file({"latents": latents.float().cpu().contiguous()},
              os.path.join(args.out_dir, "diffusers_fp32_latents.safetensors"))
    pixels = np.asarray(image)
    record.update(png=png, png_cudnn_tf32=png_tf32, latents_finite=bool(torch.isfinite(packed).all()),
                  latents_rms=round(float(packed.float().pow(2).mean().sqrt()), 5), image=image_stats(pixels),
                  image_nonconstant=bool(pixels.std() > 1.0), **memory(torch, dev),
                  wall_s=round(time.time() - T_START, 2))
    append_json(args.json, record)
    return 0 if record["latents_finite"] and record["image_nonconstant"] else 1


def timing(args):
    import torch
    from diffusers import FluxPipeline

    t_import = time.time()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    dev = args.device
    record = {"phase": "diffusers_timing", "dtype": args.dtype, "device": dev, "torch": torch.__version__,
              "import_s": round(t_import - T_START, 2)}
    t0 = time.time()
    pipe = FluxPipeline.from_pretrained(args.folder, torch_dtype=dtype).to(dev)
    sync(torch, dev)
    t1 = time.time()
    record["load_s"] = round(t1 - t0, 2)
    noise = dtune_noise(torch, args.seed, args.height, args.width)
    latents = pipe._pack_latents(noise, 1, noise.shape[1], noise.shape[2], noise.shape[3]).to(dev, dtype)
    call = dict(prompt=args.prompt, height=args.height, width=args.width, num_inference_steps=args.steps,
                guidance_scale=args.guidance, max_sequence_length=args.max_sequence_length, output_type="pil")
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    with torch.no_grad():
        image = pipe(latents=latents.clone(), **call).images[0]
    sync(torch, dev)
    t1 = time.time()
    os.makedirs(args.out_dir, exist_ok=True)
    png = os.path.join(args.out_dir, f"diffusers_{args.dtype}.png")
    image.save(png)
    record.update(sample_s=round(t1 - t0, 2), start_to_png_s=round(time.time() - T_START, 2), png=png,
                  **memory(torch, dev))
    if args.warm:
        t0 = time.time()
        with torch.no_grad():
            pipe(latents=latents.clone(), **call)
        sync(torch, dev)
        record["sample_warm_s"] = round(time.time() - t0, 2)
    pixels = np.asarray(image)
    record.update(image=image_stats(pixels), image_nonconstant=bool(pixels.std() > 1.0),
                  wall_s=round(time.time() - T_START, 2))
    append_json(args.json, record)
    return 0 if record["image_nonconstant"] else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("compare", "timing"):
        p = sub.add_parser(name)
        p.add_argument("folder")
        p.add_argument("--out-dir", required=True)
        p.add_argument("--json")
        p.add_argument("--prompt", default="a red fox in the snow, golden hour, highly detailed photograph")
        p.add_argument("--seed", type=int, default=42)
        p.add_argument("--width", type=int, default=1024)
        p.add_argument("--height", type=int, default=1024)
        p.add_argument("--steps", type=int, default=28)
        p.add_argument("--guidance", type=float, default=3.5)
        p.add_argument("--max-sequence-length", type=int, default=512)
        p.add_argument("--device", default=None)
        if name == "timing":
            p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16")
            p.add_argument("--no-warm", dest="warm", action="store_false", help="skip the second, warm call")
    p = sub.add_parser("diff")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--json")
    p.add_argument("--tag", default="")
    p.add_argument("--max-mean", type=float, help="exit 1 when the mean absolute difference is above this")
    args = ap.parse_args()
    if args.cmd == "diff":
        return diff(args)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return compare(args) if args.cmd == "compare" else timing(args)


if __name__ == "__main__":
    sys.exit(main())
