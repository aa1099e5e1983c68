#!/usr/bin/env python3
"""Reference values for dtune's diffusion tests that the shared fixtures do not cover.

Run with a Python that has torch and diffusers (kept out of the C++ build):
    python tools/ref/gen_diffusion_ref.py tests/data/ref
Writes diffusion_ref.safetensors (small float32/int64 tensors) and diffusion_ref.json (the
scheduler configs each case used, so the C++ test builds its samplers from the same JSON).
Every random tensor comes from torch.Generator().manual_seed(...) on the CPU so the C++ side can
draw the same numbers from an at::Generator with the same seed.
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
import diffusers
from diffusers import (DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler,
                       EulerAncestralDiscreteScheduler, EulerDiscreteScheduler, UniPCMultistepScheduler)
from diffusers.guiders.guider_utils import rescale_noise_cfg

out_dir = sys.argv[1] if len(sys.argv) > 1 else "tests/data/ref"
T = {}
CFG = {"diffusers_version": diffusers.__version__, "torch_version": torch.__version__, "cases": {}}

SDXL = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
            prediction_type="epsilon", steps_offset=1, timestep_spacing="leading")
SHAPE = (1, 4, 2, 4)


def c(t):
    return t.detach().contiguous().clone()


def record(name, cls, cfg):
    sched = cls(**cfg)
    full = {k: v for k, v in dict(sched.config).items() if not k.startswith("_")}
    full["_class_name"] = cls.__name__
    CFG["cases"][name] = full
    return sched


# --- training schedules (DDPM betas)
for name, cfg in {
    "ddpm_linear": dict(num_train_timesteps=1000, beta_schedule="linear"),
    "ddpm_cos": dict(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2"),
    "ddpm_zsnr": dict(SDXL, rescale_betas_zero_snr=True, prediction_type="v_prediction"),
}.items():
    s = record(name, DDPMScheduler, cfg)
    # A strided subset (plus the last entry, where zero-SNR acts) keeps the file small.
    idx = torch.cat([torch.arange(0, 1000, 37), torch.tensor([998, 999])])
    T[f"{name}.index"] = c(idx)
    T[f"{name}.alphas_cumprod"] = c(s.alphas_cumprod[idx])

# --- timestep/sigma tables
def tables(name, cls, cfg, steps):
    s = record(name, cls, cfg)
    s.set_timesteps(steps)
    T[f"{name}.timesteps"] = c(s.timesteps)
    if hasattr(s, "sigmas") and s.sigmas is not None:
        T[f"{name}.sigmas"] = c(s.sigmas.float())
    if hasattr(s, "init_noise_sigma"):
        T[f"{name}.init_noise_sigma"] = torch.tensor([float(s.init_noise_sigma)])
    return s


tables("euler_trailing30", EulerDiscreteScheduler, dict(SDXL, timestep_spacing="trailing"), 30)
tables("euler_linspace25", EulerDiscreteScheduler, dict(SDXL, timestep_spacing="linspace"), 25)
tables("euler_karras20", EulerDiscreteScheduler, dict(SDXL, use_karras_sigmas=True), 20)
tables("euler_zsnr_trailing12", EulerDiscreteScheduler,
       dict(SDXL, timestep_spacing="trailing", rescale_betas_zero_snr=True, prediction_type="v_prediction"), 12)
tables("eulera_trailing10", EulerAncestralDiscreteScheduler, dict(SDXL, timestep_spacing="trailing"), 10)
tables("eulera_leading7", EulerAncestralDiscreteScheduler, dict(SDXL), 7)
tables("ddim_trailing10", DDIMScheduler, dict(SDXL, timestep_spacing="trailing"), 10)
tables("ddim_linspace9", DDIMScheduler, dict(SDXL, timestep_spacing="linspace"), 9)
tables("ddim_cos_leading8", DDIMScheduler, dict(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2",
                                                steps_offset=1), 8)
tables("dpm_linspace10", DPMSolverMultistepScheduler, dict(SDXL, timestep_spacing="linspace"), 10)
tables("dpm_leading20", DPMSolverMultistepScheduler, dict(SDXL), 20)
tables("dpm_trailing16", DPMSolverMultistepScheduler, dict(SDXL, timestep_spacing="trailing"), 16)
tables("dpm_karras25", DPMSolverMultistepScheduler, dict(SDXL, use_karras_sigmas=True), 25)
tables("unipc_linspace10", UniPCMultistepScheduler, dict(SDXL, timestep_spacing="linspace"), 10)
tables("unipc_trailing12", UniPCMultistepScheduler, dict(SDXL, timestep_spacing="trailing"), 12)
tables("unipc_karras15", UniPCMultistepScheduler, dict(SDXL, use_karras_sigmas=True), 15)


# --- whole sampling loops with a fixed sequence of model outputs
def loop(name, cls, cfg, steps, seed=None, **step_kw):
    s = tables(name, cls, cfg, steps)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SHAPE, generator=g) * float(s.init_noise_sigma)
    outs = torch.randn((steps,) + SHAPE, generator=g) * 0.5
    T[f"{name}.x0"] = c(x)
    T[f"{name}.model_outputs"] = c(outs)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    scaled = []
    for i, t in enumerate(s.timesteps):
        scaled.append(s.scale_model_input(x, t))
        kw = dict(step_kw, generator=gen) if cls is not UniPCMultistepScheduler else step_kw
        x = s.step(outs[i], t, x, **kw).prev_sample
    T[f"{name}.scaled_input_last"] = c(scaled[-1])
    T[f"{name}.final"] = c(x)
    CFG["cases"][name]["_seed"] = seed
    CFG["cases"][name]["_steps"] = steps
    CFG["cases"][name]["_step_kwargs"] = step_kw


loop("loop_euler_v", EulerDiscreteScheduler, dict(SDXL, prediction_type="v_prediction", timestep_spacing="trailing"), 6)
loop("loop_eulera", EulerAncestralDiscreteScheduler, dict(SDXL), 6, seed=77)
loop("loop_eulera_v", EulerAncestralDiscreteScheduler,
     dict(SDXL, prediction_type="v_prediction", timestep_spacing="trailing"), 5, seed=5)
loop("loop_ddim", DDIMScheduler, dict(SDXL, clip_sample=False, set_alpha_to_one=False), 6)
loop("loop_ddim_v_trailing", DDIMScheduler, dict(SDXL, prediction_type="v_prediction", timestep_spacing="trailing",
                                                  rescale_betas_zero_snr=True, clip_sample=False), 5)
loop("loop_ddim_eta", DDIMScheduler, dict(SDXL, clip_sample=False, set_alpha_to_one=False), 5, seed=9, eta=0.7)
loop("loop_ddim_clip", DDIMScheduler, dict(SDXL), 4)
loop("loop_dpm", DPMSolverMultistepScheduler, dict(SDXL), 8)
loop("loop_dpm_karras", DPMSolverMultistepScheduler, dict(SDXL, use_karras_sigmas=True), 12)
loop("loop_dpm_v_heun", DPMSolverMultistepScheduler,
     dict(SDXL, prediction_type="v_prediction", solver_type="heun", timestep_spacing="trailing"), 7)
loop("loop_unipc", UniPCMultistepScheduler, dict(SDXL), 8)
# bh1 with final_sigmas_type "zero" makes diffusers return NaN (B(h) = -inf times a literal 0 in the last,
# first-order step), so this case ends at sigma_min.
loop("loop_unipc_v_bh1", UniPCMultistepScheduler,
     dict(SDXL, prediction_type="v_prediction", solver_type="bh1", timestep_spacing="trailing",
          final_sigmas_type="sigma_min"), 6)
loop("loop_unipc_karras", UniPCMultistepScheduler, dict(SDXL, use_karras_sigmas=True), 16)

# --- guidance rescale
g = torch.Generator().manual_seed(99)
cond = torch.randn((2,) + SHAPE[1:], generator=g)
uncond = torch.randn((2,) + SHAPE[1:], generator=g)
guided = uncond + 6.0 * (cond - uncond)
T["cfg.cond"] = c(cond)
T["cfg.uncond"] = c(uncond)
T["cfg.guided_6"] = c(guided)
T["cfg.rescaled_6_0p7"] = c(rescale_noise_cfg(guided, cond, guidance_rescale=0.7))

os.makedirs(out_dir, exist_ok=True)
save_file(T, os.path.join(out_dir, "diffusion_ref.safetensors"))
with open(os.path.join(out_dir, "diffusion_ref.json"), "w") as f:
    json.dump(CFG, f, indent=1, default=str, sort_keys=True)
print(f"wrote {len(T)} tensors to {out_dir}")
