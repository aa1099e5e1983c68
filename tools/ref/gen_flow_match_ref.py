#!/usr/bin/env python3
"""Reference data for tests/diffusion/test_flow_match.cpp: diffusers' FlowMatchEulerDiscreteScheduler
and FluxPipeline's shift, for the scheduler configs Flux.1 [dev] and [schnell], SD3 and the
options LTX-Video and Mochi use (shift_terminal, invert_sigmas, linear time shift).

Writes tests/data/ref/flow_match_ref.json:
  mu: calculate_shift for several image token counts (Flux's defaults)
  cases: per case the scheduler config, the set_timesteps arguments (num_inference_steps, sigmas as
         FluxPipeline passes them, mu) and the resulting timesteps and sigmas (float32 values)
  training_sigmas: the scheduler's sigmas before set_timesteps (shift 3.0)
  steps: Euler steps of one Flux [dev] schedule: the initial sample, each step's model output and
         the sample after it
Usage: python3 tools/ref/gen_flow_match_ref.py [out_dir]      (default tests/data/ref)
"""
import json
import os
import sys

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

FLUX_DEV = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
            "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True}
FLUX_SCHNELL = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
                "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False}
SD3 = {"num_train_timesteps": 1000, "shift": 3.0}


def flux_sigmas(n):
    return np.linspace(1.0, 1 / n, n)


def case(name, config, n, sigmas=None, mu=None):
    s = FlowMatchEulerDiscreteScheduler.from_config({"_class_name": "FlowMatchEulerDiscreteScheduler", **config})
    s.set_timesteps(num_inference_steps=n, sigmas=None if sigmas is None else list(sigmas), mu=mu)
    return {"name": name, "config": {"_class_name": "FlowMatchEulerDiscreteScheduler", **config},
            "num_inference_steps": n, "sigmas_in": None if sigmas is None else [float(x) for x in sigmas],
            "mu": mu, "timesteps": [float(x) for x in s.timesteps.tolist()],
            "sigmas": [float(x) for x in s.sigmas.tolist()]}


def main(out):
    seqs = [256, 1024, 4032, 4096, 8192]
    mu = {str(q): calculate_shift(q, 256, 4096, 0.5, 1.15) for q in seqs}
    mu_1024 = calculate_shift(4096, 256, 4096, 0.5, 1.15)
    mu_768x1344 = calculate_shift(48 * 84, 256, 4096, 0.5, 1.15)
    cases = [
        case("default shift 1, 4 steps", {"num_train_timesteps": 1000}, 4),
        case("default shift 1, 28 steps", {"num_train_timesteps": 1000}, 28),
        case("sd3 shift 3, 28 steps", SD3, 28),
        case("flux dev 1024x1024, 28 steps", FLUX_DEV, 28, flux_sigmas(28), mu_1024),
        case("flux dev 768x1344, 4 steps", FLUX_DEV, 4, flux_sigmas(4), mu_768x1344),
        case("flux dev default sigmas, 7 steps", FLUX_DEV, 7, None, mu_1024),
        case("flux schnell, 4 steps", FLUX_SCHNELL, 4, flux_sigmas(4)),
        case("sd3 given sigmas, 5 steps", SD3, 5, flux_sigmas(5)),
        case("shift_terminal 0.1, 10 steps", {"shift": 2.0, "shift_terminal": 0.1}, 10),
        case("invert_sigmas, 5 steps", {"shift": 1.5, "invert_sigmas": True}, 5),
        case("linear time shift, 6 steps", {"use_dynamic_shifting": True, "time_shift_type": "linear"}, 6, None, 0.8),
    ]
    training = FlowMatchEulerDiscreteScheduler(shift=3.0).sigmas
    # Euler steps (float32) along flux dev 768x1344, 4 steps.
    s = FlowMatchEulerDiscreteScheduler.from_config(FLUX_DEV)
    s.set_timesteps(4, sigmas=list(flux_sigmas(4)), mu=mu_768x1344)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, generator=g)
    steps = {"x0": x.flatten().tolist(), "shape": list(x.shape), "outputs": [], "samples": []}
    for t in s.timesteps:
        v = torch.randn(2, 3, 4, generator=g)
        x = s.step(v, t, x).prev_sample
        steps["outputs"].append(v.flatten().tolist())
        steps["samples"].append(x.flatten().tolist())
    data = {"mu": mu, "cases": cases, "training_sigmas_shift3": [float(v) for v in training.tolist()],
            "steps": steps}
    with open(os.path.join(out, "flow_match_ref.json"), "w") as f:
        json.dump(data, f)
    print("cases", len(cases), "mu(4096)", mu["4096"])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/ref")
