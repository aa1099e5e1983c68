#!/usr/bin/env python3
"""The diffusers side of issue #23's Flux LoRA comparison: one training step of FLUX.1-dev's
transformer (full-size config, random bf16 weights) with a PEFT LoRA, written as a diffusers/PEFT
training script writes it, on one GPU.

Per mode: LoRA r16 (alpha 16) on SimpleTuner's flux_lora_target "all" (the attention projections
of both stream kinds), adapters in float32 under bf16 autocast, fused AdamW, 1024² (4096 image
tokens), 512 T5 tokens, guidance embedded, flow-matching target (noise - latents) with an MSE loss,
gradient clipping at 1. Median of the steps after 2 warm-ups; peak memory from
torch.cuda.max_memory_allocated. Inputs are random tensors (the caches' shapes), so this times the
step alone, as dtune's train run does once its caches exist.

Usage (GPU machine, diffusers importable): diffusers_flux_baseline.py [--modes lora1,lora1gc]
  [--steps 8] [--compile]; prints one JSON line per mode and a RESULT line.
"""
import argparse
import json
import time

import torch
from diffusers import FluxTransformer2DModel
from peft import LoraConfig

TARGETS = ["to_k", "to_q", "to_v", "add_k_proj", "add_q_proj", "add_v_proj", "to_out.0", "to_add_out"]
CONFIG = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
              num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
              axes_dims_rope=(16, 56, 56))


def step_inputs(dev):
    h = w = 64  # latent 128x128 packed 2x2
    ids = torch.zeros(h, w, 3, device=dev)
    ids[..., 1] += torch.arange(h, device=dev)[:, None]
    ids[..., 2] += torch.arange(w, device=dev)[None, :]
    return dict(
        latents=torch.randn(1, h * w, 64, device=dev, dtype=torch.bfloat16),
        noise=torch.randn(1, h * w, 64, device=dev, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, 512, 4096, device=dev, dtype=torch.bfloat16),
        pooled_projections=torch.randn(1, 768, device=dev, dtype=torch.bfloat16),
        img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(512, 3, device=dev))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="lora1,lora1gc")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--cudnn_sdp", action="store_true",
                   help="leave SDPA's cuDNN attention on (its backward hit an illegal memory access at "
                        "Flux's sizes with torch 2.11 on an H100, as it did for dtune on an H200)")
    args = p.parse_args()
    dev = "cuda"
    if not args.cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)  # SDPA then picks the flash kernel, as dtune does
    torch.backends.cuda.matmul.allow_tf32 = True
    results = {}
    for mode in args.modes.split(","):
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)  # build in bf16 directly: fp32 would not fit beside it
        with torch.device(dev):
            model = FluxTransformer2DModel(**CONFIG)
        torch.set_default_dtype(torch.float32)
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian", target_modules=TARGETS))
        for q in model.parameters():
            if q.requires_grad:
                q.data = q.data.float()
        params = [q for q in model.parameters() if q.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        if mode.endswith("gc"):
            model.enable_gradient_checkpointing()
        model.train()
        run = torch.compile(model) if args.compile else model
        x = step_inputs(dev)
        torch.cuda.reset_peak_memory_stats()
        times = []
        try:
            for _ in range(args.steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                sigma = torch.sigmoid(torch.randn(1, device=dev))
                noisy = (1 - sigma) * x["latents"] + sigma * x["noise"]
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = run(hidden_states=noisy, encoder_hidden_states=x["encoder_hidden_states"],
                               pooled_projections=x["pooled_projections"], timestep=sigma,
                               guidance=torch.ones(1, device=dev), img_ids=x["img_ids"], txt_ids=x["txt_ids"],
                               return_dict=False)[0]
                loss = torch.nn.functional.mse_loss(pred.float(), (x["noise"] - x["latents"]).float())
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            st = sorted(times[2:])
            results[mode] = dict(compile=args.compile, trainable=sum(q.numel() for q in params),
                                 ms_step_median=round(1000 * st[len(st) // 2], 1),
                                 peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
        except torch.OutOfMemoryError:
            results[mode] = dict(compile=args.compile, error="OOM")
        print(mode, json.dumps(results[mode]), flush=True)
        del model, run, opt, params
        torch.cuda.empty_cache()
    print("RESULT", json.dumps(results))


if __name__ == "__main__":
    main()
