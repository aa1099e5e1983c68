#!/usr/bin/env python3
"""Reference data for tests/models/test_flux_vae_unit.cpp: a tiny, randomly initialised diffusers
AutoencoderKL with Flux.1's VAE options (16 latent channels, no quant_conv / post_quant_conv,
shift_factor and scaling_factor as black-forest-labs/FLUX.1-dev's vae/config.json: 0.1159 and
0.3611) and what diffusers computes with it.

Writes tests/data/ref/tiny-flux-vae/ (a diffusers folder) and tests/data/ref/flux_vae_io.safetensors:
  image [1, 3, 32, 24] in [-1, 1] -> mean / logvar [1, 16, 4, 3]   (encode(...).latent_dist)
  latents [2, 16, 4, 3]           -> decoded [2, 3, 32, 24]         (decode(...).sample)
  scaled = (mean - shift_factor) * scaling_factor   (what FluxPipeline / training use)
Float32 on the CPU.

Usage: python3 tools/ref/gen_flux_vae_ref.py [out_dir]      (default tests/data/ref)
"""
import os
import sys

import torch
from diffusers import AutoencoderKL
from safetensors.torch import save_file


def main(out):
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=4,
                        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                        use_post_quant_conv=False, force_upcast=True, mid_block_add_attention=True)
    with torch.no_grad():
        for p in vae.parameters():
            fan_in = p[0].numel() if p.dim() > 1 else 1
            p.copy_(torch.randn_like(p) * (1.0 / fan_in**0.5 if p.dim() > 1 else 0.1))
    vae.eval()
    vae.save_pretrained(os.path.join(out, "tiny-flux-vae"), safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    image = torch.rand(1, 3, 32, 24, generator=g) * 2 - 1
    latents = torch.randn(2, 16, 4, 3, generator=g)
    with torch.no_grad():
        dist = vae.encode(image).latent_dist
        decoded = vae.decode(latents).sample
    scaled = (dist.mean - vae.config.shift_factor) * vae.config.scaling_factor
    save_file({"image": image, "mean": dist.mean.contiguous(), "logvar": dist.logvar.contiguous(),
               "latents": latents, "decoded": decoded.contiguous(), "scaled": scaled.contiguous()},
              os.path.join(out, "flux_vae_io.safetensors"))
    print("mean", tuple(dist.mean.shape), "decoded", tuple(decoded.shape))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/ref")
