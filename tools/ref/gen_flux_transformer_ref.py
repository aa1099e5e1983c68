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
  dev_out_fp8 [2, 12, 16]                    (the [dev] model with its weights rounded to fp8 e4m3)
and the [dev] model in Black Forest Labs' single-file layout: tests/data/ref/tiny-flux-dev-bfl.safetensors
(float32) and tiny-flux-dev-comfy-fp8.safetensors (ComfyUI's model.diffusion_model. prefix, fp8 e4m3).
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


def to_bfl(sd, num_layers, num_single, inner):
    """diffusers' names -> Black Forest Labs' (the inverse of diffusers'
    convert_flux_transformer_checkpoint_to_diffusers: fused q/k/v and linear1, (shift, scale) order
    of the final AdaLN)."""
    out = {}
    used = set()

    class Reads(dict):  # records every diffusers key read, to check that none is left out
        def __getitem__(self, k):
            used.add(k)
            return dict.__getitem__(self, k)
    sd = Reads(sd)

    def both(dst, src):
        for part in ("weight", "bias"):
            out[f"{dst}.{part}"] = sd[f"{src}.{part}"]
    both("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1")
    both("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2")
    both("vector_in.in_layer", "time_text_embed.text_embedder.linear_1")
    both("vector_in.out_layer", "time_text_embed.text_embedder.linear_2")
    if "time_text_embed.guidance_embedder.linear_1.weight" in sd:
        both("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1")
        both("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2")
    both("txt_in", "context_embedder")
    both("img_in", "x_embedder")
    for i in range(num_layers):
        d, b = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        both(d + "img_mod.lin", b + "norm1.linear")
        both(d + "txt_mod.lin", b + "norm1_context.linear")
        for part in ("weight", "bias"):
            out[f"{d}img_attn.qkv.{part}"] = torch.cat([sd[f"{b}attn.to_{x}.{part}"] for x in "qkv"])
            out[f"{d}txt_attn.qkv.{part}"] = torch.cat([sd[f"{b}attn.add_{x}_proj.{part}"] for x in "qkv"])
        out[d + "img_attn.norm.query_norm.scale"] = sd[b + "attn.norm_q.weight"]
        out[d + "img_attn.norm.key_norm.scale"] = sd[b + "attn.norm_k.weight"]
        out[d + "txt_attn.norm.query_norm.scale"] = sd[b + "attn.norm_added_q.weight"]
        out[d + "txt_attn.norm.key_norm.scale"] = sd[b + "attn.norm_added_k.weight"]
        both(d + "img_mlp.0", b + "ff.net.0.proj")
        both(d + "img_mlp.2", b + "ff.net.2")
        both(d + "txt_mlp.0", b + "ff_context.net.0.proj")
        both(d + "txt_mlp.2", b + "ff_context.net.2")
        both(d + "img_attn.proj", b + "attn.to_out.0")
        both(d + "txt_attn.proj", b + "attn.to_add_out")
    for i in range(num_single):
        d, b = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        both(d + "modulation.lin", b + "norm.linear")
        for part in ("weight", "bias"):
            out[f"{d}linear1.{part}"] = torch.cat([sd[f"{b}attn.to_q.{part}"], sd[f"{b}attn.to_k.{part}"],
                                                  sd[f"{b}attn.to_v.{part}"], sd[f"{b}proj_mlp.{part}"]])
        out[d + "norm.query_norm.scale"] = sd[b + "attn.norm_q.weight"]
        out[d + "norm.key_norm.scale"] = sd[b + "attn.norm_k.weight"]
        both(d + "linear2", b + "proj_out")
    both("final_layer.linear", "proj_out")
    for part in ("weight", "bias"):
        scale, shift = sd[f"norm_out.linear.{part}"].chunk(2)
        out[f"final_layer.adaLN_modulation.1.{part}"] = torch.cat([shift, scale])
    assert used == set(sd.keys()), set(sd.keys()) - used
    return {k: v.contiguous() for k, v in out.items()}


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
        if guidance:
            # The same weights in BFL's layout: float32, and ComfyUI-prefixed in fp8 e4m3 (with the
            # output of the model holding those fp8-rounded weights).
            sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
            bfl = to_bfl(sd, 2, 2, 16)
            save_file(bfl, os.path.join(out, "tiny-flux-dev-bfl.safetensors"))
            fp8 = {"model.diffusion_model." + k: v.to(torch.float8_e4m3fn) for k, v in bfl.items()}
            save_file(fp8, os.path.join(out, "tiny-flux-dev-comfy-fp8.safetensors"))
            rounded = tiny(True)
            rounded.load_state_dict({k: v.to(torch.float8_e4m3fn).float() for k, v in sd.items()})
            with torch.no_grad():
                io["dev_out_fp8"] = rounded(hidden_states=io["hidden"], encoder_hidden_states=io["encoder"],
                                            pooled_projections=io["pooled"], timestep=io["timestep"],
                                            img_ids=io["img_ids"], txt_ids=io["txt_ids"],
                                            guidance=io["guidance"]).sample.contiguous()
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
