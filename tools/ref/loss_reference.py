#!/usr/bin/env python3
"""Reference values for tests/diffusion/test_loss_reference.cpp: SimpleTuner's own loss and
timestep-bias code, evaluated on fixed inputs.

Runs, unchanged, the functions SimpleTuner trains with (commit bc8e6ab):
  simpletuner/helpers/models/common.py      ModelFoundation.loss, conditional_loss,
                                             compute_scheduled_huber_c
  simpletuner/helpers/training/min_snr_gamma.py  compute_snr
  simpletuner/helpers/training/custom_schedule.py generate_timestep_weights
  simpletuner/diff2flow/bridge.py                 DiffusionToFlowBridge (diff2flow_loss)
Nothing of SimpleTuner is copied here: each function's source is read from a checkout whose path
is given on the command line, compiled on its own (its module's heavy imports are not needed) and
called on a stand-in `self` holding the config, the SDXL DDPM schedule (scaled_linear 0.00085 to
0.012, 1000 steps) and the prediction type.

Usage:
  git -C <SimpleTuner git dir> archive bc8e6ab simpletuner/helpers simpletuner/diff2flow | tar -x -C /tmp/st
  python3 tools/ref/loss_reference.py /tmp/st > tests/data/ref/loss_reference.json
"""
import ast
import enum
import json
import math
import random
import sys
import types

import torch
import torch.nn.functional as F


class PredictionTypes(enum.Enum):  # the members SimpleTuner's loss compares against
    EPSILON = "epsilon"
    V_PREDICTION = "v_prediction"
    SAMPLE = "sample"
    FLOW_MATCHING = "flow_matching"


def load_functions(path, names, class_name=None, namespace=None):
    """Compiles the named top-level functions (or methods of class_name) of a source file."""
    tree = ast.parse(open(path).read(), path)
    body = tree.body
    if class_name:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name).body
    found = {}
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            module = ast.Module(body=[node], type_ignores=[])
            ns = dict(namespace or {})
            exec(compile(module, path, "exec"), ns)
            found[node.name] = ns[node.name]
    missing = set(names) - set(found)
    if missing:
        sys.exit(f"{path}: not found: {sorted(missing)}")
    return found


