#!/usr/bin/env python3
"""Reference data for the Flux LoRA key layouts in tests/validate/test_flux_pipeline.cpp: a random
LoRA on every linear layer of the tiny Flux pipeline (tools/ref/tiny_flux_pipeline.py), written in
the two non-diffusers layouts people download, and the pipeline's output with it.

  tests/data/ref/tiny-flux-lora-kohya.safetensors  kohya / ComfyUI: lora_unet_<BFL module, '.' -> '_'>
      .lora_down.weight / .lora_up.weight / .alpha (alpha / rank = 0.5 .. 4 per layer). The image
      q/k/v LoRA of the double block is sd-scripts' split_qkv form (down [3r, in], up block-diagonal).
  tests/data/ref/tiny-flux-lora-bfl.safetensors    Black Forest Labs: diffusion_model.<BFL module>
      .lora_A.weight / .lora_B.weight, no alpha (scale 1).
Both cover the fused layers that must be split (double_blocks.0.{img,txt}_attn.qkv ->
to_q/k/v and add_q/k/v_proj, single_blocks.0.linear1 -> to_q/k/v + proj_mlp), the embedders
(img_in, txt_in, time_in, vector_in, guidance_in) and the final layer (whose AdaLN halves diffusers
stores swapped).

tests/data/ref/flux_lora_io.safetensors, for tiny_flux_pipeline.REQUEST (seed 0, 3 steps):
  kohya_latents [1, 16, 6, 4], kohya_image [1, 3, 48, 32]   the kohya file applied
  bfl_latents, bfl_image                                    the BFL file applied
  kohya_image_diffusers, bfl_image_diffusers                FluxPipeline.load_lora_weights on the
      part of each file that diffusers 0.42 applies (see below), the BFL one under ComfyUI's
      lora_down / lora_up names (diffusers ignores lora_A / lora_B keys of a BFL-layout Flux.1 file)

What "applied" means: the LoRA merged into the transformer's weights in Black Forest Labs' layout,
W += alpha / rank * up @ down (ComfyUI's rule for these files), the merged fused weights split into
diffusers' names (from_bfl below, the inverse of gen_flux_transformer_ref.to_bfl) and run by
diffusers' FluxPipeline. diffusers' own loader cannot be the reference for the whole file: its kohya
converter splits linear1 with FLUX.1's sizes written in (3072 / 12288), and drops the LoRAs of the
embedders and the final layer (their converted keys lack the "transformer." prefix). On the part it
does apply (the double blocks and single_blocks.*.{linear2, modulation}) this script asserts that
load_lora_weights and the merged weights give the same image, and records diffusers' image.

Usage: python3 tools/ref/gen_flux_lora_layouts_ref.py <shared fixtures dir> [out_dir]   (default tests/data/ref)
"""
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_flux_pipeline  # noqa: E402
from gen_flux_transformer_ref import to_bfl  # noqa: E402


def from_bfl(bfl, num_layers, num_single, inner):
    """Black Forest Labs' names -> diffusers' (fused rows split in q, k, v(, mlp) order; the final
    AdaLN's (shift, scale) halves swapped to (scale, shift))."""
    out = {}

    def both(dst, src):
        for part in ("weight", "bias"):
            out[f"{dst}.{part}"] = bfl[f"{src}.{part}"]

    def rows(dsts, src, sizes):
        for part in ("weight", "bias"):
            for dst, value in zip(dsts, torch.split(bfl[f"{src}.{part}"], sizes)):
                out[f"{dst}.{part}"] = value
    both("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer")
    both("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer")
    both("time_text_embed.text_embedder.linear_1", "vector_in.in_layer")
    both("time_text_embed.text_embedder.linear_2", "vector_in.out_layer")
    both("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer")
    both("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer")
    both("context_embedder", "txt_in")
    both("x_embedder", "img_in")
    for i in range(num_layers):
        d, b = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        both(b + "norm1.linear", d + "img_mod.lin")
        both(b + "norm1_context.linear", d + "txt_mod.lin")
        rows([b + "attn.to_q", b + "attn.to_k", b + "attn.to_v"], d + "img_attn.qkv", [inner] * 3)
        rows([b + "attn.add_q_proj", b + "attn.add_k_proj", b + "attn.add_v_proj"], d + "txt_attn.qkv", [inner] * 3)
        out[b + "attn.norm_q.weight"] = bfl[d + "img_attn.norm.query_norm.scale"]
        out[b + "attn.norm_k.weight"] = bfl[d + "img_attn.norm.key_norm.scale"]
        out[b + "attn.norm_added_q.weight"] = bfl[d + "txt_attn.norm.query_norm.scale"]
        out[b + "attn.norm_added_k.weight"] = bfl[d + "txt_attn.norm.key_norm.scale"]
        both(b + "ff.net.0.proj", d + "img_mlp.0")
        both(b + "ff.net.2", d + "img_mlp.2")
        both(b + "ff_context.net.0.proj", d + "txt_mlp.0")
        both(b + "ff_context.net.2", d + "txt_mlp.2")
        both(b + "attn.to_out.0", d + "img_attn.proj")
        both(b + "attn.to_add_out", d + "txt_attn.proj")
    for i in range(num_single):
        d, b = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        both(b + "norm.linear", d + "modulation.lin")
        rows([b + "attn.to_q", b + "attn.to_k", b + "attn.to_v", b + "proj_mlp"], d + "linear1",
             [inner, inner, inner, 4 * inner])
        out[b + "attn.norm_q.weight"] = bfl[d + "norm.query_norm.scale"]
        out[b + "attn.norm_k.weight"] = bfl[d + "norm.key_norm.scale"]
        both(b + "proj_out", d + "linear2")
    both("proj_out", "final_layer.linear")
    for part in ("weight", "bias"):
        shift, scale = bfl[f"final_layer.adaLN_modulation.1.{part}"].chunk(2)
        out[f"norm_out.linear.{part}"] = torch.cat([scale, shift])
    return out


