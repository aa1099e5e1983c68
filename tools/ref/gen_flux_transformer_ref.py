#!/usr/bin/env python3
"""Reference data for tests/models/test_flux_transformer_unit.cpp: two tiny, randomly initialised
diffusers FluxTransformer2DModel (the Flux.1 architecture at toy width: double-stream and
single-stream blocks, 3-axis RoPE, AdaLN modulations; one with the guidance embedding of [dev],
one without, as [schnell]) and what diffusers computes with them.

Writes tests/data/ref/tiny-flux-dev/ and tests/data/ref/tiny-flux-schnell/ (config.json +
diffusion_pytorch_model.safetensors, diffusers folders) and tests/data/ref/flux_transformer_io.safetensors:
  hidden [2, 12, 16] (a 6x8 latent of 4 channels packed 2x2), encoder [2, 5, 24], pooled [2, 12],
  timestep [2] (sigmas), guidance [2], img_ids [12, 3], txt_ids [5, 3],
  dev_out / schnell_out [2, 12, 16]          (FluxTransformer2DModel(...).sample)
  dev_out_bf16 [2, 12, 16]                   (the [dev] model and inputs in bf16, stored as float32)
  latents [2, 4, 6, 8], packed [2, 12, 16]   (FluxPipeline._pack_latents)
Every weight is random and non-zero. Float32 on the CPU.

Usage: python3 tools/ref/gen_flux_transformer_ref.py [out_dir]      (default tests/data/ref)
"""
import os
import sys

import torch
from diffusers import FluxPipeline, FluxTransformer2DModel
from safetensors.torch import save_file


def tiny(guidance):
    torch.manual_seed(0 if guidance else 1)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=24,
                                   pooled_projection_dim=12, guidance_embeds=guidance, axes_dims_rope=(2, 2, 4))
    with torch.no_grad():
        for p in model.parameters():  # every weight non-zero, activations of order 1
            fan_in = p[0].numel() if p.dim() > 1 else 1
            p.copy_(torch.randn_like(p) * (1.0 / fan_in**0.5 if p.dim() > 1 else 0.1))
    return model.eval()


def main(out):
    g = torch.Generator().manual_seed(2)
    latents = torch.randn(2, 4, 6, 8, generator=g)
    packed = FluxPipeline._pack_latents(latents, 2, 4, 6, 8)
    img_ids = FluxPipeline._prepare_latent_image_ids(2, 3, 4, "cpu", torch.float32)
    io = {"latents": latents, "packed": packed.contiguous(), "hidden": packed.clone(),
          "encoder": torch.randn(2, 5, 24, generator=g), "pooled": torch.randn(2, 12, generator=g),
          "timestep": torch.tensor([0.3, 0.9]), "guidance": torch.tensor([3.5, 1.0]),
          "img_ids": img_ids.contiguous(), "txt_ids": torch.zeros(5, 3)}
    for name, guidance in (("dev", True), ("schnell", False)):
        model = tiny(guidance)
        model.save_pretrained(os.path.join(out, f"tiny-flux-{name}"), safe_serialization=True)
        with torch.no_grad():
            o = model(hidden_states=io["hidden"], encoder_hidden_states=io["encoder"],
                      pooled_projections=io["pooled"], timestep=io["timestep"], img_ids=io["img_ids"],
                      txt_ids=io["txt_ids"], guidance=io["guidance"] if guidance else None).sample
        io[f"{name}_out"] = o.contiguous()
        if guidance:  # the same in bf16 (weights and inputs), as a bf16 run computes it
            m16 = model.to(torch.bfloat16)
            with torch.no_grad():
                o16 = m16(hidden_states=io["hidden"].bfloat16(), encoder_hidden_states=io["encoder"].bfloat16(),
                          pooled_projections=io["pooled"].bfloat16(), timestep=io["timestep"].bfloat16(),
                          img_ids=io["img_ids"], txt_ids=io["txt_ids"], guidance=io["guidance"].bfloat16()).sample
            io["dev_out_bf16"] = o16.float().contiguous()
        print(name, tuple(o.shape), float(o.abs().max()))
    save_file(io, os.path.join(out, "flux_transformer_io.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/ref")