def main(root):
    helpers = f"{root}/simpletuner/helpers"
    snr_fn = load_functions(f"{helpers}/training/min_snr_gamma.py", ["compute_snr"])["compute_snr"]
    weights_fn = load_functions(f"{helpers}/training/custom_schedule.py", ["generate_timestep_weights"],
                                namespace={"torch": torch})["generate_timestep_weights"]
    ns = {"torch": torch, "F": F, "math": math, "random": random, "PredictionTypes": PredictionTypes,
          "compute_snr": snr_fn, "logger": types.SimpleNamespace(debug=lambda *a, **k: None)}
    methods = load_functions(f"{helpers}/models/common.py",
                             ["loss", "conditional_loss", "compute_scheduled_huber_c"],
                             class_name="ModelFoundation", namespace=ns)

    bridge_ns = {}
    exec(compile(open(f"{root}/simpletuner/diff2flow/bridge.py").read(), "bridge.py", "exec"), bridge_ns)
    bridge_cls = bridge_ns["DiffusionToFlowBridge"]

    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float32) ** 2
    alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)

    gen = torch.Generator().manual_seed(0)
    pred = torch.randn(3, 2, 2, 2, generator=gen)
    target = torch.randn(3, 2, 2, 2, generator=gen) * 1.5
    timesteps = torch.tensor([0, 417, 999])

    cases = []
    for prediction in ("epsilon", "v_prediction"):
        for loss_type in ("l2", "huber", "smooth_l1"):
            for schedule in ("snr", "exponential", "constant"):
                if loss_type == "l2" and schedule != "snr":
                    continue  # huber_schedule is not read for l2
                for huber_c in (0.1, 0.3):
                    if loss_type == "l2" and huber_c != 0.1:
                        continue
                    for snr_gamma in (None, 5.0):
                        for snr_weight in (1.0, 0.5):
                            config = types.SimpleNamespace(
                                loss_type=loss_type, huber_schedule=schedule, huber_c=huber_c,
                                snr_gamma=snr_gamma, snr_weight=snr_weight, diff2flow_loss=False,
                                diff2flow_enabled=False, scheduled_sampling_reflexflow=False)
                            noise_schedule = types.SimpleNamespace(
                                alphas_cumprod=alphas_cumprod,
                                config=types.SimpleNamespace(num_train_timesteps=1000, prediction_type=prediction))
                            model = types.SimpleNamespace(
                                config=config, noise_schedule=noise_schedule, diff2flow_bridge=None,
                                PREDICTION_TYPE=PredictionTypes(prediction),
                                get_prediction_target=lambda batch: batch["target"])
                            for name, fn in methods.items():
                                setattr(model, name, types.MethodType(fn, model))
                            batch = {"target": target, "timesteps": timesteps}
                            value = model.loss(batch, {"model_prediction": pred})
                            cases.append({"prediction_type": prediction, "loss_type": loss_type,
                                          "huber_schedule": schedule, "huber_c": huber_c, "snr_gamma": snr_gamma,
                                          "snr_weight": snr_weight, "loss": float(value)})

    # diff2flow_loss: the noisy input from latents and noise, the flow target noise - latents, and
    # SimpleTuner's loss through its bridge (float32 tables; SimpleTuner casts them to weight_dtype).
    latents = torch.randn(3, 2, 2, 2, generator=gen)
    noise = torch.randn(3, 2, 2, 2, generator=gen)
    a = alphas_cumprod[timesteps].view(-1, 1, 1, 1)
    noisy = a.sqrt() * latents + (1 - a).sqrt() * noise
    diff2flow = []
    for prediction in ("epsilon", "v_prediction"):
        config = types.SimpleNamespace(loss_type="huber", huber_schedule="snr", huber_c=0.1, snr_gamma=5.0,
                                       snr_weight=0.5, diff2flow_loss=True, diff2flow_enabled=True,
                                       scheduled_sampling_reflexflow=False)
        noise_schedule = types.SimpleNamespace(
            alphas_cumprod=alphas_cumprod,
            config=types.SimpleNamespace(num_train_timesteps=1000, prediction_type=prediction))
        model = types.SimpleNamespace(
            config=config, noise_schedule=noise_schedule,
            diff2flow_bridge=bridge_cls(alphas_cumprod=alphas_cumprod),
            PREDICTION_TYPE=PredictionTypes(prediction), get_prediction_target=lambda batch: batch["target"])
        for name, fn in methods.items():
            setattr(model, name, types.MethodType(fn, model))
        model.get_flow_target = lambda batch: batch["flow_target"]
        batch = {"target": target, "timesteps": timesteps, "noisy_latents": noisy, "flow_target": noise - latents,
                 "latents": latents, "noise": noise}
        diff2flow.append({"prediction_type": prediction, "loss": float(model.loss(batch, {"model_prediction": pred}))})

    probes = [0, 1, 199, 200, 249, 250, 499, 500, 749, 750, 998, 999]
    bias = []
    for strategy, multiplier, portion, begin, end in (
            ("none", 1.0, 0.25, 0, 1000), ("later", 2.0, 0.25, 0, 1000), ("earlier", 3.0, 0.25, 0, 1000),
            ("earlier", 0.5, 0.333, 0, 1000), ("later", 2.0, 0.0, 0, 1000), ("range", 3.0, 0.25, 200, 500),
            ("range", 2.0, 0.25, 600, 400)):
        args = types.SimpleNamespace(timestep_bias_strategy=strategy, timestep_bias_multiplier=multiplier,
                                     timestep_bias_portion=portion, timestep_bias_begin=begin,
                                     timestep_bias_end=end)
        w = weights_fn(args, 1000)
        bias.append({"strategy": strategy, "multiplier": multiplier, "portion": portion, "begin": begin,
                     "end": end, "sum": float(w.sum()), "probes": probes,
                     "values": [float(w[i]) for i in probes]})

    json.dump({"source": "SimpleTuner bc8e6ab (tools/ref/loss_reference.py)",
               "pred": pred.flatten().tolist(), "target": target.flatten().tolist(), "shape": [3, 2, 2, 2],
               "timesteps": timesteps.tolist(), "loss_cases": cases, "timestep_bias": bias,
               "latents": latents.flatten().tolist(), "noise": noise.flatten().tolist(),
               "noisy": noisy.flatten().tolist(), "diff2flow_cases": diff2flow},
              sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
