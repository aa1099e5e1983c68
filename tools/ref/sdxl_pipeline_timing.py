#!/usr/bin/env python3
"""diffusers' StableDiffusionXLPipeline on an SDXL folder, timed as a user runs it: the reference for
`dtune sample`'s wall time and load time (issue #18 item 6; tools/gpu/sdxl_sample.sh).

  sdxl_pipeline_timing.py FOLDER --out-dir DIR [--json FILE] [--steps 8] [--res 1024] [--seed 42]
      [--prompt TEXT] [--dtype bf16] [--device cuda] [--no-warm]

Times, in one process: `import_s` (Python start to diffusers imported), `load_s`
(StableDiffusionXLPipeline.from_pretrained(FOLDER, torch_dtype).to(device), synchronised),
`first_call_s` (pipe(...) to a PIL image, the first call with its kernel set-up), `png_s` (writing it),
`warm_call_s` (a second call), `total_s` (Python start to the first PNG written) and torch's peak GPU
memory. Euler, guidance 5, no negative prompt, as `dtune sample`'s defaults. Prints one JSON line and
appends it to --json.
"""
import argparse
import json
import os
import time

T_START = time.time()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--json")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--res", type=int, default=1024)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--prompt", default="a red fox in the snow, golden hour, highly detailed photograph")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-warm", action="store_true")
    a = p.parse_args()

    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    t_import = time.time()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    t0 = time.time()
    pipe = StableDiffusionXLPipeline.from_pretrained(a.folder, torch_dtype=dtype).to(a.device)
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    sync()
    t_load = time.time()

    def call():
        g = torch.Generator("cpu").manual_seed(a.seed)
        return pipe(a.prompt, num_inference_steps=a.steps, guidance_scale=5.0, width=a.res, height=a.res,
                    generator=g).images[0]

    image = call()
    sync()
    t_first = time.time()
    os.makedirs(a.out_dir, exist_ok=True)
    image.save(os.path.join(a.out_dir, "diffusers.png"))
    t_png = time.time()
    warm = None
    if not a.no_warm:
        w0 = time.time()
        call()
        sync()
        warm = time.time() - w0
    record = {"run": "diffusers", "dtype": a.dtype, "steps": a.steps, "res": a.res,
              "import_s": round(t_import - T_START, 3), "load_s": round(t_load - t0, 3),
              "first_call_s": round(t_first - t_load, 3), "png_s": round(t_png - t_first, 3),
              "total_s": round(t_png - T_START, 3), "load_plus_sample_s": round(t_first - t0, 3),
              "warm_call_s": round(warm, 3) if warm is not None else None,
              "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if a.device.startswith("cuda") else None}
    print(json.dumps(record), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
