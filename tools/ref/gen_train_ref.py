#!/usr/bin/env python3
"""Reference values for dtune's optimizer, clipping and LR-schedule tests.

    python tools/ref/gen_train_ref.py tests/data/ref

Uses torch.optim (AdamW, SGD), torch.nn.utils.clip_grad_*, and diffusers.optimization.get_scheduler,
all in float32/float64 on the CPU. Writes train_ref.safetensors and train_ref.json (small).
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file

out_dir = sys.argv[1] if len(sys.argv) > 1 else "tests/data/ref"
T = {}
J = {"torch_version": torch.__version__, "schedules": {}}

# --- optimizers: two small parameters, five steps with fixed gradients
g = torch.Generator().manual_seed(2024)
p0 = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
grads = [[torch.randn(p.shape, generator=g) for p in p0] for _ in range(5)]
for i, p in enumerate(p0):
    T[f"init.{i}"] = p.clone()
    T[f"grads.{i}"] = torch.stack([gs[i] for gs in grads])


def run(name, make):
    params = [torch.nn.Parameter(p.clone()) for p in p0]
    opt = make(params)
    for step in range(5):
        for p, gr in zip(params, grads[step]):
            p.grad = gr.clone()
        opt.step()
    for i, p in enumerate(params):
        T[f"{name}.{i}"] = p.detach().clone()
    return opt, params


opt, params = run("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                                          weight_decay=0.05, foreach=False))
for i, p in enumerate(params):
    T[f"adamw.exp_avg.{i}"] = opt.state[p]["exp_avg"].clone()
    T[f"adamw.exp_avg_sq.{i}"] = opt.state[p]["exp_avg_sq"].clone()
run("sgd", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, foreach=False))
run("sgd_nesterov", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, foreach=False))
run("adafactor", lambda ps: torch.optim.Adafactor(ps, lr=1e-2, weight_decay=0.01, foreach=False))
run("sgd_plain", lambda ps: torch.optim.SGD(ps, lr=0.05, foreach=False))

# --- gradient clipping
for name, fn in {"norm": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.5),
                 "value": lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.3)}.items():
    params = [torch.nn.Parameter(p.clone()) for p in p0]
    for p, gr in zip(params, grads[0]):
        p.grad = gr.clone() * 2
    total = fn(params)
    if total is not None:
        T[f"clip_{name}.total"] = total.reshape(1).clone()
    for i, p in enumerate(params):
        T[f"clip_{name}.{i}"] = p.grad.clone()

# --- LR schedules (diffusers.optimization), lr before each of N optimizer steps. The schedule
# functions are called directly so num_cycles and lr_end reach them (get_scheduler drops both).
import diffusers.optimization as O

cases = {
    "constant": (O.get_constant_schedule, dict()),
    "constant_with_warmup": (O.get_constant_schedule_with_warmup, dict(num_warmup_steps=7)),
    "linear": (O.get_linear_schedule_with_warmup, dict(num_warmup_steps=5, num_training_steps=40)),
    "cosine": (O.get_cosine_schedule_with_warmup, dict(num_warmup_steps=5, num_training_steps=40, num_cycles=0.5)),
    "cosine_1cycle": (O.get_cosine_schedule_with_warmup, dict(num_warmup_steps=0, num_training_steps=40, num_cycles=1.0)),
    "cosine_with_restarts": (O.get_cosine_with_hard_restarts_schedule_with_warmup,
                             dict(num_warmup_steps=4, num_training_steps=40, num_cycles=3)),
    "polynomial": (O.get_polynomial_decay_schedule_with_warmup,
                   dict(num_warmup_steps=6, num_training_steps=40, power=0.8, lr_end=2e-5)),
}
for case, (fn, kw) in cases.items():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1e-3)
    sched = fn(opt, **kw)
    lrs = []
    for _ in range(46):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    name = case if case != "cosine_1cycle" else "cosine"
    J["schedules"][case] = dict(name=name, base_lr=1e-3, lrs=lrs, **kw)

os.makedirs(out_dir, exist_ok=True)
save_file({k: v.contiguous() for k, v in T.items()}, os.path.join(out_dir, "train_ref.safetensors"))
with open(os.path.join(out_dir, "train_ref.json"), "w") as f:
    json.dump(J, f, indent=1)
print(f"wrote {len(T)} tensors and {len(J['schedules'])} schedules")
