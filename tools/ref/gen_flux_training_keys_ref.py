#!/usr/bin/env python3
"""Reference data for SimpleTuner's Flux / flow-matching training keys in dtune
(tests/diffusion/test_flux_training_keys.cpp, tests/family/test_flux_training_keys.cpp).

Every expected value is computed here from SimpleTuner's formulas (read in bghira/SimpleTuner at
bc8e6ab: simpletuner/helpers/models/common.py `sample_flow_sigmas`, helpers/training/custom_schedule.py
`apply_flow_schedule_shift`, helpers/training/default_settings/safety_check.py, and
helpers/models/flux/model.py `_flux_guidance_scales` / `get_lora_target_layers`) with torch, scipy,
diffusers and peft; none comes from dtune.

Writes tests/data/ref/flux_training_keys_ref.json:
  sigma_cases: seeded draws of each sigma schedule. dtune draws from a CPU generator seeded like
    torch.manual_seed(seed), so the same torch kernels give the same numbers:
      logit-normal  sigmoid(scale * torch.randn(B)), then the shift
      uniform       torch.rand(B), then the shift
      beta          torch.distributions.Beta(a, b).sample((B,)), then the shift
    the shift: flow_schedule_auto_shift wins (SimpleTuner zeroes flow_schedule_shift when both are
    set), exp(mu) with diffusers' calculate_shift over the latent's (H/2)(W/2) tokens and the
    scheduler config's anchors; else the static shift when > 0; else none.
  beta_quantiles: scipy.stats.beta.ppf at fixed probabilities (for a many-draw distribution check).
  auto_shift: exp(calculate_shift(seq_len, ...)) for a few token counts.
  fast_schedule: SimpleTuner's flux_fast_schedule list ([1.0] * 7 + [0.75, 0.5, 0.25]).
  lora_targets: for each flux_lora_target, the module names peft's LoRA injection adapts in a tiny
    diffusers FluxTransformer2DModel (2 double blocks, 21 single blocks, so "tiny"'s block 20
    exists) given SimpleTuner's target list for that value.
and tests/data/ref/flux_masked_attention_io.safetensors: the tiny [dev] transformer
(tests/data/ref/tiny-flux-dev) on flux_transformer_io.safetensors' inputs with a T5 mask applied in
the joint attention as a boolean key mask ([text mask; ones for the image tokens], diffusers'
FluxAttnProcessor through joint_attention_kwargs["attention_mask"]):
  text_mask [2, 5] (1: a real token), masked_out [2, 12, 16].

Usage: python3 tools/ref/gen_flux_training_keys_ref.py [out_dir]      (default tests/data/ref)
"""
import json
import math
import os
import sys

import scipy.stats
import torch
from diffusers import FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from peft import LoraConfig, inject_adapter_in_model
from safetensors.torch import load_file, save_file

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "ref")

# tiny-flux-pipeline/scheduler/scheduler_config.json's anchors (FLUX.1's own values).
ANCHORS = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}