def lora_modules(bfl):
    """Every LoRA-adaptable (2-D weight) module of the BFL state dict, with its weight shape."""
    return {k[:-len(".weight")]: tuple(v.shape) for k, v in sorted(bfl.items())
            if k.endswith(".weight") and v.dim() == 2}


def make_lora(modules, seed):
    """{module: (down [r, in], up [out, r], alpha)} with random factors; ranks 4, some 2; the
    double block's image q/k/v in sd-scripts' split_qkv form (rank 3 x 2, up block-diagonal)."""
    g = torch.Generator().manual_seed(seed)
    lora = {}
    for n, (name, (rows, cols)) in enumerate(modules.items()):
        r = 2 if "linear2" in name or "vector_in" in name else 4
        down = torch.randn(r, cols, generator=g) * 0.5 / cols**0.5 * 4
        up = torch.randn(rows, r, generator=g) * 0.5
        if name == "double_blocks.0.img_attn.qkv":
            r = 6
            down = torch.randn(r, cols, generator=g) * 2 / cols**0.5
            up = torch.zeros(rows, r)
            third = rows // 3
            for j in range(3):
                up[j * third:(j + 1) * third, 2 * j:2 * j + 2] = torch.randn(third, 2, generator=g) * 0.5
        alpha = r * [0.5, 1.0, 2.0, 4.0][n % 4]
        lora[name] = (down.contiguous(), up.contiguous(), float(alpha))
    return lora


def diffusers_applies(module):
    """What diffusers 0.42's Flux kohya converter applies at the tiny model's sizes."""
    return module.startswith("double_blocks.") or (module.startswith("single_blocks.") and "linear1" not in module)


def merged_pipeline(pipe, base_sd, lora, use_alpha):
    """The pipeline with the LoRA merged into the BFL-layout weights (ComfyUI's rule)."""
    cfg = pipe.transformer.config
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    bfl = to_bfl({k: v.clone() for k, v in base_sd.items()}, cfg.num_layers, cfg.num_single_layers, inner)
    for name, (down, up, alpha) in lora.items():
        scale = alpha / down.shape[0] if use_alpha else 1.0
        bfl[name + ".weight"] = bfl[name + ".weight"] + scale * (up @ down)
    pipe.transformer.load_state_dict(from_bfl(bfl, cfg.num_layers, cfg.num_single_layers, inner), strict=True)
    return pipe


def main(fixtures, out):
    pipe = tiny_flux_pipeline.load(out, fixtures)
    cfg = pipe.transformer.config
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    base_sd = {k: v.detach().clone() for k, v in pipe.transformer.state_dict().items()}
    bfl_base = to_bfl({k: v.clone() for k, v in base_sd.items()}, cfg.num_layers, cfg.num_single_layers, inner)
    assert all(torch.equal(v, base_sd[k])
               for k, v in from_bfl(bfl_base, cfg.num_layers, cfg.num_single_layers, inner).items())
    modules = lora_modules(bfl_base)
    _, base_image = tiny_flux_pipeline.run(pipe)
    io = {}

    def kohya_file(lora):
        sd = {}
        for name, (down, up, alpha) in lora.items():
            key = "lora_unet_" + name.replace(".", "_")
            sd[key + ".lora_down.weight"] = down
            sd[key + ".lora_up.weight"] = up
            sd[key + ".alpha"] = torch.tensor(alpha)
        return sd

    def bfl_file(lora, down_name="lora_A", up_name="lora_B"):
        sd = {}
        for name, (down, up, _) in lora.items():
            sd[f"diffusion_model.{name}.{down_name}.weight"] = down
            sd[f"diffusion_model.{name}.{up_name}.weight"] = up
        return sd

    for layout, seed, use_alpha in (("kohya", 11, True), ("bfl", 12, False)):
        lora = make_lora(modules, seed)
        if not use_alpha:  # BFL files carry no alpha: scale 1
            lora = {k: (d, u, float(d.shape[0])) for k, (d, u, _) in lora.items()}
        if layout == "kohya":
            save_file(kohya_file(lora), os.path.join(out, "tiny-flux-lora-kohya.safetensors"))
        else:
            save_file(bfl_file(lora), os.path.join(out, "tiny-flux-lora-bfl.safetensors"))
        latents, image = tiny_flux_pipeline.run(merged_pipeline(pipe, base_sd, lora, use_alpha))
        io[f"{layout}_latents"], io[f"{layout}_image"] = latents, image
        # diffusers' own loader on the part it applies, against the merged weights of that part.
        part = {k: v for k, v in lora.items() if diffusers_applies(k)}
        _, merged_part = tiny_flux_pipeline.run(merged_pipeline(pipe, base_sd, part, use_alpha))
        pipe.transformer.load_state_dict(base_sd)
        pipe.load_lora_weights(kohya_file(part) if layout == "kohya" else bfl_file(part, "lora_down", "lora_up"))
        _, diffusers_part = tiny_flux_pipeline.run(pipe)
        pipe.unload_lora_weights()
        gap = float((diffusers_part - merged_part).abs().max())
        effect = float((diffusers_part - base_image).abs().max())
        assert gap < 2e-5 and effect > 0.02, (layout, gap, effect)
        io[f"{layout}_image_diffusers"] = diffusers_part
        print(layout, "LoRA effect", float((image - base_image).abs().max()), "diffusers part effect", effect,
              "load_lora_weights vs merged", gap)
    save_file(io, os.path.join(out, "flux_lora_io.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "tests/data/ref")
