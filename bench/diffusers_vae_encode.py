#!/usr/bin/env python3
"""Baseline for bench_vae_cache: diffusers' AutoencoderKL encode-only rate.

The same VAE config (random weights: the speed does not depend on the values), the same dtype,
batch size and resolution; images are random tensors already on the device, so this times the
encoder alone (no disk, no decoding): vae.encode(x).latent_dist.sample() * scaling_factor, as
SimpleTuner's VAE cache does per batch. Median of --steps timed batches after --warmup.

    DIFFUSERS_SRC=<diffusers src/ or unpacked wheel> python3 bench/diffusers_vae_encode.py \\
        --model shared/fixtures/sdxl-base-configs [--batch 8] [--res 1024] [--dtype bf16] [--device cuda]

Prints one JSON line: {"bench": "diffusers_vae_encode", "img_per_s": ..., "ms_batch_median": ...}.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.environ.get("DIFFUSERS_SRC", ""))
import torch  # noqa: E402
from diffusers import AutoencoderKL  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="SDXL folder (vae/config.json) or a VAE folder")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--res", type=int, default=1024)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    cfg_path = os.path.join(a.model, "vae", "config.json")
    if not os.path.exists(cfg_path):
        cfg_path = os.path.join(a.model, "config.json")
    with open(cfg_path) as f:
        config = json.load(f)
    torch.backends.cuda.matmul.allow_tf32 = True  # as the training baseline
    torch.backends.cudnn.allow_tf32 = True
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    vae = AutoencoderKL.from_config(config).to(a.device, dtype=dtype).eval()
    x = torch.rand(a.batch, 3, a.res, a.res, device=a.device, dtype=dtype) * 2 - 1
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    if a.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = []
    with torch.no_grad():
        for i in range(a.warmup + a.steps):
            t0 = time.perf_counter()
            latents = vae.encode(x).latent_dist.sample() * vae.config.scaling_factor
            sync()
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
    times.sort()
    med = times[len(times) // 2]
    out = dict(bench="diffusers_vae_encode", device=a.device, dtype=a.dtype, batch=a.batch, res=a.res,
               steps=a.steps, latents=list(latents.shape), ms_batch_median=1000 * med,
               ms_batch_min=1000 * times[0], img_per_s=a.batch / med,
               peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30 if a.device.startswith("cuda") else 0.0,
               torch=torch.__version__)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