def shift_of(case):
    """The shift SimpleTuner applies (None: none), after safety_check zeroes a static shift that
    comes with auto shift."""
    static = case.get("shift")
    if case.get("auto_shift"):
        static = 0
        _, _, h, w = case["latent_shape"]
        mu = calculate_shift((h // 2) * (w // 2), ANCHORS["base_image_seq_len"], ANCHORS["max_image_seq_len"],
                             ANCHORS["base_shift"], ANCHORS["max_shift"])
        return math.exp(mu)
    if static is not None and static > 0:
        return float(static)
    return None


def draw(case):
    torch.manual_seed(case["seed"])
    n = case["n"]
    kind = case["schedule"]
    if kind == "logit-normal":
        sigmas = torch.sigmoid(case.get("sigmoid_scale", 1.0) * torch.randn((n,)))
    elif kind == "uniform":
        sigmas = torch.rand((n,))
    elif kind == "beta":
        sigmas = torch.distributions.Beta(case["alpha"], case["beta"]).sample((n,))
    else:
        raise ValueError(kind)
    shift = shift_of(case)
    if shift is not None:
        sigmas = (sigmas * shift) / (1 + (shift - 1) * sigmas)
    return sigmas


SIGMA_CASES = [
    {"name": "logit-normal, shift 3 (defaults)", "schedule": "logit-normal", "seed": 7, "n": 8, "shift": 3.0,
     "latent_shape": [8, 16, 64, 64]},
    {"name": "logit-normal, sigmoid scale 1.7, no shift", "schedule": "logit-normal", "seed": 11, "n": 6,
     "sigmoid_scale": 1.7, "shift": 0.0, "latent_shape": [6, 16, 64, 64]},
    {"name": "logit-normal, auto shift over shift 3 (64x64 latents)", "schedule": "logit-normal", "seed": 3,
     "n": 5, "shift": 3.0, "auto_shift": True, "latent_shape": [5, 16, 64, 64]},
    {"name": "logit-normal, auto shift (128x96 latents)", "schedule": "logit-normal", "seed": 4, "n": 4,
     "shift": None, "auto_shift": True, "latent_shape": [4, 16, 128, 96]},
    {"name": "uniform, shift 2.5", "schedule": "uniform", "seed": 5, "n": 7, "shift": 2.5,
     "latent_shape": [7, 16, 32, 32]},
    {"name": "beta(2, 2), shift 3", "schedule": "beta", "seed": 9, "n": 6, "alpha": 2.0, "beta": 2.0, "shift": 3.0,
     "latent_shape": [6, 16, 32, 32]},
    {"name": "beta(0.5, 3), no shift", "schedule": "beta", "seed": 13, "n": 9, "alpha": 0.5, "beta": 3.0,
     "shift": -1.0, "latent_shape": [9, 16, 32, 32]},
]

PROBS = [0.05, 0.25, 0.5, 0.75, 0.95]

# SimpleTuner's flux_lora_target lists (helpers/models/flux/model.py get_lora_target_layers, lora_type
# standard, no ControlNet); "mmdit" is not in its if-chain and gets DEFAULT_LORA_TARGET.
ST_LORA_TARGETS = {
    "mmdit": ["to_k", "to_q", "to_v", "to_out.0", "to_qkv"],
    "all": ["to_k", "to_q", "to_v", "to_qkv", "add_qkv_proj", "add_k_proj", "add_q_proj", "add_v_proj", "to_out.0",
            "to_add_out"],
    "context": ["add_k_proj", "add_q_proj", "add_v_proj", "add_qkv_proj", "to_add_out"],
    "context+ffs": ["add_k_proj", "add_q_proj", "add_v_proj", "add_qkv_proj", "to_add_out", "ff_context.net.0.proj",
                    "ff_context.net.2"],
    "all+ffs": ["to_k", "to_q", "to_v", "to_qkv", "add_qkv_proj", "add_k_proj", "add_q_proj", "add_v_proj", "to_out.0",
                "to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
                "proj_out"],
    "all+ffs+embedder": ["x_embedder", "to_k", "to_q", "to_v", "to_qkv", "add_qkv_proj", "to_out.0", "add_k_proj",
                         "add_q_proj", "add_v_proj", "to_add_out", "ff.net.0.proj", "ff.net.2",
                         "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out"],
    "ai-toolkit": ["to_q", "to_k", "to_qkv", "add_qkv_proj", "to_v", "add_q_proj", "add_k_proj", "add_v_proj",
                   "to_out.0", "to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                   "ff_context.net.2", "norm.linear", "norm1.linear", "norm1_context.linear", "proj_mlp", "proj_out"],
    "tiny": ["single_transformer_blocks.7.proj_out", "single_transformer_blocks.20.proj_out"],
    "nano": ["single_transformer_blocks.7.proj_out"],
}
LORA_MODEL = {"patch_size": 1, "in_channels": 16, "num_layers": 2, "num_single_layers": 21, "attention_head_dim": 8,
              "num_attention_heads": 2, "joint_attention_dim": 24, "pooled_projection_dim": 12,
              "guidance_embeds": True, "axes_dims_rope": [2, 2, 4]}


def adapted_modules(targets):
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**LORA_MODEL)
    model = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=targets), model)
    return sorted(name[: -len(".lora_A")] for name, _ in model.named_modules() if name.endswith(".lora_A"))


def masked_attention(out_dir):
    io = load_file(os.path.join(out_dir, "flux_transformer_io.safetensors"))
    model = FluxTransformer2DModel.from_pretrained(os.path.join(out_dir, "tiny-flux-dev")).eval()
    text_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.int64)
    b, n = io["hidden"].shape[:2]
    joint = torch.cat([text_mask.bool(), torch.ones(b, n, dtype=torch.bool)], dim=1)  # [B, T + N]
    with torch.no_grad():
        out = model(hidden_states=io["hidden"], encoder_hidden_states=io["encoder"],
                    pooled_projections=io["pooled"], timestep=io["timestep"], img_ids=io["img_ids"],
                    txt_ids=io["txt_ids"], guidance=io["guidance"],
                    joint_attention_kwargs={"attention_mask": joint[:, None, None, :]}).sample
        plain = model(hidden_states=io["hidden"], encoder_hidden_states=io["encoder"],
                      pooled_projections=io["pooled"], timestep=io["timestep"], img_ids=io["img_ids"],
                      txt_ids=io["txt_ids"], guidance=io["guidance"]).sample
    assert (out - plain).abs().max() > 1e-4, "the mask must change the output"
    assert (plain - io["dev_out"]).abs().max() < 1e-5
    save_file({"text_mask": text_mask.contiguous(), "masked_out": out.contiguous()},
              os.path.join(out_dir, "flux_masked_attention_io.safetensors"))


def main():
    ref = {"source": "tools/ref/gen_flux_training_keys_ref.py", "anchors": ANCHORS, "sigma_cases": [],
           "beta_quantiles": [], "auto_shift": [], "lora_targets": {}, "lora_model": LORA_MODEL,
           "fast_schedule": [1.0] * 7 + [0.75, 0.5, 0.25]}
    for case in SIGMA_CASES:
        c = dict(case)
        c["expected"] = [float(x) for x in draw(case)]
        c["applied_shift"] = shift_of(case)
        ref["sigma_cases"].append(c)
    for a, b in [(2.0, 2.0), (0.5, 3.0)]:
        ref["beta_quantiles"].append({"alpha": a, "beta": b, "probs": PROBS,
                                      "quantiles": [float(scipy.stats.beta.ppf(p, a, b)) for p in PROBS]})
    for seq in [256, 1024, 4096, 3072]:
        mu = calculate_shift(seq, ANCHORS["base_image_seq_len"], ANCHORS["max_image_seq_len"], ANCHORS["base_shift"],
                             ANCHORS["max_shift"])
        ref["auto_shift"].append({"image_seq_len": seq, "shift": math.exp(mu)})
    for name, targets in ST_LORA_TARGETS.items():
        ref["lora_targets"][name] = {"simpletuner": targets, "adapted": adapted_modules(targets)}
    with open(os.path.join(OUT, "flux_training_keys_ref.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    masked_attention(OUT)


if __name__ == "__main__":
    main()
