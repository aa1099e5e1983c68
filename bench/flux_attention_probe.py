#!/usr/bin/env python3
"""Flux.1's joint attention alone (1 x 24 heads x 4608 tokens x 128, bf16) forward + backward under each
SDPA backend and input layout, each in its own process (a kernel fault poisons the CUDA context):
the question is whether cuDNN's attention, the fastest on Hopper, can run Flux's backward at all and
in which layout. Prints one JSON line per case. Usage (GPU machine): flux_attention_probe.py [--tokens 4608]
"""
import argparse
import json
import subprocess
import sys

CASE = r'''
import json, sys, time, torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
backend, layout, s = sys.argv[1], sys.argv[2], int(sys.argv[3])
garbage, strided_grad = "+garbage" in layout, "+strided" in layout
layout = layout.replace("+garbage", "").replace("+strided", "")
b, h, d = 1, 24, 128
torch.manual_seed(0)
if garbage:  # leave NaN bytes in the caching allocator's free blocks, as a training step does
    for mib in (64, 256, 1024, 4096):
        junk = torch.full((mib * 2**19,), float("nan"), device="cuda", dtype=torch.bfloat16)
        del junk
def make():
    if layout == "bshd":  # [B, S, H, D] transposed to [B, H, S, D], as Flux's projections give them
        return torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    return torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
q, k, v = make(), make(), make()
go = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
if layout == "bshd":
    go = go.transpose(1, 2).contiguous().transpose(1, 2)
if strided_grad:  # the gradient a single block's cat([attn, mlp]) hands back: rows 5x wider than the slice
    wide = torch.randn(b, s, 5 * h * d, device="cuda", dtype=torch.bfloat16)
    go = wide.narrow(2, 0, h * d).view(b, s, h, d).transpose(1, 2)
with sdpa_kernel(getattr(SDPBackend, backend)):
    ref = None
    for i in range(8):
        if i == 3:
            torch.cuda.synchronize(); t0 = time.perf_counter()
        out = F.scaled_dot_product_attention(q, k, v)
        gq, gk, gv = torch.autograd.grad(out, (q, k, v), go)
    torch.cuda.synchronize(); fb = (time.perf_counter() - t0) / 5 * 1000
    for i in range(8):
        if i == 3:
            torch.cuda.synchronize(); t0 = time.perf_counter()
        with torch.no_grad():
            out = F.scaled_dot_product_attention(q, k, v)
    torch.cuda.synchronize(); f = (time.perf_counter() - t0) / 5 * 1000
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    o2 = F.scaled_dot_product_attention(q, k, v)
    g2 = torch.autograd.grad(o2, (q,), go)[0]
flops = 4 * b * h * s * s * d
print(json.dumps({"backend": backend, "layout": sys.argv[2], "tokens": s, "fwd_ms": round(f, 2), "fwd_bwd_ms": round(fb, 2),
                  "fwd_tflops": round(flops / f / 1e9, 1), "bwd_tflops": round(2.5 * flops / (fb - f) / 1e9, 1),
                  "max_diff_out_vs_flash": (out.float() - o2.float()).abs().max().item(),
                  "max_diff_gq_vs_flash": (gq.float() - g2.float()).abs().max().item(),
                  "finite": bool(torch.isfinite(gq).all())}))
'''


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4608)
    p.add_argument("--cases", default="FLASH_ATTENTION:bhsd,FLASH_ATTENTION:bshd,CUDNN_ATTENTION:bhsd,"
                   "CUDNN_ATTENTION:bshd,EFFICIENT_ATTENTION:bhsd,EFFICIENT_ATTENTION:bshd",
                   help="backend:layout pairs; +garbage first leaves NaN-filled free blocks in the allocator "
                        "(uninitialised workspace reads show up then); +strided hands the backward an "
                        "output gradient whose rows are a slice of wider rows (a single block's cat)")
    args = p.parse_args()
    for case in args.cases.split(","):
        backend, layout = case.split(":")
        r = subprocess.run([sys.executable, "-c", CASE, backend, layout, str(args.tokens)],
                           capture_output=True, text=True, timeout=300)
        if r.returncode == 0:
            print(r.stdout.strip().splitlines()[-1], flush=True)
        else:
            err = (r.stderr.strip().splitlines() or ["?"])[-1][:300]
            print(json.dumps({"backend": backend, "layout": layout, "tokens": args.tokens, "rc": r.returncode,
                              "error": err}), flush=True)


if __name__ == "__main__":
    main()
