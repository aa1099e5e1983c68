#!/usr/bin/env python3
"""Reference data for tests/models/test_quantize_parity.cpp: what optimum-quanto (the library behind
SimpleTuner's int8-quanto and fp8-quanto presets) stores and computes for a small model of one
Linear and one Conv2d, quantised with quantize(model, weights=qint8 / qfloat8) and freeze(), as
SimpleTuner's _quanto_model does for SDXL (no exclude list).

Writes tests/data/ref/quant_io.safetensors:
  linear.weight [24, 40], linear.bias [24], conv.weight [16, 8, 3, 3], conv.bias [16]  (float32)
  x_linear [3, 5, 40], x_conv [2, 8, 7, 6]                                            (inputs)
  for each of int8 and fp8:
    <q>.linear.data / .scale, <q>.conv.data / .scale   quanto's stored values (scale per output
                                                       channel, float32) with data as float32
    <q>.linear.out [3, 5, 24], <q>.conv.out [2, 16, 7, 6]   the frozen quantised model's outputs
One row of the linear weight is all zeros (quanto's scale is 0 there; dtune keeps 1: the data is 0
either way). Float32 on the CPU.

Usage: python3 tools/ref/gen_quant_ref.py [out_dir]      (default tests/data/ref); needs
  pip install optimum-quanto
"""
import os
import sys

import torch
from optimum.quanto import freeze, qfloat8, qint8, quantize
from safetensors.torch import save_file


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(40, 24)
        self.conv = torch.nn.Conv2d(8, 16, 3, padding=1)


def main(out):
    torch.manual_seed(0)
    base = Tiny()
    with torch.no_grad():
        base.linear.weight.mul_(3.0)
        base.linear.weight[5].zero_()
    g = torch.Generator().manual_seed(1)
    tensors = {
        "linear.weight": base.linear.weight.detach().clone(),
        "linear.bias": base.linear.bias.detach().clone(),
        "conv.weight": base.conv.weight.detach().clone(),
        "conv.bias": base.conv.bias.detach().clone(),
        "x_linear": torch.randn(3, 5, 40, generator=g),
        "x_conv": torch.randn(2, 8, 7, 6, generator=g),
    }
    for name, qtype in (("int8", qint8), ("fp8", qfloat8)):
        model = Tiny()
        model.load_state_dict(base.state_dict())
        quantize(model, weights=qtype)
        freeze(model)
        for layer in ("linear", "conv"):
            w = getattr(model, layer).weight
            tensors[f"{name}.{layer}.data"] = w._data.to(torch.float32).contiguous()
            tensors[f"{name}.{layer}.scale"] = w._scale.reshape(-1).to(torch.float32).contiguous()
        with torch.no_grad():
            tensors[f"{name}.linear.out"] = model.linear(tensors["x_linear"]).contiguous()
            tensors[f"{name}.conv.out"] = model.conv(tensors["x_conv"]).contiguous()
    save_file(tensors, os.path.join(out, "quant_io.safetensors"))
    for k, v in tensors.items():
        print(k, tuple(v.shape))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/ref")
